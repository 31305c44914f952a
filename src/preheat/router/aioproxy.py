"""The router's data path on one event loop: client connections accepted, requests parsed once, forwarded to a
replica over a kept-alive connection, and the answer relayed as it comes, with no thread per connection.

The rules are proxy.py's docstring (retries, ejection, refusals before the first byte, first-event error detection,
cold starts, bounds, keys), on ``http.aio.Stream`` connections (one protocol object each, with one lazy deadline
timer, in place of asyncio's StreamReader/StreamWriter pair and a timer per read): uvloop's loop when it is
importable (the ``router`` extra), else the standard library's. An idle client connection costs a socket and a few
kilobytes, not a thread, so thousands of them never stop new requests (the cap is ``--max-connections``; the process's
open-file limit is raised to its hard limit at start).

Connections are accepted by the router itself, every pending one at each wake of the loop: uvloop's own server
accepts too few per turn of a busy loop, and 256 clients arriving together at a loaded router waited up to 1.5 s for
their first answer (measured with ``bench/router_capacity.py``; the standard loop's server has no such lag).

What cannot be asynchronous runs on the loop's worker threads (``asyncio.to_thread``): tokenizing a prompt for
``kv`` (lock-free, prompts.py), reading a body over 64 KiB for ``prefix`` or ``session``, a wait for a cold start,
and the router's own GET routes (``/health``, ``/metrics``, the dashboard), which are answered by ``RouterHandler``
itself on an in-memory connection so that they have one home.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import json
import logging
import resource
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Sequence

from preheat.core.errors import APIError, HTTPClientError, JSONInputError, ResponseTimeoutError, UpstreamError
from preheat.core.jsonsafe import loads_bounded
from preheat.dashboard.login import Login
from preheat.dashboard.web import is_dashboard_path
from preheat.http.aio import AsyncPool, Body, Connection, Stream
from preheat.http.client import Origin
from preheat.http.control import is_control_path
from preheat.http.ranges import parse_length
from preheat.http.server import HEADER_TIMEOUT, MAX_CONNECTIONS, check_bearer
from preheat.http.tls import client_context
from preheat.http.wire import (
    HEAD_END,
    MAX_HEAD_BYTES,
    RequestHead,
    ResponseHead,
    WireRefusal,
    chunk,
    parse_request_head,
    request_head,
    response_head,
)
from preheat.router.capacity import refused_code, saturated
from preheat.router.hold import NOT_HELD, Pass
from preheat.router.policies import Decision, Policy, RouteRequest
from preheat.router.prompts import ROUTE_KINDS, SESSION_HEADER
from preheat.router.proxy import (
    HOP_HEADERS,
    MAX_BODY,
    REASON_HEADER,
    REFUSAL_BYTES,
    REPLICA_HEADER,
    Ending,
    Head,
    Refused,
    Router,
    RouterHandler,
    RouterRoutes,
    _once,
    candidate,
    event_too_large,
)
from preheat.router.sse import EventFramer
from preheat.router.upstream import POOL_SIZE, Replica

log = logging.getLogger("preheat.router")
SERVER = "preheat-router"
IDLE_TIMEOUT = 300.0  # an idle client connection is closed after this long
# Idle connections kept per replica: every client connection may have a request on its way to one replica, and a
# connection opened and closed per request costs the replica a handshake each time.
AIO_POOL_SIZE = max(POOL_SIZE, 1024)
FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 54\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many open connections to this server; retry later\n"
)
JSON = "application/json"
# The accept queue (a burst of new clients beyond it waits a second for its SYN to be retried), and the most
# connections accepted at one wake of the loop.
BACKLOG = 4096
INLINE = 64 * 1024  # the largest body read on the loop for its cached token ids (parsing and rendering it: ~1 ms)


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when it is installed (the ``router`` extra), else the standard library's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def raise_open_files() -> int:
    """Raise this process's open-file limit to its hard limit (each client connection is a file); the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
    return soft


