"""The router's event-loop data path (router/aioproxy.py) at fleet scale: thousands of concurrent streams relayed
whole and in order, and thousands of idle client connections that cost no thread and stop nothing. The replicas are
``FakeReplica`` doubles (preheat.testing), fast enough that the router is what is exercised; the router is real (in
this process where the test picks its event loop, else a ``preheat router`` process)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import socket
import sys

import pytest

from preheat.core.errors import HTTPClientError
from preheat.core.procs import Child
from preheat.router.aioproxy import AsyncRouterServer
from preheat.testing.fakereplica import FakeReplica
from routing import running_router, wait_until
from serving import Client

STREAMS = 2000
TOKENS = 12
IDLE = 10_000


def dechunk(data: bytes) -> bytes:
    """A chunked body (everything after the head, read to the close) without its framing."""
    out, at = bytearray(), 0
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        assert data[end + 2 + size : end + 4 + size] == b"\r\n", "a chunk without its CRLF"
        at = end + 4 + size


async def one_stream(port: int, ident: str) -> list[bytes]:
    """POST a streamed completion through the router; the events of its answer, as relayed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": TOKENS, "user": ident}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    answer = await reader.read()  # to the close
    writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return [event for event in dechunk(rest).split(b"\n\n") if event]


async def many_streams(port: int, count: int) -> list[list[bytes]]:
    return await asyncio.gather(*(one_stream(port, f"s{k}") for k in range(count)))


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_two_thousand_concurrent_streams_relay_every_token_in_order(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    else:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # the router extra absent: the standard library's loop
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4 * STREAMS + 256:
        pytest.skip(f"needs {4 * STREAMS + 256} open files (client, router both ways, replica), the limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    a, b = FakeReplica(gap=0.005), FakeReplica(gap=0.005)
    # A health check is a new connection: while 2,000 arrive at once on a loaded machine it can wait past the 2 s
    # default twice and eject both replicas (a 503 here, CI once). This test is about the data path, not ejection.
    with (
        a,
        b,
        running_router([a.url, b.url], "round-robin", max_connections=4 * STREAMS, health_timeout=60.0) as router,
    ):
        port = int(router.url.rsplit(":", 1)[1])
        streams = asyncio.run(many_streams(port, STREAMS))
        served_by = type(router.httpd.loop).__module__  # the event-loop server's
    assert served_by.startswith("uvloop" if loop == "uvloop" else "asyncio")
    assert a.streams + b.streams == STREAMS  # none sent twice, none lost
    for k, events in enumerate(streams):
        expected = [b"data: " + json.dumps({"id": f"s{k}", "i": i}).encode() for i in range(TOKENS)]
        assert events == [*expected, b"data: [DONE]"], f"stream s{k}: {events[:3]}..."


def test_ten_thousand_idle_connections_do_not_stop_new_requests() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < IDLE + 256:
        pytest.skip(f"needs {IDLE + 256} open files, the limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with FakeReplica() as replica:
        args = ["router", "--replica", replica.url, "--port", "0", "--max-connections", str(IDLE + 100)]
        with Child("preheat router", args, merge_stderr=True) as router:
            url = router.wait_address(60.0)
            wait_until(lambda: Client(url).get("/health").status == 200, "the replica in rotation", 60.0)
            port = int(url.rsplit(":", 1)[1])
            idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(IDLE)]
            try:
                body = {"model": "m", "prompt": "hi", "max_tokens": 3, "user": "new"}
                wait_until(lambda: len(os.listdir(f"/proc/{router.pid}/fd")) > IDLE, "the router to accept them all")
                fresh = Client(url).post("/v1/completions", body)  # a new connection, past 10,000 idle ones
                last = idle[-1]  # and the newest idle one, still served
                last.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
                answer = last.recv(4096)
                threads = len(os.listdir(f"/proc/{router.pid}/task"))
            finally:
                for sock in idle:
                    sock.close()
    assert fresh.status == 200
    assert fresh.json()["choices"][0]["text"] == "xxx"
    assert answer.startswith(b"HTTP/1.1 200")
    assert threads < 100, f"{threads} threads for {IDLE} idle connections"  # a thread each: over 10,000


def test_a_client_that_expects_100_continue_gets_it_and_then_the_answer() -> None:
    # curl sends "Expect: 100-continue" with any body over 1 KiB and waits for the 100 before sending it.
    body = json.dumps({"model": "m", "prompt": "x" * 2000, "max_tokens": 2, "user": "e"}).encode()
    with FakeReplica() as replica, running_router([replica.url]) as router:
        port = int(router.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
            )
            interim = sock.recv(25)
            sock.sendall(body)
            answer = b""
            while data := sock.recv(65536):
                answer += data
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert answer.startswith(b"HTTP/1.1 200")
    assert answer.endswith(b'"text": "xx"}]}')


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.new_event_loop()  # type: ignore[no-any-return]
    return asyncio.new_event_loop()


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_one_wake_of_the_loop_accepts_every_connection_waiting(loop_kind: str) -> None:
    # uvloop's own server accepted too few per turn of a busy loop: clients arriving together waited ~1 s for it.
    loop = _new_loop(loop_kind)
    server = AsyncRouterServer(("127.0.0.1", 0), router=None)  # type: ignore[arg-type]  # only accepting here
    clients = [socket.create_connection(server.socket.getsockname()[:2]) for _ in range(300)]
    try:
        server.loop = loop
        server.socket.setblocking(False)
        server._accept()
        adopting = len(server._adopting)
        with pytest.raises(BlockingIOError):
            server.socket.accept()  # none left waiting
    finally:
        for task in server._adopting:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*server._adopting, return_exceptions=True))
        loop.close()
        server.server_close()
        for sock in clients:
            sock.close()
    assert adopting == 300


