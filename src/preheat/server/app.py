"""``preheat serve``: bind first, answer ``/health`` at once, load the model behind it.

The HTTP layer is the standard library's ``ThreadingHTTPServer`` (one thread per connection): importing a web
framework would cost more than the whole server needs, and this file is on the cold-start path. The order of a start:

1. ``imports`` (process start -> ``run``) and ``config`` (settings checked, socket bound) are recorded on the
   timeline; from here ``/health`` answers 503 and ``/v1/preheat/timeline`` shows the load as it happens;
2. a loader thread fetches, imports the engine, loads, warms up and marks ``ready`` (``preheat.server.loading``);
3. ``/health`` turns 200 and generation requests are handed to the single generation worker.

Routes: docs/server.md. Only ``/v1/*`` needs the API key (``/health`` and ``/metrics`` are for probes and scrapers).
"""

from __future__ import annotations

import hmac
import json
import logging
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from preheat.errors import PreheatError
from preheat.server import openai
from preheat.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from preheat.server.metrics import ServerMetrics
from preheat.server.settings import ServeSettings
from preheat.sources.httpserve import write_body
from preheat.sources.ranges import parse_length
from preheat.timeline import Timeline, process_start_time

if TYPE_CHECKING:
    from preheat.server.loading import Loaded
    from preheat.server.worker import Worker

log = logging.getLogger("preheat.server")
MAX_BODY = openai.MAX_BODY_BYTES
GENERATION_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


class ServerState:
    """What every request thread shares: settings, timeline, metrics, and (once ready) the engine and worker."""

    def __init__(self, settings: ServeSettings, timeline: Timeline) -> None:
        self.settings, self.timeline = settings, timeline
        self.created = int(time.time())
        self.loaded: Loaded | None = None
        self.worker: Worker | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.tokenize_lock = threading.Lock()  # tokenizer objects are not documented as thread-safe; encoding is cheap
        self._first_token_lock = threading.Lock()
        self._first_token_seen = False
        self.metrics = ServerMetrics(timeline.stages, self._load)

    def _load(self) -> tuple[int, int]:
        return self.worker.load() if self.worker is not None else (0, 0)

    def first_token(self, ttft: float) -> None:
        """Mark the first request's first token on the timeline, once per process."""
        with self._first_token_lock:
            if self._first_token_seen:
                return
            self._first_token_seen = True
        self.timeline.mark("first_request_ttft", ttft=ttft)

    def loading_stage(self) -> str:
        """The stage the loader is in now (a stage without an end yet), for ``/health`` while loading."""
        open_stages = [s.name for s in self.timeline.stages() if s.end is None]
        return str(open_stages[-1]) if open_stages else "starting"


class PreheatHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that carries the shared ``ServerState``."""

    daemon_threads = True  # a hung client must not keep the process alive at shutdown
    request_queue_size = 128  # accept backlog: bursts of clients arrive together at a fresh replica

    def __init__(self, address: tuple[str, int], state: ServerState) -> None:
        self.state = state
        super().__init__(address, Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:  # Any: socketserver's own untyped signature
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, exc)
            return
        log.exception("unhandled error serving %s", client_address)


class Handler(BaseHTTPRequestHandler):
    """Routes one connection's requests (HTTP/1.1 keep-alive)."""

    protocol_version = "HTTP/1.1"
    server_version = "preheat"
    # Headers and body leave in separate writes: with Nagle's algorithm on, the body waits for the client's delayed
    # ACK of the headers (~40 ms on Linux) on every keep-alive answer, and on every streamed token.
    disable_nagle_algorithm = True
    # Socket timeout for reads and writes: an idle keep-alive connection or a client that stops reading its stream
    # for this long loses its thread (and its generation) instead of holding them forever.
    timeout = 300
    server: PreheatHTTPServer

    # -- plumbing ------------------------------------------------------------------------------------------------
    @property
    def state(self) -> ServerState:
        return self.server.state

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json", headers)

    def send_body(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        write_body(self, status, body, content_type, headers)
        self.count(status)

    def send_error_json(self, error: openai.APIError, headers: dict[str, str] | None = None) -> None:
        self.send_json(error.status, error.body(), headers)

    def refuse_unread(self, error: openai.APIError, headers: dict[str, str] | None = None) -> None:
        """Answer ``error`` without reading the request's body, and close the connection: its unread bytes would
        otherwise be parsed as the next request of a keep-alive client (``Connection: close`` tells it so)."""
        self.send_error_json(error, {**(headers or {}), "Connection": "close"})

    def count(self, status: int) -> None:
        self.state.metrics.requests.inc(endpoint=self.route(), status=str(status))

    def route(self) -> str:
        path = self.path.split("?", 1)[0]
        known = ("/health", "/metrics", "/v1/models", "/v1/preheat/timeline", *GENERATION_ROUTES)
        return path if path in known else "other"  # bounded label values: never the raw path

    def authorized(self) -> bool:
        key = self.state.settings.api_key
        if not key or not self.path.startswith("/v1/"):
            return True
        given = self.headers.get("Authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), key.encode()):
            return True
        self.refuse_unread(
            openai.APIError(
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
        length = parse_length(self.headers.get("Content-Length"))  # None also for '²' or 5,000 digits
        if length is None:
            self.refuse_unread(openai.APIError(411, "a Content-Length header is required", code="length_required"))
            return None
        if length > MAX_BODY:
            self.refuse_unread(openai.APIError(413, f"request body over {MAX_BODY} bytes", code="too_large"))
            return None
        return self.rfile.read(length)

    # -- routes --------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self.authorized():
            return
        if path == "/health":
            self.health()
        elif path == "/metrics":
            self.send_body(200, self.state.metrics.render().encode(), METRICS_CONTENT_TYPE)
        elif path == "/v1/models":
            loaded = self.state.loaded
            limit = loaded.engine.max_model_len if loaded is not None else None
            self.send_json(200, openai.models_list(self.state.settings.model_name, self.state.created, limit))
        elif path == "/v1/preheat/timeline":
            self.send_json(200, self.state.timeline.to_dict())
        elif path == "/v1/kv/events":
            self.kv_events()
        elif path in GENERATION_ROUTES:
            self.send_error_json(openai.APIError(405, f"use POST for {path}", code="method_not_allowed"))
        else:
            self.send_error_json(openai.APIError(404, f"no route {path}", code="not_found"))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self.authorized():
            return
        kind = GENERATION_ROUTES.get(path)
        if kind is None:
            self.refuse_unread(openai.APIError(404, f"no route {path}", code="not_found"))
            return
        body = self.read_body()
        if body is None:
            return
        from preheat.server.generation import handle_generation

        handle_generation(self, kind, body)

    def health(self) -> None:
        state = self.state
        if state.ready.is_set():
            self.send_json(200, {"status": "ok", "model": state.settings.model_name})
        elif state.load_error is not None:
            self.send_json(503, {"status": "failed", "error": state.load_error})
        else:
            self.send_json(503, {"status": "loading", "stage": state.loading_stage()})

    def kv_events(self) -> None:
        """What the KV tiers hold and what changed (docs/kv-events.md); 404 when this replica has no KV tiers."""
        loaded = self.state.loaded
        tiers = loaded.engine.kv_tiers if loaded is not None else None
        if tiers is None:
            message = "this replica has no KV tiers (start it with --kv-l1 and/or --kv-l2)"
            if not self.state.ready.is_set():
                message = "the model is still loading"
            self.send_error_json(openai.APIError(404 if self.state.ready.is_set() else 503, message, code="no_kv"))
            return
        from preheat.server.kvtier import events_payload

        self.send_json(200, events_payload(tiers, self.path.partition("?")[2], self.state._load))

    def peer_closed(self) -> bool:
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


def _record_imports(timeline: Timeline) -> None:
    """``imports``: from this process's start to now; plus ``platform`` when ``PREHEAT_T0`` starts the clock earlier."""
    now = timeline.now()
    started = 0.0
    if timeline.origin_source != "process start":  # the platform's clock started before this process did
        started = min(max(process_start_time() - timeline.origin, 0.0), now)
        timeline.add("platform", 0.0, started, origin_source=timeline.origin_source)
    timeline.add("imports", started, now)


def run(flags: dict[str, object], announce: Callable[[str], None] | None = None) -> int:
    """Start the server with ``flags`` (``None`` = not given; see ``ServeSettings``) until SIGINT/SIGTERM.

    Returns the process exit code: 0 after a clean shutdown, 1 when the model failed to load.
    """
    say = announce or (lambda line: print(line, flush=True))
    timeline = Timeline.from_env()
    _record_imports(timeline)
    with timeline.stage("config"):
        settings = ServeSettings.resolve(flags)
        state = ServerState(settings, timeline)
        try:
            httpd = PreheatHTTPServer((settings.host, settings.port), state)
        except OSError as exc:
            raise PreheatError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
    host, port = httpd.socket.getsockname()[:2]
    say(f"preheat serve: listening on http://{host}:{port} (loading {settings.model} in the background)")
    loader = threading.Thread(target=_load_in_background, args=(httpd, say), name="preheat-load", daemon=True)
    loader.start()
    # SIGTERM (Kubernetes, the demo) shuts down like Ctrl-C; signal handlers can only be set from the main thread.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main else None
    try:
        httpd.serve_forever(poll_interval=0.25)
    except KeyboardInterrupt:
        say("preheat serve: shutting down")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        httpd.server_close()
        if state.worker is not None:
            state.worker.stop()
        if state.settings.peer:
            from preheat.server.peering import stop_peer

            stop_peer(state)  # withdraws the registry entry before the process goes
        if state.loaded is not None and state.loaded.engine.kv_tiers is not None:
            state.loaded.engine.kv_tiers.close()  # writes what is queued for L2 (bounded wait), then disconnects
        if state.loaded is not None and state.loaded.lease is not None:
            state.loaded.lease.close()
    if state.load_error is not None:
        print(f"preheat serve: error: {state.load_error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _load_in_background(httpd: PreheatHTTPServer, say: Callable[[str], None]) -> None:
    from preheat.server.loading import load
    from preheat.server.worker import Worker

    state = httpd.state
    try:
        loaded = load(state.settings, state.timeline)
    except Exception as exc:  # any load failure ends the process with its message (exit code 1)
        if not isinstance(exc, PreheatError):
            log.exception("model load failed")
        state.load_error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PreheatError) else str(exc)
        httpd.shutdown()
        return
    if loaded.engine.kv_tiers is not None:
        from preheat.server.kvtier import metric_lines, summary

        tiers = loaded.engine.kv_tiers
        state.metrics.extra.append(lambda: metric_lines(tiers))
        say(f"preheat serve: {summary(tiers)}")
    worker = Worker(loaded.engine, state.metrics, max_queue=state.settings.max_queue)
    worker.start()
    state.loaded, state.worker = loaded, worker
    state.ready.set()
    ready = next((s.start for s in state.timeline.stages() if s.name == "ready"), state.timeline.now())
    say(f"preheat serve: ready ({loaded.engine.model_name}, {ready:.2f} s after {state.timeline.origin_source})")
    if state.settings.peer:  # the replica becomes a peer once loaded (docs/peer.md)
        from preheat.server.peering import start_peer

        start_peer(state, loaded, say)
