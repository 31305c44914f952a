"""``preheat serve``: bind first, answer ``/health`` at once, load the model behind it.

The HTTP layer is ``preheat.http.server``'s, over the standard library's ``ThreadingHTTPServer`` (one thread per
connection): importing a web framework would cost more than the whole server needs, and this file is on the
cold-start path. The order of a start:

1. ``imports`` (process start -> ``run``) and ``config`` (settings checked, socket bound) are recorded on the
   timeline; from here ``/health`` answers 503 and ``/v1/preheat/timeline`` shows the load as it happens;
2. a loader thread fetches, imports the engine, loads, warms up and marks ``ready`` (``preheat.server.loading``);
3. ``/health`` turns 200 and generation requests are handed to the single generation worker.

Routes: docs/server.md. ``/v1/*`` needs the API key (``/health`` and ``/metrics`` are for probes and scrapers), but
the control routes, which take the admin key instead and refuse web pages (``preheat.http.control``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from preheat.core import env
from preheat.core.errors import APIError, ConfigError, PreheatError
from preheat.core.procs import listening_line
from preheat.core.timeline import Timeline, process_start_time
from preheat.dashboard.login import Login
from preheat.http.control import CONTROL_ROUTES, TIMELINE_ROUTE, TOKENIZER_ROUTE, control_refusal, request_of
from preheat.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from preheat.http.server import CLOSE, BodyRefusal, TrackedHandler, TrackedServer, check_bearer, sigterm_interrupts
from preheat.http.tls import use_fleet
from preheat.server import openai, sse
from preheat.server.following import REFIT_ROUTE  # --follow; docs/refit.md; the other control routes: lifecycle.py
from preheat.server.lifecycle import resume_gc
from preheat.server.settings import ServeSettings
from preheat.server.state import LOADING, ServerState
from preheat.text.process import ProcessTokenizer, TokenizerProcess
from preheat.text.request import MAX_BODY_BYTES

if TYPE_CHECKING:
    from preheat.dashboard.watch import Findings

log = logging.getLogger("preheat.server")
MAX_BODY = MAX_BODY_BYTES
GENERATION_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
# The model's tokenizer files, for a router started with --model @replicas (docs/router.md): it then reads prompts
# exactly as this replica does.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


class PreheatHTTPServer(TrackedServer):
    """The shared server base (``preheat.http.server``) carrying the shared ``ServerState``."""

    def __init__(self, address: tuple[str, int], state: ServerState) -> None:
        self.state = state
        self.say: Callable[[str], None] = lambda line: print(line, flush=True)  # run() sets its announcer
        self.login = Login.lasting(state.settings.dashboard_session_ttl)  # the dashboard's sessions
        super().__init__(address, Handler)


class Handler(TrackedHandler):
    """Routes one connection's requests (HTTP/1.1 keep-alive, TCP_NODELAY: ``TrackedHandler``)."""

    server_version = "preheat"
    # Socket timeout for reads and writes: an idle keep-alive connection or a client that stops reading its stream
    # for this long loses its thread (and its generation) instead of holding them forever.
    timeout = 300
    server: PreheatHTTPServer

    # -- plumbing ------------------------------------------------------------------------------------------------
    @property
    def state(self) -> ServerState:
        return self.server.state

    def send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json", headers)

    def send_error_json(self, error: APIError, headers: dict[str, str] | None = None) -> None:
        self.send_json(error.status, error.body(), headers)

    def refuse_unread(self, error: APIError, headers: dict[str, str] | None = None) -> None:
        """Answer ``error`` without reading the request's body, and close the connection: its unread bytes would
        otherwise be parsed as the next request of a keep-alive client (``Connection: close`` tells it so)."""
        self.send_error_json(error, {**(headers or {}), **CLOSE})

    def answered(self, status: int) -> None:
        self.count(status)

    def count(self, status: int) -> None:
        self.state.metrics.requests.inc(endpoint=self.route(), status=str(status))

    def route(self) -> str:
        path = self.path.split("?", 1)[0]
        known = ("/health", "/metrics", "/v1/models", TIMELINE_ROUTE, TOKENIZER_ROUTE, *GENERATION_ROUTES,
                 *CONTROL_ROUTES)  # fmt: skip
        return path if path in known else "other"  # bounded label values: never the raw path

    def authorized(self) -> bool:
        """The API key's check, on every ``/v1/*`` route but the control routes (``control`` checks those)."""
        key = self.state.settings.api_key
        if not key or not self.path.startswith("/v1/") or self.path.split("?", 1)[0] in CONTROL_ROUTES:
            return True
        if check_bearer(self.headers.get("Authorization"), key) == "ok":
            return True
        self.refuse_unread(
            APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                type="authentication_error",
                code="invalid_api_key",
            ),
            {"WWW-Authenticate": "Bearer"},
        )
        return False

    def read_body(self) -> bytes | None:
        """The request body, or None after answering 411/413 (no length, or too large)."""
        body = self.read_body_within(MAX_BODY)
        if isinstance(body, BodyRefusal):
            self.refuse_unread(APIError(body.status, body.message, code=body.code))
            return None
        return body

    # -- routes --------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        path = self.path.split("?", 1)[0]
        if not self.authorized():
            return
        if path == "/health":
            self.health()
        elif path == "/metrics":
            self.send_body(200, self.state.metrics.render().encode(), METRICS_CONTENT_TYPE)
        elif path == "/v1/models":
            limit = self.state.from_loaded(lambda loaded: loaded.engine.max_model_len)
            models = openai.models_list(self.state.settings.model_name, self.state.created, limit)
            if self.state.refit is not None:  # --follow: the weights version this replica serves now
                for model in models["data"]:  # type: ignore[attr-defined]  # models_list's own list of dicts
                    model["version"] = self.state.refit.version or 0
            self.send_json(200, models)
        elif path == TIMELINE_ROUTE:
            self.send_json(200, self.state.timeline.to_dict())
        elif path == "/v1/kv/events":
            self.kv_events()
        elif path == TOKENIZER_ROUTE:
            self.tokenizer_files()
        elif path == "/dashboard" or path.startswith("/dashboard/"):
            self.dashboard()
        elif path in GENERATION_ROUTES:
            self.send_error_json(APIError(405, f"use POST for {path}", code="method_not_allowed"))
        else:
            self.send_error_json(APIError(404, f"no route {path}", code="not_found"))

    def do_POST(self) -> None:  # noqa: N802 - http.server dispatches on this name
        path = self.path.split("?", 1)[0]
        if path in CONTROL_ROUTES:  # their own key and checks, not the API key's
            self.control(path)
            return
        if not self.authorized():
            return
        if path == "/dashboard" or path.startswith("/dashboard/"):  # the dashboard's login form
            self.dashboard()
            return
        kind = GENERATION_ROUTES.get(path)
        if kind is None:
            self.refuse_unread(APIError(404, f"no route {path}", code="not_found"))
            return
        if self.state.refit is not None:
            from preheat.server.following import stale_refusal

            stale = stale_refusal(self.state)
            if stale is not None:
                self.refuse_unread(stale, {"Retry-After": "1"})
                return
        body = self.read_body()
        if body is None:
            return
        from preheat.server.generation import handle_generation

        handle_generation(self, self.state, kind, body)

    def health(self) -> None:
        state = self.state
        if state.ready.is_set():
            answer: dict[str, object] = {"status": "ok", "model": state.settings.model_name}
            if state.refit is not None:  # --follow: the version served, the newest seen, the last failure
                answer |= {"version": state.refit.version or 0, "epoch": state.refit.epoch or 0,
                           "refit": state.refit.status()}  # fmt: skip
            self.send_json(200, answer)
        elif state.load_error is not None:
            self.send_json(503, {"status": "failed", "error": state.load_error})
        elif state.life.phase != LOADING:  # standby, sleeping, waking, draining: never 200 (lifecycle.py)
            self.send_json(503, state.life.health())
        else:
            stage = state.loading_stage()  # kv_warm: --kv-warm fills L1 from L2 (server/kvtier.py)
            self.send_json(503, {"status": "warming" if stage == "kv_warm" else "loading", "stage": stage})

    def dashboard(self) -> None:
        """The dashboard of this one replica (preheat.dashboard), behind the --api-key when one is set."""
        from preheat.dashboard.state import ReplicaRow, StateDocument
        from preheat.dashboard.watch import ReplicaDashboard
        from preheat.dashboard.web import answer

        state = self.state
        if state.dashboard is None:
            state.dashboard = ReplicaDashboard()
        board = state.dashboard

        def document() -> StateDocument:
            host, port = self.server.socket.getsockname()[:2]
            ready = state.ready.is_set()
            phase = "ok" if ready else "failed" if state.load_error else state.life.phase
            if not ready and phase == LOADING:
                phase = f"loading: {state.loading_stage()}"
            waiting, running = state._load()
            row = ReplicaRow(f"http://{host}:{port}", ready, phase, state.settings.standby, waiting + running)
            return board.state(row, state.metrics.render(), state.timeline.to_dict(), state.findings)

        answer(self, state.settings.api_key, document, self.server.login)

    def control(self, path: str) -> None:
        """The control routes (``preheat.server.lifecycle``, ``following``): activation, sleep, wake, refit; each
        only for whom ``preheat.http.control`` lets through."""
        from preheat.server import lifecycle

        settings = self.state.settings
        refused = control_refusal(
            request_of(self), admin_key=settings.admin_key, api_key=settings.api_key, bound_host=settings.host
        )
        if refused is not None:
            error = APIError(refused.status, refused.message, type=refused.type, code=refused.code)
            self.refuse_unread(error, dict(refused.headers))
            return
        body = self.read_body()
        if body is None:
            return
        say = self.server.say
        try:
            if path == REFIT_ROUTE:
                from preheat.server.following import handle_refit

                handle_refit(self, self.state, body)
            elif path == "/v1/preheat/load":
                lifecycle.handle_load(self, self.state, body, say)
            elif path == "/v1/preheat/sleep":
                if self.state.refit is not None:  # a wake reloads the checkpoint: the followed version would be lost
                    raise APIError(409, "a --follow replica does not sleep (docs/refit.md)", code="following")
                lifecycle.handle_sleep(self, self.state, body)
            else:
                lifecycle.handle_wake(self, self.state, body, say)
        except APIError as exc:
            self.send_error_json(exc)

    def kv_events(self) -> None:
        """What the KV tiers hold and what changed (docs/kv-events.md); 404 when this replica has no KV tiers."""
        tiers = self.state.from_loaded(lambda loaded: loaded.engine.kv_tiers)
        if tiers is None:
            message = "this replica has no KV tiers (start it with --kv-l1 and/or --kv-l2)"
            if not self.state.ready.is_set():
                message = "the model is still loading"
            self.send_error_json(APIError(404 if self.state.ready.is_set() else 503, message, code="no_kv"))
            return
        from preheat.server.kvtier import events_payload

        self.send_json(200, events_payload(tiers, self.path.partition("?")[2], self.state._load))

    def tokenizer_files(self) -> None:
        """``{"model", "files": {name: text}}``: the loaded checkpoint's tokenizer files (``TOKENIZER_FILES``)."""
        path = self.state.from_loaded(lambda loaded: loaded.path)
        if path is None:
            self.send_error_json(APIError(503, "the model is still loading", code="loading"))
            return

        files: dict[str, str] = {}
        for name in TOKENIZER_FILES:
            try:
                with open(os.path.join(path, name), encoding="utf-8") as handle:
                    files[name] = handle.read()
            except FileNotFoundError:
                continue
        self.send_json(200, {"model": self.state.settings.model_name, "files": files})

    # -- server.generation.Responder: where a generation's answer goes ------------------------------------------------
    def start_events(self, headers: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")  # one HTTP chunk per event: the connection stays reusable
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.count(200)

    def send_event(self, data: bytes) -> None:
        self.wfile.write(sse.chunk(data))
        self.wfile.flush()

    def end_events(self) -> None:
        self.wfile.write(sse.LAST_CHUNK)
        self.wfile.flush()

    def abandon(self, answered: bool) -> None:
        self.close_connection = True
        if not answered:  # a stream that already counted its 200 is not counted twice
            self.count(499)  # nginx's "client closed request": the request ended without an answer

    def client_gone(self) -> bool:
        """Whether the client has closed its end: the socket is readable and reading would return EOF."""
        sock: socket.socket = self.connection
        try:
            # select first: with a socket timeout set, Python's recv() waits for data even with MSG_DONTWAIT.
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False  # nothing to read: the client is still waiting for us
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # ValueError: the socket was already closed on our side
            return True


def record_imports(timeline: Timeline) -> None:
    """``imports``: from this process's start to now; plus ``platform`` when ``PREHEAT_T0`` starts the clock earlier."""
    now = timeline.now()
    started = 0.0
    if timeline.origin_source != "process start":  # the platform's clock started before this process did
        started = min(max(process_start_time() - timeline.origin, 0.0), now)
        timeline.add("platform", 0.0, started, origin_source=timeline.origin_source)
    timeline.add("imports", started, now)


def run(
    flags: dict[str, object], announce: Callable[[str], None] | None = None, findings: Findings | None = None
) -> int:
    """Start the server with ``flags`` (``None`` = not given; see ``ServeSettings``) until SIGINT/SIGTERM.
    ``findings``: the doctor's, for ``/dashboard`` (the command line gives them: the server cannot import the doctor).

    Returns the process exit code: 0 after a clean shutdown, 1 when the model failed to load.
    """
    gc.disable()  # during the start only: lifecycle.resume_gc says why, and turns it back on
    say = announce or (lambda line: print(line, flush=True))
    timeline = Timeline.from_env()
    record_imports(timeline)
    with timeline.stage("config"):
        settings = ServeSettings.resolve(flags)
        # First: the tokenizer's GIL-bound build then runs beside torch's import, on another core
        # (preheat.text.process). A standby replica's activations build it on a thread instead.
        text = None if settings.standby else TokenizerProcess.start()
        state = ServerState(settings, timeline)
        state.text = text
        state.findings = findings
        use_fleet(settings.tls)  # https to peers and refit holders, with the fleet's CA and this node's certificate
        try:
            httpd = PreheatHTTPServer((settings.host, settings.port), state)
            httpd.max_connections, httpd.header_timeout = settings.max_connections, settings.header_timeout
            httpd.tls = settings.tls.listener()
        except OSError as exc:
            # A setting this machine cannot honour (the port is taken, the host is not one of its addresses).
            message = f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}; choose another --host/--port"
            raise ConfigError(message) from None
    host, port = httpd.socket.getsockname()[:2]
    url = f"{'https' if httpd.tls is not None else 'http'}://{host}:{port}"
    httpd.say = say
    if env.get(env.POD_NAME):  # on Kubernetes: the pod's start, read on its own thread (k8s/)
        from preheat.k8s.pod_timeline import record_pod_start

        record_pod_start(timeline)
    if settings.standby:
        say(listening_line("preheat serve", url, "standby: POST /v1/preheat/load to serve a model"))
        from preheat.server.lifecycle import prepare_standby

        target: Callable[..., None] = prepare_standby
    else:
        say(listening_line("preheat serve", url, f"loading {settings.model} in the background"))
        target = _load_in_background
    state.life.transition = threading.Thread(target=target, args=(httpd, say), name="preheat-load", daemon=True)
    state.life.transition.start()
    try:
        with sigterm_interrupts():  # SIGTERM (Kubernetes, the demo) shuts down like Ctrl-C
            httpd.serve_forever(poll_interval=0.25)
    except KeyboardInterrupt:
        say("preheat serve: shutting down")
    finally:
        httpd.server_close()
        if state.refit is not None:
            state.refit.stop()  # withdraws its registry entry
        if state.worker is not None:
            state.worker.stop()
        if state.settings.peer:
            from preheat.server.peering import stop_peer

            stop_peer(state)  # withdraws the registry entry before the process goes
        if state.loaded is not None and state.loaded.engine.kv_tiers is not None:
            state.loaded.engine.kv_tiers.close()  # writes what is queued for L2 (bounded wait), then disconnects
        if state.loaded is not None and state.loaded.lease is not None:
            state.loaded.lease.close()
        state.life.close()  # a sleeping replica's KV tiers and node-cache lease
    if state.load_error is not None:
        print(f"preheat serve: error: {state.load_error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _load_in_background(httpd: PreheatHTTPServer, say: Callable[[str], None]) -> None:
    from preheat.server.lifecycle import install
    from preheat.server.loading import load

    state = httpd.state
    try:
        loaded = load(state.settings, state.timeline, text=state.text)
    except Exception as exc:  # any load failure ends the process with its message (exit code 1)
        if not isinstance(exc, PreheatError):
            log.exception("model load failed")
        state.load_error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PreheatError) else str(exc)
        httpd.shutdown()
        return
    if state.settings.follow:
        from preheat.server.following import prepare_follow

        try:
            prepare_follow(state, loaded)
        # The replica serves what it loaded; following is what failed (OSError: the refit server could not bind
        # --peer-host: escaping this thread, it would leave the replica loading forever).
        except (PreheatError, OSError) as exc:
            log.error("--follow: %s", exc)
            say(f"preheat serve: not following versions: {exc}")
    install(state, loaded, say)  # worker, ready, KV-tier metrics, the peer server (lifecycle.py)
    resume_gc()
    if isinstance(loaded.engine.tokenizer, ProcessTokenizer):
        loaded.engine.tokenizer.settle()  # this process's own copy, once the first answers are out
    if state.refit is not None:
        from preheat.server.following import start_follow

        start_follow(state, say)
