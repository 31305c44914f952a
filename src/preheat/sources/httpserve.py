"""What preheat's small byte servers share (``FileServer``, the peer server): keep-alive HTTP/1.1 handlers that the
server can cut off at shutdown, bearer tokens compared in constant time, and plain-text answers.

The standard library's ``ThreadingHTTPServer`` does the rest; this only adds the few lines both servers need the same
way, so a fix to one (a header, a race at shutdown) is a fix to both.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TypeVar

log = logging.getLogger("preheat.httpserve")
_Runner = TypeVar("_Runner", bound="BackgroundServer")


class TrackedServer(ThreadingHTTPServer):
    """A threading server that knows its open connections (``cut_connections`` ends them all) and treats clients
    that hang up mid-request as routine rather than tracebacks."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type[TrackedHandler]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self.active: set[socket.socket] = set()
        self.active_lock = threading.Lock()

    def handle_error(self, request: object, client_address: object) -> None:
        # A reader abandoning a stream, a killed pull, a puller giving up on a stalled peer: all routine.
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("%s: connection ended: %s", client_address, exc)
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]

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
    # Headers and body go out in separate writes; with Nagle on, the body would wait for the client's delayed ACK
    # (40 ms per small request).
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

    def bearer_ok(self, token: str | None, what: str = "token") -> bool:
        """True when ``token`` is None or the request carries ``Authorization: Bearer <token>``; otherwise answer
        401 (none sent) or 403 (a wrong one) and return False. Compared in constant time."""
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        if not given.startswith("Bearer "):
            self.plain(401, f"a bearer {what} is required\n", {"WWW-Authenticate": 'Bearer realm="preheat"'})
            return False
        if not hmac.compare_digest(given[len("Bearer ") :].strip().encode(), token.encode()):
            self.plain(403, f"wrong {what}\n")
            return False
        return True
