"""The server base every preheat server stands on (``preheat serve``, the router, the peer server, ``FileServer``):
keep-alive HTTP/1.1 handlers that the server can cut off at shutdown, bearer tokens compared in constant time,
request bodies read within a limit under a strict ``Content-Length``, plain answers, SIGTERM as Ctrl-C, and TLS:
a server given an ``ssl.SSLContext`` (``tls``; ``preheat.http.tls`` makes them) wraps each accepted connection in
it, the handshake left to the handler thread's first read so that a slow or silent client never holds up accept().

Bounded: at most ``max_connections`` connections hold a handler thread (one more is answered 503 and closed by the
accepting thread, without a thread of its own), and a request's line and headers must arrive within
``header_timeout`` seconds of its first byte, so clients that open connections and send half a request cannot pile
up threads. The wait for a keep-alive connection's next request stays the handler's idle ``timeout``.

The standard library's ``ThreadingHTTPServer`` does the rest; this only adds the few lines every server needs the same
way, so a fix to one (a header, a race at shutdown, Nagle) is a fix to all.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Literal, TypeVar

from preheat.http.ranges import parse_length

log = logging.getLogger("preheat.http")
_Runner = TypeVar("_Runner", bound="BackgroundServer")
BearerCheck = Literal["ok", "missing", "wrong"]
MAX_CONNECTIONS = 512  # handler threads per server (``preheat serve`` and the router: --max-connections)
HEADER_TIMEOUT = 10.0  # seconds from a request's first byte to its last header line (--header-timeout)
# What a connection over the cap gets, from the accepting thread: short enough for any socket buffer.
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 54\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many open connections to this server; retry later\n"
)


class TrackedServer(ThreadingHTTPServer):
    """A threading server that knows its open connections (``cut_connections`` ends them all) and treats clients
    that hang up mid-request as routine rather than tracebacks."""

    daemon_threads = True  # a hung client must not keep the process alive at shutdown
    block_on_close = False
    request_queue_size = 128  # accept backlog: bursts of clients arrive together at a fresh replica or peer
    # Class defaults; ``preheat serve`` and the router set them from their settings on the instance before serving.
    max_connections = MAX_CONNECTIONS
    header_timeout = HEADER_TIMEOUT

    tls: ssl.SSLContext | None = None  # set before serving: https on this listener

    def __init__(self, address: tuple[str, int], handler: type[TrackedHandler]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self.active: set[socket.socket] = set()
        self.active_lock = threading.Lock()
        # Connections holding a handler thread, counted by the accepting thread (``active`` is filled by the
        # handler threads themselves, too late to refuse a burst).
        self.open_connections = 0
        self.refused_connections = 0  # answered 503 for being over ``max_connections``, since the start

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self.active_lock:
            full = self.open_connections >= self.max_connections
            if full:
                self.refused_connections += 1
                refused = self.refused_connections
            else:
                self.open_connections += 1
        if full:
            if refused == 1 or refused % 1000 == 0:  # once, then now and then: a flood must not flood the log too
                log.warning("%d connection(s) refused over the cap of %d (--max-connections)", refused,
                            self.max_connections)  # fmt: skip
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._release()  # no thread started (e.g. the process is out of threads)
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self.active_lock:
            self.open_connections -= 1

    def _refuse(self, request: socket.socket) -> None:
        """Answer 503 and close, on the accepting thread: never wait on this client (a non-blocking send of a few
        bytes; over TLS, which would need a handshake, only the close), and drain what it sent already so that the
        close does not reset the answer away."""
        if self.tls is None:
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_FULL)
                request.recv(65536)
        self.shutdown_request(request)

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        sock, address = super().get_request()
        if self.tls is None:
            return sock, address
        # The handshake happens on the handler thread's first read (under its timeout), never in accept()'s thread.
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def handle_error(self, request: object, client_address: object) -> None:
        # A reader abandoning a stream, a killed pull, a client giving up on a slow answer: all routine.
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("%s: connection ended: %s", client_address, exc)
            return
        log.exception("unhandled error serving %s", client_address)

    def cut_connections(self) -> None:
        """Shut down every open connection (their handler threads then end on their next read or write)."""
        with self.active_lock:
            active = list(self.active)
        for sock in active:
            with contextlib.suppress(OSError):  # already closed by its handler
                # The plain socket's shutdown, also for TLS: SSLSocket.shutdown drops its TLS state under the
                # handler thread's feet (a ValueError there, not the end of a connection).
                socket.socket.shutdown(sock, socket.SHUT_RDWR)


def write_body(
    handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
) -> None:
    """A complete answer on ``handler``: status, ``Content-Type``, ``Content-Length``, ``headers``, then ``body``."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)