class _OutOfFiles:
    """A listening socket whose accept fails as a process out of descriptors does (EMFILE)."""

    def __init__(self, real: socket.socket) -> None:
        self.real, self.tries = real, 0

    def fileno(self) -> int:
        return self.real.fileno()

    def accept(self) -> tuple[socket.socket, object]:
        self.tries += 1
        raise OSError(errno.EMFILE, "Too many open files")


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_out_of_descriptors_the_router_pauses_accepting_instead_of_spinning(loop_kind: str) -> None:
    loop = _new_loop(loop_kind)
    server = AsyncRouterServer(("127.0.0.1", 0), router=None)  # type: ignore[arg-type]
    client = socket.create_connection(server.socket.getsockname()[:2])  # the socket is ready to read from now on
    failing = _OutOfFiles(server.socket)

    async def scenario() -> tuple[int, bool]:
        server.loop = asyncio.get_running_loop()
        server.socket.setblocking(False)
        server.socket, real = failing, server.socket  # type: ignore[assignment]
        server.loop.add_reader(failing, server._accept)
        await asyncio.sleep(0.3)
        tries_paused = failing.tries  # one try, then no more while the socket stays ready
        deadline = server.loop.time() + 10
        while failing.tries == tries_paused and server.loop.time() < deadline:
            await asyncio.sleep(0.05)  # it tries again after its pause
        server.loop.remove_reader(failing)
        server.socket = real
        return tries_paused, failing.tries > tries_paused

    try:
        tries_paused, resumed = loop.run_until_complete(scenario())
    finally:
        loop.close()
        client.close()
        server.server_close()
    assert tries_paused == 1
    assert resumed


def test_connections_over_the_cap_are_refused_at_once_and_counted_on_metrics() -> None:
    with FakeReplica() as replica:
        args = ["router", "--replica", replica.url, "--port", "0", "--max-connections", "2"]
        with Child("preheat router", args, merge_stderr=True) as router:
            url = router.wait_address(60.0)
            port = int(url.rsplit(":", 1)[1])
            held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
            try:
                held[0].sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")  # both counted once one is answered
                assert held[0].recv(4096).startswith(b"HTTP/1.1 ")
                with socket.create_connection(("127.0.0.1", port), timeout=30) as third:
                    refusal = third.recv(4096)
            finally:
                for sock in held:
                    sock.close()

            def refused_on_metrics() -> bool:
                try:
                    reply = Client(url).get("/metrics")
                except HTTPClientError:
                    return False  # refused and cut: the held connections not yet seen closed
                return reply.status == 200 and b"preheat_router_connections_refused_total 1.0" in reply.body

            wait_until(refused_on_metrics, "the refusal counted on /metrics", 30.0)
    assert refusal.startswith(b"HTTP/1.1 503")
    assert b"too many open connections" in refusal
