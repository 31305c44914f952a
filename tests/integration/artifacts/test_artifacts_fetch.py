"""Fetching artifacts from a peer: the peer token goes only to the address the registry named, redirects are few and
http(s) only, and no more than the cap is ever read. Real HTTP servers on 127.0.0.1 record what they receive."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from artifactkit import KEY
from preheat.artifacts.store import fetch
from preheat.peer.server import ARTIFACTS_ROUTE

TOKEN = "peer-s3cret"
BLOB = b"PREHEAT-ARTIFACT 2\n" + b"x" * 100
PATH = f"{ARTIFACTS_ROUTE}{KEY.hex}"


@dataclass
class Script:
    """What a recording server answers: a redirect target, a body (with or without Content-Length), or an endless
    stream; and every request's path and Authorization header."""

    location: str | None = None
    body: bytes = BLOB
    declare_length: bool = True
    endless: bool = False
    seen: list[tuple[str, str | None]] = field(default_factory=list)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        script = self.server.script
        script.seen.append((self.path, self.headers.get("Authorization")))
        if script.location is not None:
            self.send_response(302)
            self.send_header("Location", script.location)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        if script.declare_length:
            self.send_header("Content-Length", str(len(script.body)))
        self.send_header("Connection", "close")
        self.end_headers()
        with contextlib.suppress(OSError):  # the client hanging up is how an endless body ends
            self.wfile.write(script.body)
            while script.endless:
                self.wfile.write(b"y" * 65536)

    def log_message(self, format: str, *args: object) -> None:
        return


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: Script) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script

    @property
    def port(self) -> int:
        return int(self.server_address[1])


@pytest.fixture
def servers() -> Iterator[tuple[_Server, _Server]]:
    pair = (_Server(Script()), _Server(Script()))
    threads = [threading.Thread(target=s.serve_forever, args=(0.02,), daemon=True) for s in pair]
    for thread in threads:
        thread.start()
    yield pair
    for server in pair:
        server.shutdown()
        server.server_close()


def test_a_redirect_to_another_host_drops_authorization(servers: tuple[_Server, _Server]) -> None:
    peer, elsewhere = servers
    peer.script.location = f"http://localhost:{elsewhere.port}{PATH}"  # another host name (and port)
    assert fetch(f"127.0.0.1:{peer.port}", KEY, token=TOKEN) == BLOB
    assert peer.script.seen == [(PATH, f"Bearer {TOKEN}")]
    assert elsewhere.script.seen == [(PATH, None)]


def test_a_redirect_to_another_port_drops_authorization(servers: tuple[_Server, _Server]) -> None:
    peer, elsewhere = servers
    peer.script.location = f"http://127.0.0.1:{elsewhere.port}{PATH}"
    assert fetch(f"127.0.0.1:{peer.port}", KEY, token=TOKEN) == BLOB
    assert elsewhere.script.seen == [(PATH, None)]


def test_a_redirect_on_the_same_peer_keeps_authorization(servers: tuple[_Server, _Server]) -> None:
    peer, _ = servers
    peer.script.location = f"http://127.0.0.1:{peer.port}{PATH}?moved"
    result = fetch(f"127.0.0.1:{peer.port}", KEY, token=TOKEN)
    assert result is None  # it redirects forever; the handler gives up after a few
    assert 2 <= len(peer.script.seen) <= 5
    assert all(auth == f"Bearer {TOKEN}" for _, auth in peer.script.seen)


@pytest.mark.parametrize("target", ["file:///etc/passwd", "ftp://127.0.0.1/x", "data:,evil"])
def test_a_redirect_off_http_is_refused(servers: tuple[_Server, _Server], target: str) -> None:
    peer, _ = servers
    peer.script.location = target
    assert fetch(f"127.0.0.1:{peer.port}", KEY, token=TOKEN) is None


def test_a_declared_length_over_the_cap_is_not_read(servers: tuple[_Server, _Server]) -> None:
    peer, _ = servers
    peer.script.body = b"z" * 4096
    assert fetch(f"127.0.0.1:{peer.port}", KEY, token=TOKEN, max_bytes=4095) is None
    assert fetch(f"127.0.0.1:{peer.port}", KEY, token=TOKEN, max_bytes=4096) == b"z" * 4096


def test_an_endless_body_is_read_only_up_to_the_cap(servers: tuple[_Server, _Server]) -> None:
    peer, _ = servers
    peer.script.declare_length = False
    peer.script.endless = True
    assert fetch(f"127.0.0.1:{peer.port}", KEY, token=TOKEN, max_bytes=1 << 20) is None
