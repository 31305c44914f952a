"""``preheat.http.aio.Stream``: the router's connections as one protocol, on real loopback sockets, under uvloop and
the standard library's loop (the router runs on either)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest

from preheat.http.aio import Stream


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.new_event_loop()  # type: ignore[no-any-return]
    return asyncio.new_event_loop()


def _run(kind: str, body: Callable[[Stream, socket.socket], Awaitable[object]]) -> object:
    """``body(stream, peer)``: a Stream connected to a plain blocking socket (``peer``) on 127.0.0.1."""
    loop = _new_loop(kind)
    listener = socket.create_server(("127.0.0.1", 0))

    async def main() -> object:
        running = asyncio.get_running_loop()
        connecting = running.create_connection(lambda: Stream(running, limit=64), *listener.getsockname()[:2])
        (_transport, stream), (peer, _address) = await asyncio.gather(
            connecting, running.run_in_executor(None, listener.accept)
        )
        try:
            return await body(stream, peer)
        finally:
            stream.abort()
            peer.close()

    try:
        return loop.run_until_complete(main())
    finally:
        listener.close()
        loop.close()


LOOPS = pytest.mark.parametrize("kind", ["uvloop", "asyncio"])


@LOOPS
def test_reads_take_what_was_sent_in_order(kind: str) -> None:
    async def body(stream: Stream, peer: socket.socket) -> object:
        peer.sendall(b"HEAD\r\n\r\nbody-bytes")
        head = await stream.read_until(b"\r\n\r\n", 5)
        first = await stream.read_exactly(4, 5)
        rest = await stream.read(100, 5)
        peer.shutdown(socket.SHUT_WR)
        end = await stream.read(100, 5)
        return head, first, rest, end, stream.at_eof()

    assert _run(kind, body) == (b"HEAD\r\n\r\n", b"body", b"-bytes", b"", True)


@LOOPS
def test_a_separator_past_the_limit_is_refused_and_a_short_close_is_incomplete(kind: str) -> None:
    async def body(stream: Stream, peer: socket.socket) -> object:
        peer.sendall(b"x" * 100)
        with pytest.raises(asyncio.LimitOverrunError):
            await stream.read_until(b"\r\n\r\n", 5)  # limit=64
        stream.buffer.clear()
        peer.sendall(b"abc")
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(asyncio.IncompleteReadError) as cut:
            await stream.read_exactly(10, 5)
        return cut.value.partial

    assert _run(kind, body) == b"abc"


@LOOPS
def test_a_read_past_its_deadline_aborts_the_connection_and_says_it_expired(kind: str) -> None:
    async def body(stream: Stream, peer: socket.socket) -> object:
        got = await stream.read(10, 0.05)  # nothing sent: the deadline cuts the connection
        return got, stream.expired, stream.is_closing()

    assert _run(kind, body) == (b"", True, True)


@LOOPS
def test_a_later_read_keeps_its_own_deadline_when_an_earlier_one_armed_the_timer(kind: str) -> None:
    # The timer stays armed for the first read's deadline; the second read, with a later deadline, must neither be
    # cut at the first's nor wait forever: the early firing re-arms the timer for it.
    async def body(stream: Stream, peer: socket.socket) -> object:
        peer.sendall(b"a")
        assert await stream.read(1, 0.2) == b"a"  # did not wait: the timer is not even armed
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, peer.sendall, b"b")
        assert await stream.read(1, 0.15) == b"b"  # armed for +0.15 s, answered at +0.05 s
        started = loop.time()
        got = await stream.read(1, 0.6)  # the stale timer fires at +0.15 s of the previous read: re-armed, not cut
        return got, stream.expired, loop.time() - started >= 0.5

    assert _run(kind, body) == (b"", True, True)


@LOOPS
def test_a_peer_that_half_closes_after_its_request_still_gets_the_answer(kind: str) -> None:
    async def body(stream: Stream, peer: socket.socket) -> object:
        peer.sendall(b"question")
        peer.shutdown(socket.SHUT_WR)
        assert await stream.read_exactly(8, 5) == b"question"
        assert await stream.read(10, 5) == b""
        assert not stream.lost().done()  # a router holding its request keeps it
        stream.write(b"answer")
        await stream.drain()
        peer.settimeout(5)
        return peer.recv(100)

    assert _run(kind, body) == b"answer"


@LOOPS
def test_drain_waits_for_a_slow_reader_and_fails_once_it_is_gone(kind: str) -> None:
    async def body(stream: Stream, peer: socket.socket) -> object:
        loop = asyncio.get_running_loop()
        while not stream._paused_writing:  # fill the socket buffers until the transport pushes back
            stream.write(b"x" * 65536)
            await asyncio.sleep(0)
        drained = loop.create_task(stream.drain())
        await asyncio.sleep(0.05)
        waiting = not drained.done()
        peer.close()
        stream.abort()
        with pytest.raises(ConnectionResetError):
            await drained
        return waiting

    assert _run(kind, body) is True


@LOOPS
def test_lost_is_done_once_the_peer_resets_the_connection(kind: str) -> None:
    async def body(stream: Stream, peer: socket.socket) -> object:
        lost = stream.lost()
        await asyncio.sleep(0.05)
        before = lost.done()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # a reset
        await asyncio.wait_for(lost, 5)
        return before, stream.lost().done()  # asked again after: done at once

    assert _run(kind, body) == (False, True)
