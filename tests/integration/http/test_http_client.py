"""The HTTP client preheat's processes talk to each other with: its errors say what failed, answers are bounded, and
a kept-alive connection survives the server closing it, against a real server on loopback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from preheat.core.errors import AnswerTooLargeError, ConnectError, RedirectError, ResponseTimeoutError
from preheat.http.client import Redirects, Timeouts, get, request, stream
from preheat.http.pool import Connection
from preheat.http.server import BackgroundServer, TrackedHandler, TrackedServer

RELEASE = threading.Event()


class _Handler(TrackedHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server dispatches on this name
        if self.path == "/slow":
            RELEASE.wait(10)
        if self.path.startswith("/to/"):  # /to/<n>: n more redirects on this server, then /bytes/4
            left = int(self.path.rsplit("/", 1)[-1])
            self.plain(302, "", {"Location": f"/to/{left - 1}" if left > 1 else "/bytes/4"})
            return
        if self.path == "/lines":
            self.plain(200, "one\ntwo\n")
            return
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


def test_a_stream_yields_the_body_line_by_line(server: str) -> None:
    with stream(server + "/lines", timeouts=Timeouts.within(5.0)) as answer:
        assert answer.status == 200
        assert list(answer.lines()) == [b"one\n", b"two\n"]


def test_redirects_are_followed_up_to_the_limit_and_no_further(server: str) -> None:
    answer = get(server + "/to/3", timeouts=Timeouts.within(5.0), max_body=10, redirects=Redirects(limit=3))
    assert (answer.status, answer.body) == (200, b"xxxx")
    with pytest.raises(RedirectError, match="more than 3 redirects"):
        get(server + "/to/4", timeouts=Timeouts.within(5.0), max_body=10, redirects=Redirects(limit=3))
    unfollowed = get(server + "/to/1", timeouts=Timeouts.within(5.0), max_body=10)
    assert unfollowed.status == 302


def test_a_redirect_keeps_authorization_only_on_the_same_scheme_host_and_port() -> None:
    policy, sent = Redirects(), {"Authorization": "Bearer t", "Accept": "*/*"}
    assert policy.follow("http://a:1/x", "/y", sent) == ("http://a:1/y", sent)
    for elsewhere in ("http://b:1/y", "http://a:2/y", "https://a:1/y", "http://a/y"):
        assert policy.follow("http://a:1/x", elsewhere, sent) == (elsewhere, {"Accept": "*/*"})
    with pytest.raises(RedirectError, match="http or https only"):
        policy.follow("http://a:1/x", "file:///etc/passwd", sent)