def check_bearer(authorization: str | None, token: str) -> BearerCheck:
    """Whether an ``Authorization`` header bears ``token`` (compared in constant time): "ok", "missing" (no bearer
    credential at all) or "wrong".

    >>> check_bearer("Bearer s3cret", "s3cret"), check_bearer(None, "s3cret"), check_bearer("Bearer x", "s3cret")
    ('ok', 'missing', 'wrong')
    """
    given = authorization or ""
    if not given.startswith("Bearer "):
        return "missing"
    return "ok" if hmac.compare_digest(given[len("Bearer ") :].strip().encode(), token.encode()) else "wrong"


@dataclass(frozen=True)
class BodyRefusal:
    """Why a request's body was not read: 411 (a malformed ``Content-Length``, or a ``Transfer-Encoding`` body
    without one) or 413 (over the limit). The body is left unread, so the answer must close the connection
    (``CLOSE``)."""

    status: int
    message: str
    code: str


CLOSE = {"Connection": "close"}  # sent with any answer given before the request's body was read


class BackgroundServer:
    """A ``TrackedServer`` run on a daemon thread: ``start`` binds and serves, ``stop`` stops accepting, cuts every
    open connection and joins; also a context manager. Subclasses build their server in ``make_server``."""

    thread_name = "preheat-http"
    poll_interval = 0.05  # serve_forever checks for shutdown between polls: short keeps stop() prompt

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None = None) -> None:
        self.host, self._port = host, port
        self.tls = tls  # https with this server-side context
        self._server: TrackedServer | None = None
        self._bound: int | None = None
        self._thread: threading.Thread | None = None

    def make_server(self) -> TrackedServer:
        raise NotImplementedError

    def before_stop(self, server: TrackedServer) -> None:
        """Called with the running server just before it is shut down (release requests waiting on it)."""

    @property
    def port(self) -> int:
        """The bound port (still known after ``stop``, so addresses stay printable)."""
        if self._bound is None:
            raise RuntimeError("the server was never started; call start() first")
        return self._bound

    def start(self: _Runner) -> _Runner:
        if self._server is not None:
            return self
        server = self.make_server()
        server.tls = self.tls
        self._server, self._bound = server, int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever, args=(self.poll_interval,), name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self.before_stop(server)
        server.shutdown()
        server.cut_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self: _Runner) -> _Runner:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class TrackedHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive handler registered with its ``TrackedServer`` while it runs."""

    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse one connection per thread
    timeout = 60  # an idle keep-alive connection is closed after a minute
    # Headers and body leave in separate writes: with Nagle's algorithm on, the body waits for the client's delayed
    # ACK of the headers (~40 ms on Linux) on every keep-alive answer, and on every streamed chunk.
    disable_nagle_algorithm = True
    server: TrackedServer

    def setup(self) -> None:
        super().setup()
        # The same buffered reader the base makes (socket.makefile), over a raw reader that keeps the header
        # deadline (``handle_one_request``).
        self.rfile.close()
        self._clock = _HeaderClock(self.connection, self.timeout)
        self.rfile = self._reader = io.BufferedReader(self._clock, io.DEFAULT_BUFFER_SIZE)
        with self.server.active_lock:
            self.server.active.add(self.connection)

    def handle_one_request(self) -> None:
        # Waiting for the request's first byte is idling (``timeout``); from it on, the request line and headers
        # must all arrive within the server's ``header_timeout``, however slowly they trickle in.
        try:
            if not self._reader.peek(1):
                self.close_connection = True  # the client closed its keep-alive connection
                return
        except OSError:  # TimeoutError too: idle for ``timeout``; ssl.SSLError: a failed handshake
            self.close_connection = True
            return
        self._clock.deadline = time.monotonic() + self.server.header_timeout
        try:
            super().handle_one_request()
        finally:
            self._clock.stop()

    def parse_request(self) -> bool:
        try:
            return super().parse_request()
        finally:
            self._clock.stop()  # the headers are in: the body and the answer have the idle ``timeout`` again

    def finish(self) -> None:
        with self.server.active_lock:
            self.server.active.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def answered(self, status: int) -> None:
        """Called with every status sent (a hook for counters)."""

    def head(self, status: int, headers: dict[str, str]) -> None:
        """Send the status line and ``headers``."""
        self.answered(status)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def plain(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
        """A complete ``text/plain`` answer (no body for HEAD)."""
        data = text.encode()
        self.head(status, {"Content-Type": "text/plain", "Content-Length": str(len(data)), **(headers or {})})
        if self.command != "HEAD" and data:
            self.wfile.write(data)

    def send_body(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        """``answered(status)``, then a complete answer (``write_body``): counted before it leaves, so a client that
        scrapes /metrics as soon as it has the answer finds it counted."""
        self.answered(status)
        write_body(self, status, body, content_type, headers)

    def bearer_ok(self, token: str | None, what: str = "token") -> bool:
        """True when ``token`` is None or the request carries ``Authorization: Bearer <token>``; otherwise answer
        401 (none sent) or 403 (a wrong one) and return False. Compared in constant time."""
        if token is None:
            return True
        check = check_bearer(self.headers.get("Authorization"), token)
        if check == "missing":
            self.plain(401, f"a bearer {what} is required\n", {"WWW-Authenticate": 'Bearer realm="preheat"'})
        elif check == "wrong":
            self.plain(403, f"wrong {what}\n")
        return check == "ok"

    def has_body(self) -> bool:
        """Whether the request announces a body (a non-zero ``Content-Length``, or any ``Transfer-Encoding``)."""
        return self.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in self.headers

    def read_body_within(self, limit: int, *, required: bool = True) -> bytes | BodyRefusal:
        """The request's body under a strict ``Content-Length`` (ASCII digits, bounded) of at most ``limit`` bytes;
        b"" when there is neither ``Content-Length`` nor ``Transfer-Encoding`` (RFC 9112 6.3: such a request has no
        body; ``curl -X POST .../wake`` sends none), or no ``Content-Length`` and ``required`` is False. A route that
        needs a body then refuses the empty one itself (400). A ``BodyRefusal`` leaves the body unread and marks the
        connection for closing: answer it with ``CLOSE`` among the headers."""
        raw = self.headers.get("Content-Length")
        if raw is None and (not required or "Transfer-Encoding" not in self.headers):
            return b""  # a chunked body (Transfer-Encoding) is not read here: still 411 below
        length = parse_length(raw)  # None also for '²' or 5,000 digits, which int() would choke on
        if length is not None and length <= limit:
            return self.rfile.read(length)
        self.close_connection = True  # the body stays unread: its bytes must not be parsed as the next request
        if length is None:
            return BodyRefusal(411, "a Content-Length header is required", "length_required")
        return BodyRefusal(413, f"request body over {limit} bytes", "too_large")


class _HeaderClock(io.RawIOBase):
    """A socket's raw reader (what ``socket.makefile`` gives, for reading) that, while ``deadline`` is set, lets each
    ``recv`` wait only until the deadline and raises ``TimeoutError`` past it: a total bound, where a socket timeout
    bounds each wait alone and a client sending a byte every few seconds would never meet it."""

    def __init__(self, sock: socket.socket, idle: float | None) -> None:
        super().__init__()
        self.sock, self.idle = sock, idle
        self.deadline: float | None = None
        self._changed = False  # the socket's timeout is not ``idle`` now

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's line and headers did not arrive in time (--header-timeout)")
            self.sock.settimeout(left if self.idle is None else min(left, self.idle))
            self._changed = True
        return self.sock.recv_into(buffer)

    def stop(self) -> None:
        """The deadline is over: waits are the idle timeout again."""
        self.deadline = None
        if self._changed:
            self._changed = False
            with contextlib.suppress(OSError):  # cut at shutdown meanwhile
                self.sock.settimeout(self.idle)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM (Kubernetes, ``preheat up``, the demo) raises ``KeyboardInterrupt`` like Ctrl-C, so
    one shutdown path serves both; the previous handler is back on leaving. Signal handlers can only be set from the
    main thread: elsewhere (a server run from a test's thread) this does nothing."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
