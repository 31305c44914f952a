"""How preheat's one HTTP client fails, against real servers on loopback that misbehave on purpose: every way in
(a request on its own connection, a stream, the pool, a kept-alive ``Connection``) turns a reset, a body cut short
and a silent server into the error ``preheat.http.client`` documents, and the pool resends a request that met a
kept-alive connection the server had closed while it was idle."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

import pytest

from preheat.core.errors import ExchangeError, ResponseTimeoutError
from preheat.http.client import Timeouts, origin, request, stream
from preheat.http.pool import Connection, Pool

QUICK = Timeouts(connect=2.0, read=0.3)  # the silent server is the only one that waits, and it never answers
# Every other server answers (or resets, or cuts) at once; on a loaded machine "at once" may pass 0.3 s, and a read
# timeout there would be a different error than the one its test names.
PATIENT = Timeouts(connect=2.0, read=30.0)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class RawServer:
    """A TCP server on 127.0.0.1 that reads each request's head and then does what ``behave`` says with the socket;
    ``connections`` counts the connections it accepted."""

    def __init__(self, behave: Callable[[socket.socket, int], None]) -> None:
        self.behave = behave
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []

    def __enter__(self) -> RawServer:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv(), which close() does not
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept(self) -> None:
        self._listener.settimeout(0.05)  # closing a listener does not wake accept(): poll so that __exit__ can stop it
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._sockets.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            self.behave(conn, number)


def read_head(conn: socket.socket) -> bytes:
    """One request's head (this server's clients send no bodies); b"" when the client closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(4096)
        if not piece:
            return b""
        data += piece
    return data


def resets(conn: socket.socket, number: int) -> None:
    read_head(conn)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with an RST, not a FIN
    conn.close()


def cuts_the_body(conn: socket.socket, number: int) -> None:
    read_head(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    conn.close()


def never_answers(conn: socket.socket, number: int) -> None:
    read_head(conn)
    conn.recv(1)  # until the client gives up and closes


def answers_once_then_closes(conn: socket.socket, number: int) -> None:
    """A keep-alive answer, then the connection is closed without a word: what a server's idle timeout does."""
    if read_head(conn):
        conn.sendall(OK)
    conn.close()


def keeps_alive(conn: socket.socket, number: int) -> None:
    while read_head(conn):
        conn.sendall(OK)


def via_request(url: str, timeouts: Timeouts = PATIENT) -> bytes:
    return request(url + "/x", timeouts=timeouts).body


def via_stream(url: str, timeouts: Timeouts = PATIENT) -> bytes:
    with stream(url + "/x", timeouts=timeouts) as answer:
        return answer.read(max_body=1000)


def via_stream_lines(url: str, timeouts: Timeouts = PATIENT) -> bytes:
    with stream(url + "/x", timeouts=timeouts) as answer:
        return b"".join(answer.lines())


def via_pool(url: str, timeouts: Timeouts = PATIENT) -> bytes:
    conn, answer = Pool(timeouts).send(origin(url), "GET", "/x", headers={})
    try:
        return answer.read()
    finally:
        conn.close()


def via_pool_request(url: str, timeouts: Timeouts = PATIENT) -> bytes:
    answer = Pool(timeouts).request("GET", url + "/x")
    try:
        return answer.body.read()
    finally:
        answer.abandon()


def via_connection(url: str, timeouts: Timeouts = PATIENT) -> bytes:
    where = origin(url)
    assert where.port is not None
    conn = Connection(where.host, where.port, timeouts)
    try:
        return conn.request("GET", "/x").body
    finally:
        conn.close()


WAYS_IN = [via_request, via_stream, via_stream_lines, via_pool, via_pool_request, via_connection]
WHOLE_BODIES = [via_request, via_stream, via_stream_lines, via_connection]  # the others leave the body to the caller


@pytest.fixture(params=WAYS_IN, ids=lambda way: way.__name__)
def way_in(request: pytest.FixtureRequest) -> Callable[..., bytes]:
    way: Callable[..., bytes] = request.param
    return way


def test_a_server_that_resets_the_connection_is_an_exchange_error(way_in: Callable[[str], bytes]) -> None:
    with RawServer(resets) as server, pytest.raises(ExchangeError) as caught:
        way_in(server.url)
    assert caught.value.url.startswith(server.url)


@pytest.mark.parametrize("way_in", WHOLE_BODIES, ids=lambda way: way.__name__)
def test_a_body_cut_short_is_an_exchange_error_never_a_shorter_body(way_in: Callable[[str], bytes]) -> None:
    with RawServer(cuts_the_body) as server, pytest.raises(ExchangeError, match="closed") as caught:
        way_in(server.url)
    assert caught.value.url == server.url + "/x"


def test_a_server_that_never_answers_is_a_response_timeout(way_in: Callable[..., bytes]) -> None:
    with RawServer(never_answers) as server, pytest.raises(ResponseTimeoutError, match=r"no answer within 0\.3 s"):
        way_in(server.url, QUICK)


# -- the pool --------------------------------------------------------------------------------------------------------


def test_a_request_on_a_connection_the_server_closed_while_idle_is_resent_on_a_fresh_one() -> None:
    with RawServer(answers_once_then_closes) as server:
        pool, where = Pool(PATIENT), origin(server.url)
        for _ in range(3):
            conn, answer = pool.send(where, "GET", "/x", headers={})
            assert answer.read() == b"ok"
            pool.release(where, conn, answer)
        assert server.connections == 3  # each request after the first found its kept-alive connection closed


def test_a_connection_is_kept_alive_only_once_its_answer_was_read_to_its_end() -> None:
    with RawServer(keeps_alive) as server:
        pool, where = Pool(PATIENT), origin(server.url)
        conn, answer = pool.send(where, "GET", "/x", headers={})
        assert answer.read() == b"ok"
        pool.release(where, conn, answer)
        conn, answer = pool.send(where, "GET", "/x", headers={})
        assert answer.read(1) == b"o"  # half read: the rest would be taken for the next answer
        pool.release(where, conn, answer)
        conn, answer = pool.send(where, "GET", "/x", headers={})
        assert answer.read() == b"ok"
        pool.release(where, conn, answer)
        assert server.connections == 2


def test_an_answer_ended_twice_never_closes_a_connection_another_request_took() -> None:
    with RawServer(keeps_alive) as server:
        pool = Pool(PATIENT)
        first = pool.request("GET", server.url + "/x")
        assert first.body.read() == b"ok"
        first.finish()
        second = pool.request("GET", server.url + "/x")  # on the connection ``first`` gave back
        first.abandon()  # too late: ``first`` is over, and must not touch what is now ``second``'s
        assert second.body.read() == b"ok"
        second.finish()
        assert server.connections == 1


def test_idle_connections_beyond_the_bound_are_closed() -> None:
    with RawServer(keeps_alive) as server:
        pool = Pool(PATIENT, idle=1)
        answers = [pool.request("GET", server.url + "/x") for _ in range(3)]  # three at once: three connections
        for answer in answers:
            assert answer.body.read() == b"ok"
            answer.finish()
        for _ in range(3):  # one after another: the one kept alive serves them all
            answer = pool.request("GET", server.url + "/x")
            assert answer.body.read() == b"ok"
            answer.finish()
        assert server.connections == 3
