"""A real HTTP server that answers whatever a test scripts (a lying origin, a replica that sends garbage), so the
client side of each parser meets it over a socket; the Hypothesis strategies that feed such tests are in
tests/strategies.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# An answer: status, headers, and the body as pieces (each piece is written and flushed; chunked when no length).
Answer = tuple[int, dict[str, str], Iterable[bytes]]


@dataclass
class ScriptedServer:
    """A real HTTP/1.1 server on 127.0.0.1 whose every answer comes from ``script(method, path, headers)``.

    A body without ``Content-Length`` in its headers is sent chunked, piece by piece, until the iterable ends or the
    client goes away: an endless generator is a server that never stops sending.
    """

    script: Callable[[str, str, dict[str, str]], Answer]
    requests: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet: tests read answers, not logs
                pass

            def answer(self) -> None:
                outer.requests.append((self.command, self.path))
                status, headers, pieces = outer.script(self.command, self.path, dict(self.headers))
                self.send_response(status)
                chunked = "Content-Length" not in headers and self.command != "HEAD"
                for name, value in headers.items():
                    self.send_header(name, value)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if self.command == "HEAD":
                    return
                try:
                    for piece in pieces:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                        self.wfile.flush()
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                except OSError:  # the client stopped reading: what a careful client does with a lying server
                    self.close_connection = True

            def do_GET(self) -> None:
                self.answer()

            def do_HEAD(self) -> None:
                self.answer()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


# 64 KiB of "[": json.loads raises RecursionError on it (no ValueError, so it got past callers' except clauses: issue
# 27); jsonsafe refuses it as nested too deeply.
DEEP_JSON = b"[" * 65536


def always(body: bytes, status: int = 200) -> Callable[[str, str, dict[str, str]], Answer]:
    """A script for ``ScriptedServer``: every request is answered ``status`` with ``body`` (its length given)."""
    return lambda method, path, headers: (status, {"Content-Length": str(len(body))}, [body])


def endless(piece: bytes) -> Iterator[bytes]:
    """A body that never ends."""
    while True:
        yield piece
