"""An HTTP server that records the ``Authorization`` and ``Cookie`` header of every request it gets, and answers 200
or a configured redirect: where a client's credentials went (tests/integration/peer/test_peer_trust*.py)."""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Seen:
    scheme: str
    path: str
    authorization: str | None
    cookie: str | None


class _Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RecordingServer

    def do_GET(self) -> None:
        scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
        with self.server.lock:
            self.server.seen.append(
                Seen(scheme, self.path, self.headers.get("Authorization"), self.headers.get("Cookie"))
            )
        target = self.server.redirects.get((scheme, self.path))
        if target is not None:
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b"the file\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class RecordingServer(http.server.ThreadingHTTPServer):
    """Answers 200 (or a configured redirect) and records every request; with ``tls``, a connection that opens with
    a TLS handshake is served over TLS and any other as plain HTTP, on the one port."""

    daemon_threads = True

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.tls = tls
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.redirects: dict[tuple[str, str], str] = {}  # (scheme, path) -> Location
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        sock, address = super().get_request()
        if self.tls is not None:
            sock.settimeout(5)
            if sock.recv(1, socket.MSG_PEEK) == b"\x16":  # a TLS handshake record
                sock = self.tls.wrap_socket(sock, server_side=True)
            sock.settimeout(None)
        return sock, address

    def __enter__(self) -> RecordingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