class AsyncRouterServer:
    """The router's listener on an event loop, shaped as ``http.server``'s servers are for their owner:
    ``socket`` (bound at once), ``tls``, ``login``, ``max_connections``, ``header_timeout``, ``serve_forever()``
    (blocks, on the calling thread), ``shutdown()`` (from another thread) and ``server_close()``."""

    def __init__(self, address: tuple[str, int], router: Router, *, reuse_port: bool = False) -> None:
        """``reuse_port``: bind beside the other workers of ``--workers N`` (``SO_REUSEPORT``, router/workers.py)."""
        self.router = router
        self.login = Login()
        self.tls: ssl.SSLContext | None = None
        self.max_connections, self.header_timeout = MAX_CONNECTIONS, HEADER_TIMEOUT
        self.idle_timeout = IDLE_TIMEOUT
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.create_server(address, family=family, backlog=BACKLOG, reuse_port=reuse_port)
        self.open_connections = 0
        self.refused_connections = 0
        self.pools: weakref.WeakKeyDictionary[Replica, AsyncPool] = weakref.WeakKeyDictionary()
        self.loop: asyncio.AbstractEventLoop | None = None  # while serving
        self._done: asyncio.Event | None = None
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._clients: set[asyncio.Task[None]] = set()
        self._adopting: set[asyncio.Task[None]] = set()  # accepted, not yet a stream (strong references)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until ``shutdown()`` (``poll_interval``: as ``socketserver``'s, unused: the loop wakes at once)."""
        raise_open_files()
        loop = new_loop()
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()
            self._stopped.set()

    async def _serve(self) -> None:
        loop = self.loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        self.socket.setblocking(False)
        loop.add_reader(self.socket, self._accept)
        if not self._stop.is_set():
            await self._done.wait()
        loop.remove_reader(self.socket)
        pending = [*self._adopting, *self._clients]  # connections still in their TLS handshake, then the served
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for pool in list(self.pools.values()):
            pool.close_idle()

    def _accept(self) -> None:
        """Every connection waiting in the accept queue (up to ``BACKLOG``), each adopted by the loop as a stream."""
        loop = self.loop
        assert loop is not None  # called by the loop
        for _ in range(BACKLOG):
            try:
                sock, _peer = self.socket.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none left, or one that hung up while it waited
            except OSError as exc:
                # Out of descriptors or buffers: stop accepting for a second rather than spin on a ready socket.
                log.warning("cannot accept connections (%s); trying again in 1 s", exc)
                loop.remove_reader(self.socket)
                loop.call_later(1.0, self._resume_accepting)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._adopt(sock))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _resume_accepting(self) -> None:
        if self.loop is not None and not self._stop.is_set():
            self.loop.add_reader(self.socket, self._accept)

    async def _adopt(self, sock: socket.socket) -> None:
        """A connection accepted: its TLS handshake, then its requests (this task serves it to its end)."""
        loop = asyncio.get_running_loop()
        stream = Stream(loop)
        try:
            await loop.connect_accepted_socket(
                lambda: stream, sock, ssl=self.tls,
                ssl_handshake_timeout=self.header_timeout if self.tls is not None else None,
            )  # fmt: skip
        except (OSError, asyncio.TimeoutError, ssl.SSLError):
            sock.close()  # a client that left, or whose TLS handshake failed or timed out
            return
        await self._client(stream)

    def shutdown(self) -> None:
        """Stop serving and wait until ``serve_forever`` returned (from another thread)."""
        self._stop.set()
        loop, done = self.loop, self._done
        if loop is None or done is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(done.set)
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    def pool(self, replica: Replica) -> AsyncPool:
        found = self.pools.get(replica)
        if found is None:
            address = replica.address
            origin = Origin(address.scheme, address.host, address.port)
            found = self.pools[replica] = AsyncPool(origin, replica.timeouts, client_context, idle=AIO_POOL_SIZE)
        return found

    async def _client(self, stream: Stream) -> None:
        if self.open_connections >= self.max_connections:
            self.refused_connections += 1
            self.router.metrics.connections_refused.inc()
            if self.refused_connections == 1 or self.refused_connections % 1000 == 0:
                log.warning("%d connection(s) refused over the cap of %d (--max-connections)",
                            self.refused_connections, self.max_connections)  # fmt: skip
            stream.write(FULL)
            with contextlib.suppress(OSError):
                await stream.drain()
            stream.abort()
            return
        task = asyncio.current_task()
        assert task is not None  # a connection's callback runs as a task
        self.open_connections += 1
        self._clients.add(task)
        try:
            await ClientConnection(self, stream).run()
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a client hanging up mid-request, or the server stopping: routine
        except Exception:
            log.exception("unhandled error serving %s", stream.peer())
        finally:
            self.open_connections -= 1
            self._clients.discard(task)
            stream.abort()


