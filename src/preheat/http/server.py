"""The server base every preheat server stands on (``preheat serve``, the router, the peer server, ``FileServer``):
keep-alive HTTP/1.1 handlers that the server can cut off at shutdown, bearer tokens compared in constant time,
request bodies read within a limit under a strict ``Content-Length``, plain answers, and SIGTERM as Ctrl-C.

The standard library's ``ThreadingHTTPServer`` does the rest; this only adds the few lines every server needs the same
way, so a fix to one (a header, a race at shutdown, Nagle) is a fix to all.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Literal, TypeVar

from preheat.http.ranges import parse_length

log = logging.getLogger("preheat.http")
_Runner = TypeVar("_Runner", bound="BackgroundServer")
BearerCheck = Literal["ok", "missing", "wrong"]


class TrackedServer(ThreadingHTTPServer):
    """A threading server that knows its open connections (``cut_connections`` ends them all) and treats clients
    that hang up mid-request as routine rather than tracebacks."""

    daemon_threads = True  # a hung client must not keep the process alive at shutdown
    block_on_close = False
    request_queue_size = 128  # accept backlog: bursts of clients arrive together at a fresh replica or peer

    def __init__(self, address: tuple[str, int], handler: type[TrackedHandler]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self.active: set[socket.socket] = set()
        self.active_lock = threading.Lock()

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
                sock.shutdown(socket.SHUT_RDWR)


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

    def __init__(self, host: str, port: int) -> None:
        self.host, self._port = host, port
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
        with self.server.active_lock:
            self.server.active.add(self.connection)

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
