"""The router's request path: choose a replica, forward the request unchanged, relay the answer as it comes.

Bodies pass through byte for byte: a non-streaming answer is relayed with its Content-Length, a streamed one chunk
by chunk as the replica writes its chunks (one server-sent event each), so tokens reach the client as they are made.
Sizes the replica chooses are bounded: a non-streaming answer over ``max_answer_bytes`` is refused
(``answer_too_large``, unread when its Content-Length says so), and so is a server-sent event over
``max_event_bytes`` (``event_too_large``). Nothing goes out to the client before a plain answer is whole or a stream's
first event is (``first_look``), so a refusal there is retried on another replica, as a failure is, and the client
hears of it (a 502) only when no other replica can take the request; a later event over the bound ends its stream
with an ``event_too_large`` error event. Each refusal is counted in ``preheat_router_refused_answers_total``, each
error answered in ``preheat_router_errors_total``.

Authentication: with an API key (``--api-key``) every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>``; a request without it is answered 401 before its body is read, tokenized, indexed or
sent anywhere. With ``--replica-api-key`` the router presents its own key to the replicas in place of the client's.
Control routes (load, sleep, wake, refit: ``preheat.http.control.is_control_path``) are never forwarded, however
spelt: the router answers 404 itself, so its key (or its place in front of the replicas) never grants control.

Failures: a request that fails before the client got anything (the connection refused, reset or closed, the answer
cut before it was whole or before its first event) ejects that replica and is retried once on another; one that
fails after (the replica died mid-stream) ends with a final ``data: {"error": ...}`` event and ``[DONE]``, as the
replica itself ends a failed stream.
A replica that answers a 503 saying it is not serving (asleep, on standby, draining: capacity.refused_code) never
started the request: it is ejected and the request goes to another replica.

Cold capacity (``ColdStarter``, activation.py): a request that finds no replica in rotation waits while a standby is
activated or a sleeping replica woken; one that finds every replica saturated starts one and goes on at once.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec

from preheat.core.errors import APIError, JSONInputError, UpstreamError
from preheat.core.jsonsafe import loads_bounded
from preheat.dashboard.login import Login
from preheat.dashboard.state import ReplicaRow, StateDocument
from preheat.dashboard.watch import Findings, FleetWatcher
from preheat.dashboard.web import answer, is_dashboard_path
from preheat.http.control import is_control_path
from preheat.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from preheat.http.server import CLOSE, BodyRefusal, TrackedHandler, TrackedServer, check_bearer
from preheat.router.activation import ColdStarter
from preheat.router.capacity import refused_code, saturated
from preheat.router.metrics import RouterMetrics
from preheat.router.policies import Candidate, Decision, Policy, RouteRequest
from preheat.router.prompts import ROUTE_KINDS, SESSION_HEADER, PromptReader
from preheat.router.sse import EventFramer
from preheat.router.upstream import Replica
from preheat.text.request import MAX_BODY_BYTES

log = logging.getLogger("preheat.router")
P = ParamSpec("P")
MAX_BODY = MAX_BODY_BYTES  # the replica's own limit: larger bodies are refused here, without a round trip
# Per-connection headers are not forwarded (RFC 9110 7.6.1); Host and Content-Length are set again for the replica.
HOP_HEADERS = frozenset(
    ("connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
     "content-length", "proxy-authorization", "proxy-authenticate")
)  # fmt: skip
# Which replica answered, and why it was chosen: for clients, logs, benchmarks and tests (bodies stay unchanged).
REPLICA_HEADER = "X-Preheat-Replica"
REASON_HEADER = "X-Preheat-Route"
REFUSAL_BYTES = 64 * 1024  # a 503 this long or shorter is read to see whether it says "not serving"
# Defaults of --max-answer-bytes and --max-event-bytes (router/settings.py): far beyond any answer with logprobs.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
MAX_EVENT_BYTES = 16 * 1024 * 1024


class Router:
    """The replicas, the policy and the metrics: everything a request thread shares. ``api_key``: what clients must
    present (None: anyone may ask); ``replica_api_key``: what the router presents to replicas in place of the
    client's ``Authorization`` (None: the client's passes through)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        policy: Policy,
        prompts: PromptReader,
        *,
        api_key: str | None = None,
        replica_api_key: str | None = None,
        newest_version: bool = False,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.replicas, self.policy, self.prompts = list(replicas), policy, prompts
        self.max_answer_bytes, self.max_event_bytes = max_answer_bytes, max_event_bytes
        self.newest_version = newest_version  # route only to replicas on the newest weights version (docs/refit.md)
        self.api_key = api_key
        self.replica_authorization = f"Bearer {replica_api_key}" if replica_api_key else None
        self.metrics = RouterMetrics(
            lambda: [(r.url, r.healthy, r.in_flight) for r in self.replicas], policy.index_sizes
        )
        self.cold: ColdStarter | None = None  # standby and sleeping replicas to bring up (RouterService sets it)
        self._membership = threading.Lock()
        # GET /dashboard (preheat.dashboard): scrapes the replicas when a page polls; findings: the doctor's, given
        # by the command line (the router cannot import the doctor, which sits above it).
        self.dashboard = FleetWatcher(replica_api_key or api_key)
        self.findings: Findings | None = None

    def dashboard_state(self) -> StateDocument:
        """The dashboard's state document: every replica as the router sees it, joined with its own metrics."""
        rows = [ReplicaRow(r.url, r.healthy, r.phase, r.standby, r.in_flight, r.finished) for r in self.replicas]
        up = any(r.healthy for r in self.replicas)
        status = "ok" if up else "cold" if self.cold is not None and self.cold.available() else "no_replica"
        samples = self.metrics.decisions.family().samples
        return self.dashboard.state(rows, status=status, policy=self.policy.name, decision_samples=samples,
                                    findings=self.findings)  # fmt: skip

    # -- membership (``--replicas-from``): ``replicas`` is replaced, never changed in place, so that a request
    # thread iterating over it meanwhile sees the old list or the new one, whole -------------------------------------
    def add_replica(self, replica: Replica) -> bool:
        """``replica`` joins (out of rotation until its health check passes); False when its URL is here already."""
        with self._membership:
            if any(r.url == replica.url for r in self.replicas):
                return False
            self._set_replicas([*self.replicas, replica])
        log.warning("replica %s joined", replica.url)
        return True

    def remove_replica(self, url: str) -> Replica | None:
        """The replica at ``url`` leaves: no new request goes to it, those on it finish, the policy forgets it."""
        with self._membership:
            gone = next((r for r in self.replicas if r.url == url), None)
            if gone is None:
                return None
            self._set_replicas([r for r in self.replicas if r is not gone])
        gone.retire()
        self.policy.forget(url)
        self.metrics.forget_replica(url)
        log.warning("replica %s left (%d in flight finish there)", url, gone.in_flight)
        return gone

    def _set_replicas(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        if self.cold is not None:
            self.cold.replicas = replicas  # a sleeping replica that left is not woken

    def healthy(self, exclude: Sequence[Replica] = ()) -> list[Replica]:
        pool = [r for r in self.replicas if r.healthy and r not in exclude]
        if self.newest_version:  # --newest-version: the others finish their swap first (docs/refit.md)
            # (epoch, version): a restarted trainer's version 1 is newer than its last epoch's 500 (docs/refit.md).
            newest = max(((r.epoch, r.version) for r in pool if r.version is not None), default=None)
            if newest is not None:
                pool = [r for r in pool if (r.epoch, r.version) == newest]
        return pool

    def set_health(self, replica: Replica, healthy: bool, why: str) -> None:
        """A replica enters or leaves rotation (health checker or a failed request)."""
        if healthy and replica.retired:
            return  # it left the fleet (a health check or cold start finishing just after)
        if not replica.set_healthy(healthy):
            return  # already so: the health checker and a failed request can find a dead replica at the same time
        if healthy:
            log.warning("replica %s is in rotation (%s)", replica.url, why)
            return
        replica.close_idle()
        self.policy.forget(replica.url)  # back from the dead (or from sleep), its cache may have restarted empty
        self.metrics.ejections.inc(replica=replica.url)
        log.warning("replica %s ejected: %s", replica.url, why)

    def choose(self, request: RouteRequest, pool: Sequence[Replica], retry: bool = False) -> tuple[Replica, Decision]:
        candidates = [
            Candidate(r.url, r.in_flight, r.service_seconds, r.finished, r.load, r.load_finished) for r in pool
        ]
        decision = self.policy.choose(request, candidates)
        reason = "retry" if retry else decision.reason
        self.metrics.decisions.inc(policy=self.policy.name, reason=reason)
        return next(r for r in pool if r.url == decision.replica), decision


class RouterHTTPServer(TrackedServer):
    """The shared server base (``preheat.http.server``) carrying the ``Router``."""

    def __init__(self, address: tuple[str, int], router: Router) -> None:
        self.router = router
        self.login = Login()  # the dashboard's sessions (RouterService sets --dashboard-session-ttl's)
        super().__init__(address, RouterHandler)


class RouterHandler(TrackedHandler):
    """One client connection (HTTP/1.1 keep-alive, TCP_NODELAY: ``TrackedHandler``); every method is forwarded
    except the router's own routes."""

    server_version = "preheat-router"
    timeout = 300  # an idle client connection loses its thread after this long
    server: RouterHTTPServer
    last_refusal: bytes | None = None  # this request's last "not serving" 503, as the replica wrote it

    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self.health()
        elif path == "/metrics":
            self.send_body(200, self.server.router.metrics.render().encode(), METRICS_CONTENT_TYPE)
        elif is_dashboard_path(path):  # read-only; its own key check: a browser sends a cookie, not a Bearer header
            answer(self, self.server.router.api_key, self.server.router.dashboard_state, self.server.login)
        else:
            self.forward("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server dispatches on this name
        if is_dashboard_path(self.path.split("?", 1)[0]):  # the dashboard's login form
            answer(self, self.server.router.api_key, self.server.router.dashboard_state, self.server.login)
            return
        self.forward("POST")

    def do_DELETE(self) -> None:  # noqa: N802 - http.server dispatches on this name
        self.forward("DELETE")

    def do_PUT(self) -> None:  # noqa: N802 - http.server dispatches on this name
        self.forward("PUT")

    # -- the router's own answers ---------------------------------------------------------------------------------
    def send_error_json(
        self, status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None
    ) -> None:
        """An OpenAI-shaped error the router itself answers (no replica, the replica failed, no API key)."""
        self.server.router.metrics.errors.inc(code=code)
        body = APIError(status, message, type=type_, code=code).body()
        extra = {"Retry-After": "1"} if headers is None else headers
        self.send_body(status, json.dumps(body).encode(), "application/json", extra)

    def authorized(self) -> bool:
        """True when the router has no API key or the request bears it (compared in constant time); else answers
        401 as ``preheat serve`` does, before the body is read, tokenized, indexed or forwarded."""
        key = self.server.router.api_key
        if not key:
            return True
        if check_bearer(self.headers.get("Authorization"), key) == "ok":
            return True
        message = "missing or wrong API key: send 'Authorization: Bearer <key>' (the router's --api-key)"
        headers = {"WWW-Authenticate": "Bearer"}
        if self.has_body():
            headers.update(CLOSE)  # its body is left unread: the connection cannot carry another request
        self.send_error_json(401, message, "authentication_error", "invalid_api_key", headers)
        return False

    def not_forwarded(self) -> None:
        """404 for a control route: the router has none of its own and forwards none (its body is left unread)."""
        message = (
            f"{self.path.split('?', 1)[0][:200]}: the router does not forward control routes; send them to the "
            "replica itself, with its admin key (`preheat activate URL ...`)"
        )
        headers = CLOSE if self.has_body() else {}
        self.send_error_json(404, message, "invalid_request_error", "not_forwarded", headers)

    def health(self) -> None:
        router = self.server.router
        replicas: list[dict[str, object]] = []
        for r in router.replicas:
            replicas.append(
                {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "state": r.phase, "standby": r.standby}
            )
            if r.wake_seconds is not None:
                replicas[-1]["wake_seconds"] = round(r.wake_seconds, 3)
        up = any(r.healthy for r in router.replicas)
        # No replica in rotation, but one can be activated or woken: requests are served (after a cold start).
        cold = not up and router.cold is not None and router.cold.available()
        state = "ok" if up else "cold" if cold else "no_replica"
        status = {"status": state, "policy": router.policy.name, "replicas": replicas}
        self.send_body(200 if up or cold else 503, json.dumps(status).encode(), "application/json")

    # -- forwarding -----------------------------------------------------------------------------------------------
    def read_body(self) -> bytes | None:
        """The request body (None after answering 411/413); a bodiless GET has b""."""
        body = self.read_body_within(MAX_BODY, required=self.command in ("POST", "PUT"))
        if isinstance(body, BodyRefusal):
            self.send_error_json(body.status, body.message, "invalid_request_error", body.code, CLOSE)
            return None
        return body

    def forward(self, method: str) -> None:
        started = time.perf_counter()
        router = self.server.router
        if is_control_path(self.path):
            self.not_forwarded()
            return
        if not self.authorized():
            return
        body = self.read_body()
        if body is None:
            return
        path = self.path.split("?", 1)[0]
        generation = method == "POST" and path in ROUTE_KINDS
        if generation and (router.policy.needs_tokens or router.policy.name == "session"):
            request = router.prompts.read(path, body, self.headers.get(SESSION_HEADER))
        else:
            request = RouteRequest(session=self.headers.get(SESSION_HEADER))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        if router.replica_authorization is not None:
            # The client's credential is for the router; the replicas get the router's own.
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = router.replica_authorization
        exchange = self.exchange(method, body, headers, request, generation)
        if exchange is None:
            return  # answered already (no replica, or a 502)
        replica, sent = exchange.replica, exchange.sent
        # The request is over for the replica when its last byte arrives, and it is counted just before the client's
        # last byte goes out: a client that sends its next request, or scrapes /metrics, as soon as it has this
        # answer must find it neither still in flight nor not yet counted.
        upstream_done = [sent]

        def replica_over() -> None:
            upstream_done[0] = time.perf_counter()
            replica.end(upstream_done[0] - sent)

        over = _once(replica_over)

        def count(status: int) -> None:
            over()
            router.metrics.routed.inc(replica=replica.url, status=str(status))
            # The router's own time: before the replica had the request, and after its last byte came.
            router.metrics.overhead.observe((sent - started) + max(time.perf_counter() - upstream_done[0], 0.0))

        try:
            reason = "retry" if exchange.tries > 1 else exchange.decision.reason
            ending = Ending(over, _once(count))
            self.relay(replica, exchange.conn, exchange.response, reason, ending, head=exchange.head)
        finally:
            over()  # when the relay ended some other way (an exception)

    def exchange(
        self, method: str, body: bytes, headers: dict[str, str], request: RouteRequest, generation: bool
    ) -> Exchange | None:
        """Send the request to a replica and wait for its answer's headers; None once the router has answered the
        client itself. A replica that fails before answering is ejected and the request retried once elsewhere;
        one that refuses it as not serving is ejected and the request goes to another (waiting for a cold start
        when none is left)."""
        router = self.server.router
        failed: list[Replica] = []  # replicas that failed this request: not tried again
        tries = 0
        # A refusal as "not serving" ejects the replica, so the request goes elsewhere each time; the bound stops a
        # replica whose /health says ok while its requests are refused from bouncing a request forever.
        most = 2 * len(router.replicas) + 1
        self.last_refusal = None
        while True:
            pool = router.healthy(exclude=failed)
            cold = router.cold
            if not pool and cold is not None and tries < most and cold.available():
                # Wait while a standby is activated or a sleeping replica woken (one after another if one fails).
                waited = cold.wait_for_replica(lambda: bool(router.healthy(exclude=failed)), "no replica in rotation")
                if waited:
                    continue
            if not pool or tries >= most:
                self.no_replica(failed)
                return None
            if cold is not None and not tries and saturated((r.in_flight for r in pool), cold.settings.saturation):
                cold.need("every replica in rotation is saturated")
            replica, decision = router.choose(request, pool, retry=bool(tries))
            tries += 1
            replica.begin()
            if generation:
                router.policy.sent(request, replica.url)
            sent = time.perf_counter()
            try:
                conn, response = replica.send(method, self.path, body, headers)
            except UpstreamError as exc:
                failed.append(replica)
                if self.retry_failed(replica, exc, failed, request if generation else None):
                    continue
                return None
            early = self.read_refusal(conn, response)
            if isinstance(early, str):  # not serving: nothing started there, so it goes elsewhere
                replica.end(None)
                if generation:
                    router.policy.answered(request, replica.url, ok=False)
                replica.phase = early
                router.set_health(replica, False, f"answered 503 {early}")
                router.metrics.retries.inc()
                continue
            head = self.first_look(replica, conn, response, early)
            if isinstance(head, Refused):  # nothing of it went out: another replica may answer in its place
                failed.append(replica)
                if self.retry_refused(replica, head, failed, request if generation else None):
                    continue
                return None
            if generation:
                # Learnt only from a 2xx, before the client hears of it (its next request may share the prefix).
                router.policy.answered(request, replica.url, ok=200 <= response.status < 300)
            return Exchange(replica, decision, conn, response, sent, tries, head)

    def no_replica(self, failed: Sequence[Replica]) -> None:
        """The 503 of a request no replica can take: why cold starts failed, else the last refusal as the replica
        wrote it (asleep, on standby...), else who failed."""
        cold = self.server.router.cold
        if cold is not None and cold.errors:
            why = f"no replica in rotation, and none could be brought up ({cold.why_none()})"
        elif self.last_refusal is not None:
            self.server.router.metrics.errors.inc(code="no_replica")
            self.send_body(503, self.last_refusal, "application/json", {"Retry-After": "1"})
            return
        elif failed:
            why = f"replica {failed[-1].url} failed and no other is healthy"
        else:
            why = "no healthy replica"
        self.send_error_json(503, f"{why}; retry later", "service_unavailable", "no_replica")

    def retry_failed(
        self, replica: Replica, exc: UpstreamError, failed: Sequence[Replica], request: RouteRequest | None
    ) -> bool:
        """A replica that could not be asked: ejected when it failed before its first byte, and True when the
        request goes to another (its first failure), else the client gets a 502. ``request``: as for
        ``retry_refused``."""
        router = self.server.router
        replica.end(None)
        if request is not None:
            router.policy.answered(request, replica.url, ok=False)
        if exc.before_first_byte:
            router.set_health(replica, False, str(exc))
        if exc.before_first_byte and len(failed) == 1:
            router.metrics.retries.inc()
            return True
        self.send_error_json(502, f"replica failed before answering: {exc}", "server_error", "bad_gateway")
        return False

    def retry_refused(
        self, replica: Replica, refused: Refused, failed: Sequence[Replica], request: RouteRequest | None
    ) -> bool:
        """Count an answer refused before its first byte went out; True when the request may go to another replica
        (its first refusal, and one is left), else the client gets the refusal as a 502. ``request``: the
        generation request, whose policy learns of the failure."""
        router = self.server.router
        replica.end(None)
        router.metrics.refused.inc(replica=replica.url, code=refused.code)
        if request is not None:
            router.policy.answered(request, replica.url, ok=False)
        if refused.code == "replica_failed":  # it broke mid-answer: out, as a replica that refused the connection
            router.set_health(replica, False, refused.message)
        if len(failed) == 1 and router.healthy(exclude=failed):
            router.metrics.retries.inc()
            return True
        self.send_error_json(502, refused.message, "server_error", refused.code)
        return False

    def first_look(
        self,
        replica: Replica,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        early: bytes | None,
    ) -> Head | Refused:
        """Read what must be judged before the answer's headers go out, so that a refusal can still be retried: a
        plain answer whole (``early``: its body when ``read_refusal`` read it), a stream of server-sent events up to
        its first whole event. Sizes are the replica's choice, so each is bounded, and what is refused is left
        unread (the connection closed)."""
        if response.chunked:
            if (response.getheader("Content-Type") or "").startswith("text/event-stream"):
                return self.first_events(replica, conn, response)
            return Head()  # another kind of stream: relayed as it comes
        limit = self.server.router.max_answer_bytes
        body = early
        try:
            if body is None and (response.length or 0) <= limit:
                # Without a Content-Length (read to the close), at most one byte past the limit is read.
                body = response.read() if response.length is not None else response.read(limit + 1)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            message = f"replica {replica.url} failed while answering: {type(exc).__name__}: {exc}"
            return Refused("replica_failed", message)
        if body is None or len(body) > limit:
            conn.close()  # its body left unread
            message = (
                f"replica {replica.url} answered more than the router relays ({limit} bytes, "
                "--max-answer-bytes); ask for less (max_tokens, logprobs) or raise the limit"
            )
            return Refused("answer_too_large", message)
        return Head(body=body)

    def first_events(
        self, replica: Replica, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> Head | Refused:
        """A stream of server-sent events read up to its first whole event (or its end), each byte scanned once."""
        framer, limit = EventFramer(), self.server.router.max_event_bytes
        while True:
            try:
                data = response.read1(65536)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                message = f"replica {replica.url} failed before its first event: {type(exc).__name__}: {exc}"
                return Refused("replica_failed", message)
            if not data:
                return Head(events=framer.end(), framer=framer, ended=True)
            ready = framer.push(data)
            if ready:
                return Head(events=ready, framer=framer)
            if framer.held > limit:
                conn.close()  # the replica stops generating; nothing of the event went out
                return Refused("event_too_large", event_too_large(replica, limit))

    def relay(
        self,
        replica: Replica,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        reason: str,
        ending: Ending,
        *,
        head: Head,
    ) -> None:
        """Send the replica's answer to the client, calling ``ending.over()`` once the replica's part is over and
        ``ending.count(status)`` just before the client's last byte. ``head``: what ``first_look`` read of it."""
        headers = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_HEADERS]
        headers += [(REPLICA_HEADER, replica.url), (REASON_HEADER, reason)]
        if head.body is not None:
            replica.release(conn, response)
            self.send_response(response.status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(head.body)))
            ending.count(response.status)  # end_headers() sends the headers: nothing has left yet
            self.end_headers()
            self.wfile.write(head.body)
            return
        self.send_response(response.status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.stream(replica, conn, response, ending, head)

    def stream(
        self,
        replica: Replica,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        ending: Ending,
        head: Head,
    ) -> None:
        """Relay a chunked answer as the replica writes it, after the ``head`` that was read already. Server-sent
        events are relayed whole: a replica that dies mid-event must not leave half an event in front of the error
        event that ends the stream. So an event is held until its blank line arrives (``EventFramer``: each byte
        scanned once), and one growing past ``max_event_bytes`` ends the stream with an error event."""
        framer = head.framer
        limit = self.server.router.max_event_bytes
        if head.events or head.ended:
            if head.ended:
                ending.count(response.status)
            if (head.events and not self.write_chunk(head.events)) or (head.ended and not self.write_chunk(b"")):
                conn.close()  # the client left
                self.close_connection = True
                ending.count(response.status)
                return
            if head.ended:
                replica.release(conn, response)
                return
        while True:
            try:
                data = response.read1(65536)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                ending.count(response.status)
                message = f"replica {replica.url} failed mid-stream: {type(exc).__name__}: {exc}"
                self.end_stream(message, "replica_failed")
                return
            if not data:
                ending.count(response.status)  # the replica's last chunk came: the client's last one goes out below
            if framer is None:
                ready = data
            elif not data:
                ready = framer.end()  # what is left goes out as the replica wrote it
            else:
                ready = framer.push(data)
                if framer.held > limit:
                    conn.close()  # the replica stops generating; nothing of the event went out
                    ending.count(response.status)
                    self.end_stream(event_too_large(replica, limit), "event_too_large", ready)
                    return
            if (ready and not self.write_chunk(ready)) or (not data and not self.write_chunk(b"")):
                conn.close()  # the client left: closing makes the replica stop generating for nobody
                self.close_connection = True
                ending.count(response.status)
                return
            if not data:
                replica.release(conn, response)
                return

    def end_stream(self, message: str, code: str, before: bytes = b"") -> None:
        """End a stream whose headers went out already: the events ``before`` it, a final ``data: {"error": ...}``
        event and ``[DONE]``, as a replica ends a failed stream, and the connection closed after."""
        self.close_connection = True
        self.server.router.metrics.errors.inc(code=code)
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        self.write_chunk(before + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        self.write_chunk(b"")

    def read_refusal(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> str | bytes | None:
        """A short 503's body, read to see whether it says "not serving": then the replica's phase (its body kept
        in ``last_refusal``, the connection closed); else the body read (bytes), to relay as it is; None for any
        other answer (left unread)."""
        length = response.getheader("Content-Length") or ""
        if response.status != 503 or response.chunked or not length.isdigit() or int(length) > REFUSAL_BYTES:
            return None
        try:
            raw = response.read()
        except (OSError, http.client.HTTPException):
            return None  # relay() reads again and answers 502 replica_failed
        try:
            answer = loads_bounded(raw, max_bytes=REFUSAL_BYTES, max_depth=8)
        except (JSONInputError, UnicodeDecodeError):
            answer = None
        code = refused_code(response.status, answer if isinstance(answer, dict) else None)
        if code is None:
            return raw
        conn.close()
        self.last_refusal = raw
        return "loading" if code == "model_loading" else code

    def write_chunk(self, data: bytes) -> bool:
        """One HTTP chunk (empty data: the last chunk); False when the client has gone away."""
        framed = f"{len(data):x}\r\n".encode("ascii") + data + b"\r\n" if data else b"0\r\n\r\n"
        try:
            self.wfile.write(framed)
            self.wfile.flush()
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class Head:
    """What the router read of an answer before relaying any of it (``first_look``): a plain answer's whole
    ``body``; a stream of server-sent events' first whole events (``events``), the ``framer`` holding what came after
    them, and whether the stream ``ended`` there; nothing of any other stream."""

    body: bytes | None = None
    events: bytes = b""
    framer: EventFramer | None = None
    ended: bool = False


@dataclass(frozen=True)
class Refused:
    """An answer the router would not relay, refused before a byte of it went out: ``code`` (answer_too_large,
    event_too_large, replica_failed) and the client's ``message`` if no other replica takes the request."""

    code: str
    message: str


@dataclass(frozen=True)
class Exchange:
    """A request sent and its answer's headers in: where (``replica``, ``decision``), on what (``conn``,
    ``response``), when (``sent``), after how many ``tries``, and what was read of it already (``head``)."""

    replica: Replica
    decision: Decision
    conn: http.client.HTTPConnection
    response: http.client.HTTPResponse
    sent: float
    tries: int
    head: Head


@dataclass(frozen=True)
class Ending:
    """How a relay reports the end of an exchange: ``over()`` when the replica's part is over (its last byte came
    or it failed), ``count(status)`` just before the client's last byte goes out (it calls ``over()`` too). Each
    acts once."""

    over: Callable[[], None]
    count: Callable[[int], None]


def event_too_large(replica: Replica, limit: int) -> str:
    """The message of an event over ``--max-event-bytes``, refused first or ending a stream."""
    return (
        f"replica {replica.url} sent a server-sent event longer than the router relays ({limit} bytes, "
        "--max-event-bytes)"
    )


def _once(action: Callable[P, None]) -> Callable[P, None]:
    """``action(...)`` on the first call, nothing on later ones (one handler thread calls it)."""
    pending = [action]

    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        if pending:
            pending.pop()(*args, **kwargs)

    return call