class ClientConnection:
    """One client connection: its requests one after another (HTTP/1.1 keep-alive)."""

    def __init__(self, server: AsyncRouterServer, stream: Stream):
        self.server, self.router = server, server.router
        self.client = stream  # the client's connection
        self.close = False  # the connection ends after the current answer
        self.request: RequestHead | None = None
        self.last_refusal: bytes | None = None

    async def run(self) -> None:
        stream, server = self.client, self.server
        while not self.close:
            # Waiting for a request's first byte is idling; from it on, its line and headers have header_timeout.
            if not await stream.wait_readable(server.idle_timeout):
                return
            try:
                raw = await stream.read_until(HEAD_END, server.header_timeout)
            except asyncio.LimitOverrunError:
                await self.refuse(WireRefusal(431, f"request line and headers over {MAX_HEAD_BYTES} bytes"))
                return
            head = parse_request_head(raw)
            if isinstance(head, WireRefusal):
                await self.refuse(head)
                return
            self.request = head
            self.close = not head.keep_alive
            await self.handle(head)

    async def refuse(self, refusal: WireRefusal) -> None:
        self.close = True
        await self.send_body(refusal.status, (refusal.message + "\n").encode(), "text/plain", {"Connection": "close"})

    # -- answers the router gives itself ---------------------------------------------------------------------------
    async def send_body(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        lines = [("Content-Type", content_type), ("Content-Length", str(len(body))), *(headers or {}).items()]
        if any(name.lower() == "connection" and value.lower() == "close" for name, value in lines):
            self.close = True
        self.client.write(response_head(status, lines, SERVER) + body)
        await self.client.drain()

    async def send_error_json(
        self, status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None
    ) -> None:
        self.router.metrics.errors.inc(code=code)
        body = APIError(status, message, type=type_, code=code).body()
        extra = {"Retry-After": "1"} if headers is None else headers
        await self.send_body(status, json.dumps(body).encode(), JSON, extra)

    def has_body(self, head: RequestHead) -> bool:
        return head.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in head.headers

    async def read_body(self, head: RequestHead, limit: int) -> bytes | None:
        """The body under a strict ``Content-Length`` (as ``TrackedHandler.read_body_within``); None after
        answering 411/413 (the body left unread, the connection closed after)."""
        raw = head.headers.get("Content-Length")
        required = head.method in ("POST", "PUT")
        if raw is None and (not required or "Transfer-Encoding" not in head.headers):
            return b""
        length = parse_length(raw)
        if length is not None and length <= limit:
            if (head.headers.get("Expect") or "").lower() == "100-continue" and head.version == "HTTP/1.1":
                self.client.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits a second for it (bodies over 1 KiB)
            return await self.client.read_exactly(length, self.server.idle_timeout)
        self.close = True
        if length is None:
            await self.send_error_json(411, "a Content-Length header is required", "invalid_request_error",
                                       "length_required", {"Connection": "close"})  # fmt: skip
        else:
            await self.send_error_json(413, f"request body over {limit} bytes", "invalid_request_error", "too_large",
                                       {"Connection": "close"})  # fmt: skip
        return None

    async def own_route(self, head: RequestHead) -> None:
        """``/health``, ``/metrics`` and the dashboard, answered by ``RouterHandler`` itself on a thread (one home
        for them), on an in-memory connection."""
        body = await self.read_body(head, MAX_BODY) if head.method in ("POST", "PUT") else b""
        if body is None:
            return
        peer = self.client.peer() or ("", 0)
        data, close = await asyncio.to_thread(answer_in_memory, self.server, head, body, peer)
        self.close = self.close or close
        self.client.write(data)
        await self.client.drain()

    async def handle(self, head: RequestHead) -> None:
        path = head.path
        if (head.method == "GET" and path in ("/health", "/metrics")) or is_dashboard_path(path):
            await self.own_route(head)
        elif head.method in ("GET", "POST", "PUT", "DELETE"):
            await self.forward(head)
        else:
            self.close = True
            message = f"method {head.method[:20]} is not supported"
            await self.send_body(501, (message + "\n").encode(), "text/plain", {"Connection": "close"})

    # -- forwarding -----------------------------------------------------------------------------------------------
    async def forward(self, head: RequestHead) -> None:
        started = time.perf_counter()
        router = self.router
        if is_control_path(head.target):
            message = (
                f"{head.path[:200]}: the router does not forward control routes; send them to the "
                "replica itself, with its admin key (`preheat activate URL ...`)"
            )
            close = {"Connection": "close"} if self.has_body(head) else {}
            await self.send_error_json(404, message, "invalid_request_error", "not_forwarded", close)
            return
        if router.api_key and check_bearer(head.headers.get("Authorization"), router.api_key) != "ok":
            message = "missing or wrong API key: send 'Authorization: Bearer <key>' (the router's --api-key)"
            refusal = {"WWW-Authenticate": "Bearer"}
            if self.has_body(head):
                refusal["Connection"] = "close"
            await self.send_error_json(401, message, "authentication_error", "invalid_api_key", refusal)
            return
        body = await self.read_body(head, MAX_BODY)
        if body is None:
            return
        generation = head.method == "POST" and head.path in ROUTE_KINDS
        session = head.headers.get(SESSION_HEADER)
        if generation and router.policy.needs_tokens:
            # A chat whose every piece the router has encoded before is read here, on the loop (~17 us), and so is
            # one with a short new message (prompts.INLINE_CHARS); a longer read is done again on a thread, off the
            # loop (text/segments.py).
            cached = router.prompts.read(head.path, body, session, on_loop=True) if len(body) <= INLINE else None
            request = cached if cached is not None else await asyncio.to_thread(self.read_prompt, head, body, session)
        elif generation and (router.policy.needs_text or router.policy.name == "session"):
            # JSON and a hash (prefix): on the loop, ~6 us; a body past INLINE on a thread, so none holds the loop.
            if len(body) <= INLINE:
                request = router.prompts.read(head.path, body, session)
            else:
                request = await asyncio.to_thread(self.read_prompt, head, body, session)
        else:
            request = RouteRequest(session=session)
        # Expect is answered here (read_body); the replica gets the body at once.
        headers = [(k, v) for k, v in head.headers.items() if k.lower() not in HOP_HEADERS and k.lower() != "expect"]
        if router.replica_authorization is not None:
            headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
            headers.append(("Authorization", router.replica_authorization))
        exchange = await self.exchange(head, body, headers, request, generation)
        if exchange is None:
            return
        replica, sent = exchange.replica, exchange.sent
        upstream_done = [sent]

        def replica_over() -> None:
            upstream_done[0] = time.perf_counter()
            exchange.admitted.leave()
            replica.end(upstream_done[0] - sent)

        over = _once(replica_over)

        def count(status: int) -> None:
            over()
            router.metrics.routed.inc(replica=replica.url, status=str(status))
            routing = sent - started - exchange.held  # held for a replica: its queue, not the router's work
            router.metrics.overhead.observe(routing + max(time.perf_counter() - upstream_done[0], 0.0))

        try:
            reason = "retry" if exchange.tries > 1 else exchange.decision.reason
            await self.relay(exchange, reason, Ending(over, _once(count)))
        finally:
            over()

    def read_prompt(self, head: RequestHead, body: bytes, session: str | None) -> RouteRequest:
        return self.router.prompts.read(head.path, body, session)

    async def exchange(
        self, head: RequestHead, body: bytes, headers: list[tuple[str, str]], request: RouteRequest, generation: bool
    ) -> AioExchange | None:
        router = self.router
        failed: list[Replica] = []
        tries, held = 0, 0.0
        most = 2 * len(router.replicas) + 1
        self.last_refusal = None
        while True:
            pool = router.healthy(exclude=failed)
            cold = router.cold
            if not pool and cold is not None and tries < most and cold.available():
                waited = await asyncio.to_thread(
                    cold.wait_for_replica, lambda: bool(router.healthy(exclude=failed)), "no replica in rotation"
                )
                if waited:
                    continue
            if not pool or tries >= most:
                await self.no_replica(failed)
                return None
            if cold is not None and not tries and saturated((r.in_flight for r in pool), cold.settings.saturation):
                cold.need("every replica in rotation is saturated")
            replica, decision = router.choose(request, pool, retry=bool(tries))
            tries += 1
            attempt = Attempt(replica, router.policy, request if generation else None)
            try:
                outcome = await self.attempt(attempt, head, body, headers, failed)
            except BaseException:  # whatever ends it before its answer is handed over leaves no count behind
                attempt.fail()
                raise
            finally:
                held += attempt.admitted.held_seconds
            if isinstance(outcome, bool):
                if outcome:
                    continue
                return None
            conn, answer, reader, look, sent = outcome
            if attempt.replica is not replica:  # an idle replica took it from the hold (hold.py)
                decision = Decision(attempt.replica.url, "moved", decision.estimate)
            return AioExchange(
                attempt.replica, decision, conn, answer, reader, sent=sent, tries=tries, look=look,
                admitted=attempt.admitted, held=held,
            )  # fmt: skip

    async def attempt(
        self, attempt: Attempt, head: RequestHead, body: bytes, headers: list[tuple[str, str]], failed: list[Replica]
    ) -> tuple[Connection, ResponseHead, Body, Head, float] | bool:
        """Send the request to ``attempt``'s replica (after its hold, for a generation ``kv`` holds): the answer's
        head, once it is worth relaying; True to try another replica, False when the client got an error."""
        router, replica, request = self.router, attempt.replica, attempt.request
        if request is not None:
            attempt.admitted = await self.admit(replica, request, failed)
            if attempt.admitted is not NOT_HELD and attempt.admitted.replica != replica.url:  # moved while held
                moved = router.in_rotation(attempt.admitted.replica)
                if moved is None:  # out of rotation meanwhile: try again, from the start
                    attempt.fail()
                    return True
                replica = attempt.move(moved)
                router.metrics.moved.inc(replica=replica.url)
        sent = time.perf_counter()
        upstream = self.server.pool(replica)
        host = replica.url.split("://", 1)[1]
        wire = request_head(head.method, head.target, host, headers, len(body))
        try:
            conn, answer = await upstream.send(replica.connection_epoch, wire, body, replica.url + head.path)
        except HTTPClientError as exc:
            attempt.fail()
            failed.append(replica)
            error = UpstreamError(str(exc), before_first_byte=not isinstance(exc, ResponseTimeoutError))
            return await self.retry_failed(replica, error, failed)
        reader = Body(conn, answer, replica.timeouts.read, bodiless=head.method == "HEAD" or answer.status in
                      (204, 304) or 100 <= answer.status < 200)  # fmt: skip
        early = await self.read_refusal(conn, answer, reader)
        if isinstance(early, str):
            attempt.fail()
            replica.phase = early
            router.set_health(replica, False, f"answered 503 {early}")
            router.metrics.retries.inc()
            return True
        look = await self.first_look(replica, conn, answer, reader, early)
        if isinstance(look, Refused):
            attempt.fail()
            failed.append(replica)
            return await self.retry_refused(replica, look, failed)
        if request is not None:
            router.policy.answered(request, replica.url, ok=200 <= answer.status < 300)
        attempt.handed_over()
        return conn, answer, reader, look, sent

    async def admit(self, replica: Replica, request: RouteRequest, failed: Sequence[Replica]) -> Pass:
        """Let a generation through to ``replica`` at once, or hold it while the replica has enough of this
        router's requests, when the policy holds them (router/hold.py: ``kv`` before a replica that generates one
        sequence at a time); ``ConnectionResetError`` when the client goes away while it is held. An idle replica
        may take it while it is held, never one of ``failed`` (the replicas that already failed this request: one
        back in rotation is idle, and would take a retried request back)."""
        request.held_seconds = 0.0
        policy = self.router.policy
        slots = policy.hold_slots(request, replica.url)
        if slots is None:
            return NOT_HELD

        def cost_at(name: str) -> float | None:  # at a replica fallen idle, if it is one that holds requests too
            there = self.router.in_rotation(name)
            if there is None or there in failed or policy.hold_slots(request, name) is None:
                return None
            return policy.hold_cost(request, candidate(there))

        def idle() -> list[tuple[str, int]]:  # the other replicas that hold requests too, asked only if it is held
            pool = self.router.healthy(exclude=failed)
            return [(r.url, n) for r in pool if (n := policy.hold_slots(request, r.url)) is not None]

        # Its cost as it would be now, asked only while it is held.
        admitted = await self.router.holds.enter(
            replica.url, slots, lambda: policy.hold_cost(request, candidate(replica)), price_at=cost_at, idle=idle,
            gone=self.client.lost(),
        )  # fmt: skip
        request.held_seconds = admitted.held_seconds
        return admitted

    async def no_replica(self, failed: list[Replica]) -> None:
        cold = self.router.cold
        if cold is not None and cold.errors:
            why = f"no replica in rotation, and none could be brought up ({cold.why_none()})"
        elif self.last_refusal is not None:
            self.router.metrics.errors.inc(code="no_replica")
            await self.send_body(503, self.last_refusal, JSON, {"Retry-After": "1"})
            return
        elif failed:
            why = f"replica {failed[-1].url} failed and no other is healthy"
        else:
            why = "no healthy replica"
        await self.send_error_json(503, f"{why}; retry later", "service_unavailable", "no_replica")

    async def retry_failed(self, replica: Replica, exc: UpstreamError, failed: list[Replica]) -> bool:
        router = self.router
        if exc.before_first_byte:
            router.set_health(replica, False, str(exc))
        if exc.before_first_byte and len(failed) == 1:
            router.metrics.retries.inc()
            return True
        await self.send_error_json(502, f"replica failed before answering: {exc}", "server_error", "bad_gateway")
        return False

    async def retry_refused(self, replica: Replica, refused: Refused, failed: list[Replica]) -> bool:
        router = self.router
        router.metrics.refused.inc(replica=replica.url, code=refused.code)
        if refused.code == "replica_failed":
            router.set_health(replica, False, refused.message)
        if len(failed) == 1 and router.healthy(exclude=failed):
            router.metrics.retries.inc()
            return True
        await self.send_error_json(502, refused.message, "server_error", refused.code)
        return False

    async def read_refusal(self, conn: Connection, answer: ResponseHead, body: Body) -> str | bytes | None:
        """A short 503's body, read to see whether it says "not serving": then the replica's phase (its body kept
        in ``last_refusal``, the connection closed); else the body read (bytes), to relay as it is; None for any
        other answer (left unread)."""
        length = answer.headers.get("Content-Length") or ""
        if answer.status != 503 or answer.chunked or not length.isdigit() or int(length) > REFUSAL_BYTES:
            return None
        try:
            raw = await body.read_within(REFUSAL_BYTES)
        except (OSError, asyncio.IncompleteReadError):
            return None  # first_look reads again and answers 502 replica_failed
        if raw is None:
            return None
        try:
            parsed = loads_bounded(raw, max_bytes=REFUSAL_BYTES, max_depth=8)
        except (JSONInputError, UnicodeDecodeError):
            parsed = None
        code = refused_code(answer.status, parsed if isinstance(parsed, dict) else None)
        if code is None:
            return raw
        conn.close()
        self.last_refusal = raw
        return "loading" if code == "model_loading" else code

    async def first_look(
        self, replica: Replica, conn: Connection, answer: ResponseHead, body: Body, early: bytes | None
    ) -> Head | Refused:
        if answer.chunked:
            if (answer.headers.get("Content-Type") or "").startswith("text/event-stream"):
                return await self.first_events(replica, conn, body)
            return Head()
        limit = self.router.max_answer_bytes
        data = early
        try:
            if data is None and (answer.length or 0) <= limit:
                data = await body.read_within(limit)
        except (OSError, asyncio.IncompleteReadError) as exc:
            conn.close()
            return Refused("replica_failed", f"replica {replica.url} failed while answering: {describe(exc, conn)}")
        if data is None or len(data) > limit:
            conn.close()
            message = (
                f"replica {replica.url} answered more than the router relays ({limit} bytes, "
                "--max-answer-bytes); ask for less (max_tokens, logprobs) or raise the limit"
            )
            return Refused("answer_too_large", message)
        return Head(body=data)

    async def first_events(self, replica: Replica, conn: Connection, body: Body) -> Head | Refused:
        framer, limit = EventFramer(), self.router.max_event_bytes
        while True:
            try:
                data = await body.read1()
            except (OSError, asyncio.IncompleteReadError) as exc:
                conn.close()
                message = f"replica {replica.url} failed before its first event: {describe(exc, conn)}"
                return Refused("replica_failed", message)
            if not data:
                return Head(events=framer.end(), framer=framer, ended=True)
            ready = framer.push(data)
            if ready:
                return Head(events=ready, framer=framer)
            if framer.held > limit:
                conn.close()
                return Refused("event_too_large", event_too_large(replica, limit))

    def release(self, replica: Replica, exchange: AioExchange) -> None:
        if exchange.answer.status >= 400 or replica.retired:
            exchange.conn.close()
            return
        self.server.pool(replica).release(exchange.conn, exchange.answer, exchange.body)

    async def relay(self, exchange: AioExchange, reason: str, ending: Ending) -> None:
        replica, answer, head = exchange.replica, exchange.answer, exchange.look
        headers = [(k, v) for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS]
        headers += [(REPLICA_HEADER, replica.url), (REASON_HEADER, reason)]
        if head.body is not None:
            self.release(replica, exchange)
            headers.append(("Content-Length", str(len(head.body))))
            if self.close:
                headers.append(("Connection", "close"))
            ending.count(answer.status)
            self.client.write(response_head(answer.status, headers, SERVER) + head.body)
            await self.client.drain()
            return
        headers.append(("Transfer-Encoding", "chunked"))
        self.client.write(response_head(answer.status, headers, SERVER))
        await self.stream(exchange, ending)

    async def stream(self, exchange: AioExchange, ending: Ending) -> None:
        """Relay a chunked answer as the replica writes it, after the ``look`` read already. Server-sent events are
        relayed whole, in order: a replica that dies mid-event must not leave half an event in front of the error
        event that ends the stream (``EventFramer``: each byte scanned once); one growing past ``max_event_bytes``
        ends the stream with an error event."""
        replica, conn, status, head = exchange.replica, exchange.conn, exchange.answer.status, exchange.look
        framer, limit = head.framer, self.router.max_event_bytes
        if head.events or head.ended:
            if head.ended:
                ending.count(status)
            if (head.events and not await self.write_chunk(head.events)) or (
                head.ended and not await self.write_chunk(b"")
            ):
                conn.close()
                self.close = True
                ending.count(status)
                return
            if head.ended:
                self.release(replica, exchange)
                return
        while True:
            try:
                data = await exchange.body.read1()
            except (OSError, asyncio.IncompleteReadError) as exc:
                conn.close()
                ending.count(status)
                await self.end_stream(f"replica {replica.url} failed mid-stream: {describe(exc, conn)}",
                                      "replica_failed")  # fmt: skip
                return
            if not data:
                ending.count(status)
            if framer is None:
                ready = data
            elif not data:
                ready = framer.end()
            else:
                ready = framer.push(data)
                if framer.held > limit:
                    conn.close()
                    ending.count(status)
                    await self.end_stream(event_too_large(replica, limit), "event_too_large", ready)
                    return
            if (ready and not await self.write_chunk(ready)) or (not data and not await self.write_chunk(b"")):
                conn.close()  # the client left: closing makes the replica stop generating for nobody
                self.close = True
                ending.count(status)
                return
            if not data:
                self.release(replica, exchange)
                return

    async def end_stream(self, message: str, code: str, before: bytes = b"") -> None:
        self.close = True
        self.router.metrics.errors.inc(code=code)
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        await self.write_chunk(before + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        await self.write_chunk(b"")

    async def write_chunk(self, data: bytes) -> bool:
        """One HTTP chunk (empty: the last); False when the client has gone away."""
        if self.client.is_closing():
            return False
        self.client.write(chunk(data))
        try:
            await self.client.drain()
        except OSError:
            return False
        return True


class AioExchange:
    """A request sent and its answer's head in (proxy.py's ``Exchange``, on the event loop's connection)."""

    __slots__ = ("admitted", "answer", "body", "conn", "decision", "held", "look", "replica", "sent", "tries")

    def __init__(
        self, replica: Replica, decision: Decision, conn: Connection, answer: ResponseHead, body: Body, *,
        sent: float, tries: int, look: Head, admitted: Pass, held: float,
    ) -> None:  # fmt: skip
        """``admitted``: its hold's pass (``leave`` once the replica is done); ``held``: seconds held, every try."""
        self.replica, self.decision, self.conn, self.answer, self.body = replica, decision, conn, answer, body
        self.sent, self.tries, self.look, self.admitted, self.held = sent, tries, look, admitted, held


class Attempt:
    """One replica tried for a request: counted there (``Replica.begin``), told to the policy (``sent``, for a
    generation) and let through its hold, until it ``fail``s (once: the count, the policy and the hold all told) or
    is ``handed_over`` to the relay, whose end (``forward``'s ``replica_over``) tells them instead."""

    __slots__ = ("admitted", "over", "policy", "replica", "request")

    def __init__(self, replica: Replica, policy: Policy, request: RouteRequest | None) -> None:
        self.replica, self.policy, self.request = replica, policy, request
        self.admitted = NOT_HELD
        self.over = False
        replica.begin()
        if request is not None:
            policy.sent(request, replica.url)

    def fail(self) -> None:
        if self.over:
            return
        self.over = True
        self.admitted.leave()
        self.replica.end(None)
        if self.request is not None:
            self.policy.answered(self.request, self.replica.url, ok=False)

    def handed_over(self) -> None:
        self.over = True

    def move(self, to: Replica) -> Replica:
        """The request goes to ``to`` instead (an idle replica took it from the hold): counted there, not here."""
        self.replica.end(None)
        to.begin()
        if self.request is not None:
            self.policy.answered(self.request, self.replica.url, ok=False)
            self.policy.sent(self.request, to.url)
            self.request.held_seconds = 0.0  # sent to ``to`` now, after its hold: none of it is ``to``'s wait
        self.replica = to
        return to


def describe(exc: BaseException, conn: Connection) -> str:
    """A relay failure in words (``IncompleteRead``, a reset, a read that timed out)."""
    if conn.expired:
        return "TimeoutError: timed out"
    if isinstance(exc, asyncio.IncompleteReadError):
        return f"IncompleteRead: connection closed with {exc.expected} bytes of the body still expected"
    return f"{type(exc).__name__}: {exc}"


def answer_in_memory(
    server: AsyncRouterServer, head: RequestHead, body: bytes, peer: tuple[str, int]
) -> tuple[bytes, bool]:
    """``RouterHandler``'s answer to a request of the router's own (``/health``, ``/metrics``, the dashboard) as
    bytes, and whether the connection must close after it. Runs on a worker thread."""
    handler = RouterHandler.__new__(RouterHandler)  # not __init__: that would serve a socket
    handler.server = RouterRoutes(server.router, server.login, server.tls)
    handler.command, handler.path, handler.request_version = head.method, head.target, head.version
    handler.requestline = f"{head.method} {head.target} {head.version}"
    message = http.client.HTTPMessage()
    for name, value in head.headers.items():
        message[name] = value
    handler.headers = message
    out = io.BytesIO()
    handler.rfile, handler.wfile = io.BytesIO(body), out
    handler.client_address = peer
    handler.close_connection = not head.keep_alive
    method = getattr(handler, f"do_{head.method}")
    method()
    return out.getvalue(), handler.close_connection
