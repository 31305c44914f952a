"""The HTTP client preheat's processes talk to each other with: its errors say what failed, answers are bounded, and
a kept-alive connection survives the server closing it, against a real server on loopback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from preheat.http.client import (
    AnswerTooLargeError,
    ConnectError,
    Connection,
    ResponseTimeoutError,
    Timeouts,
    request,
)
from preheat.http.server import BackgroundServer, TrackedHandler, TrackedServer

RELEASE = threading.Event()


class _Handler(TrackedHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        if self.path == "/slow":
            RELEASE.wait(10)
        if self.path == "/close":
            self.plain(200, "bye\n", {"Connection": "close"})
            return
        size = int(self.path.rsplit("/", 1)[-1]) if self.path.startswith("/bytes/") else 3
        self.send_body(200, b"x" * size, "application/octet-stream")


class _Server(BackgroundServer):
    def make_server(self) -> TrackedServer:
        return TrackedServer((self.host, self._port), _Handler)


@pytest.fixture
def server() -> Iterator[str]:
    RELEASE.clear()
    with _Server("127.0.0.1", 0) as running:
        yield f"http://127.0.0.1:{running.port}"
    RELEASE.set()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_port_nobody_listens_on_is_a_refused_connect() -> None:
    with pytest.raises(ConnectError) as caught:
        request(f"http://127.0.0.1:{_free_port()}/health", timeouts=Timeouts.within(2.0))
    assert caught.value.refused
    assert "127.0.0.1" in str(caught.value)


def test_an_answer_over_the_limit_is_refused(server: str) -> None:
    assert request(server + "/bytes/100", timeouts=Timeouts.within(5.0), max_body=100).body == b"x" * 100
    with pytest.raises(AnswerTooLargeError, match="over 99 bytes"):
        request(server + "/bytes/100", timeouts=Timeouts.within(5.0), max_body=99)


def test_no_answer_within_the_read_timeout_is_a_response_timeout(server: str) -> None:
    with pytest.raises(ResponseTimeoutError, match="/slow"):
        request(server + "/slow", timeouts=Timeouts(connect=2.0, read=0.2))


def test_a_kept_alive_connection_reconnects_after_the_server_closed_it(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    conn = Connection(host, int(port), Timeouts.within(5.0))
    try:
        assert conn.request("GET", "/close").status == 200
        assert conn.request("GET", "/bytes/5").body == b"xxxxx"
        assert conn.request("GET", "/bytes/6").body == b"xxxxxx"
    finally:
        conn.close()
