"""HTTP/1.1 on an event loop: a connection's bytes (``Stream``), an answer's head and body read from a kept-alive
connection, and a pool of such connections per origin. The event-loop twin of ``http.pool`` (the threaded one): the
same rules, one loop thread.

A request takes an idle connection (the most recently used first) or opens one (TCP_NODELAY; TLS with
``tls.client_context()``), and its connection goes back only once the answer was read to its end and neither side
asked to close. A kept-alive connection the server closed while it sat idle fails before any answer; ``AsyncPool.send``
resends such a request once on a fresh connection (the server never saw it). Failures are the ``HTTPClientError``
family, mapped by ``client.map_exception``: ``ConnectError`` (nothing sent), ``ResponseTimeoutError``,
``ExchangeError``.

Timeouts are deadlines that abort the transport (``Stream.expire``), not a task per read: a read waiting on an
aborted transport fails at once, and the connection knows it was the timer.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import cast

from preheat.core.errors import ExchangeError, ResponseTimeoutError
from preheat.http.client import Origin, Timeouts, map_exception
from preheat.http.wire import HEAD_END, MAX_HEAD_BYTES, ResponseHead, parse_chunk_size, parse_response_head

_NEVER = float("inf")
PIECE = 65536  # the most read at once: a huge body or chunk is relayed in pieces, never held whole
# What a request on a connection the server closed while it was idle fails with: safe to resend on a fresh one.
STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, asyncio.IncompleteReadError)


class Connection:
    """One kept-alive connection to an origin: its ``Stream``, the origin's epoch it was opened in, and whether it
    carried a request before."""

    __slots__ = ("epoch", "reused", "stream")

    def __init__(self, stream: Stream, epoch: int) -> None:
        self.stream, self.epoch = stream, epoch
        self.reused = False

    @property
    def expired(self) -> bool:
        """A read's deadline passed and cut the connection."""
        return self.stream.expired

    def close(self) -> None:
        self.stream.abort()  # no graceful close: an unread answer must stop being generated now


class Body:
    """An answer's body, read piece by piece (``read1``: b"" at its end): by ``Content-Length``, chunked (the
    chunks' data, without their framing) or to the close. ``done``: read to its end, so the connection may carry
    another request."""

    def __init__(self, conn: Connection, head: ResponseHead, read_timeout: float, *, bodiless: bool = False) -> None:
        self.conn, self.read_timeout = conn, read_timeout
        self.chunked = head.chunked
        self.left = 0 if bodiless else head.length  # None: to the close (not chunked) or the chunk's size unknown
        self.in_chunk = 0  # bytes of the current chunk still to read
        self.done = bodiless or head.length == 0

    async def read1(self) -> bytes:
        """The next piece of the body (at most ``PIECE`` bytes); b"" at its end. Raises ``OSError`` (the connection
        broke or its read timer fired) or ``asyncio.IncompleteReadError`` (the body was cut short)."""
        if self.done:
            return b""
        stream, seconds = self.conn.stream, self.read_timeout
        if self.chunked:
            if not self.in_chunk:
                line = await stream.read_until(b"\n", seconds)
                size = parse_chunk_size(line)
                if size is None:
                    raise ConnectionAbortedError(f"bad chunk size line {line[:40]!r}")
                if size == 0:
                    while (await stream.read_until(b"\n", seconds)).strip():
                        pass  # trailers: read, not relayed
                    self.done = True
                    return b""
                self.in_chunk = size
            data = await stream.read(min(self.in_chunk, PIECE), seconds)
            if not data:
                raise asyncio.IncompleteReadError(b"", self.in_chunk)
            self.in_chunk -= len(data)
            if not self.in_chunk:
                await stream.read_exactly(2, seconds)
            return data
        if self.left is None:
            data = await stream.read(PIECE, seconds)
            self.done = not data
            return data
        data = await stream.read(min(self.left or 0, PIECE), seconds)
        if not data:
            raise asyncio.IncompleteReadError(b"", self.left)
        self.left -= len(data)
        self.done = not self.left
        return data

    async def read_within(self, limit: int) -> bytes | None:
        """The whole body, or None past ``limit`` bytes (at most one piece past it was read)."""
        parts: list[bytes] = []
        size = 0
        while data := await self.read1():
            parts.append(data)
            size += len(data)
            if size > limit:
                return None
        return b"".join(parts)


class Stream(asyncio.Protocol):
    """One connection's bytes with awaitable reads and writes: what asyncio's ``StreamReader``/``StreamWriter`` pair
    gives, as one protocol, for a fraction of their cost per call (the router's data path makes several per request).

    A read waits at most the ``seconds`` it is given; past them the connection is aborted (``expired``) and the read
    fails as the peer closing would. Deadlines share one lazy timer: a wait that ends before its deadline leaves the
    timer armed, and a later wait with a later deadline moves nothing (the timer, firing early, re-arms itself), so a
    request that never waits long costs no timer at all."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = MAX_HEAD_BYTES) -> None:
        """``limit``: the longest ``read_until`` looks for its separator (a head's bound); reading pauses while more
        than twice this much is buffered unread."""
        self.loop, self.limit = loop, limit
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the peer closed its side, or the connection was lost: nothing more will come
        self.error: Exception | None = None  # why the connection was lost, when it was an error
        self.expired = False  # a read's deadline passed and aborted the connection
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = None  # ``lost()``'s, made on first asking
        self._gone = False  # the connection was lost (not half-closed)
        self._paused_reading = self._paused_writing = False
        self._deadline = _NEVER  # when the read now waiting must give up
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER

    # -- the protocol (called by the loop) -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's transports are not asyncio's subclasses

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()
        if len(self.buffer) > 2 * self.limit and not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        self.eof = True
        self._wake()
        # Stay open to answer a peer that half-closed after its request (as StreamReaderProtocol does); TLS cannot.
        return self.transport is not None and self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._gone = True
        self._wake()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, _NEVER
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_exception(ConnectionResetError("connection lost"))

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    # -- reads ------------------------------------------------------------------------------------------------------
    async def read_until(self, separator: bytes, seconds: float) -> bytes:
        """The bytes up to and including ``separator``. Raises ``asyncio.LimitOverrunError`` when it is not within
        ``limit`` bytes, ``asyncio.IncompleteReadError`` at the close."""
        deadline: float | None = None
        start, buffer = 0, self.buffer
        while True:
            found = buffer.find(separator, start)
            if found >= 0:
                end = found + len(separator)
                if end > self.limit:
                    raise asyncio.LimitOverrunError("separator found past the limit", end)
                data = bytes(buffer[:end])
                del buffer[:end]
                return data
            if len(buffer) > self.limit:
                raise asyncio.LimitOverrunError("separator not found within the limit", len(buffer))
            if self.eof:
                self._raise_error()
                raise asyncio.IncompleteReadError(bytes(buffer), None)
            start = max(0, len(buffer) - len(separator) + 1)
            if deadline is None:
                deadline = self.loop.time() + seconds
            await self._wait(deadline)

    async def read(self, most: int, seconds: float) -> bytes:
        """Up to ``most`` bytes, as soon as there are any; b"" at the close."""
        if not self.buffer and not self.eof:
            await self._wait(self.loop.time() + seconds)
        if not self.buffer:
            self._raise_error()
            return b""
        data = bytes(self.buffer[:most])
        del self.buffer[:most]
        return data

    async def read_exactly(self, size: int, seconds: float) -> bytes:
        """``size`` bytes; ``asyncio.IncompleteReadError`` when the connection closes before them."""
        deadline: float | None = None
        while len(self.buffer) < size:
            if self.eof:
                self._raise_error()
                raise asyncio.IncompleteReadError(bytes(self.buffer), size)
            if deadline is None:
                deadline = self.loop.time() + seconds
            await self._wait(deadline)
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def wait_readable(self, seconds: float) -> bool:
        """Until there are bytes to read (True) or the connection closed without any (False), at most ``seconds``."""
        if not self.buffer and not self.eof:
            await self._wait(self.loop.time() + seconds)
        return bool(self.buffer)

    def at_eof(self) -> bool:
        return self.eof and not self.buffer

    def lost(self) -> asyncio.Future[None]:
        """Done once the connection is lost, without reading it: a peer that half-closed after its request is still
        there, waiting for the answer."""
        if self._lost is None:
            self._lost = self.loop.create_future()
            if self._gone:
                self._lost.set_result(None)
        return self._lost

    # -- writes -----------------------------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait while the peer is slower than what was written; ``ConnectionResetError`` once it is gone."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection lost")
        if self._paused_writing:
            if self._drained is None or self._drained.done():
                self._drained = self.loop.create_future()
            await self._drained

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def expire(self) -> None:
        self.expired = True
        self.abort()

    def peer(self) -> tuple[str, int] | None:
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    # -- waiting ----------------------------------------------------------------------------------------------------
    def _raise_error(self) -> None:
        if self.error is not None and not self.expired:
            raise self.error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, deadline: float) -> None:
        """Until more bytes come or the connection ends, aborting it at ``deadline``."""
        self._deadline = deadline
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self.loop.call_at(deadline, self._fire), deadline
        if self._paused_reading and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter, self._deadline = None, _NEVER

    def _fire(self) -> None:
        self._timer, self._timer_at = None, _NEVER
        if self._deadline == _NEVER:
            return  # no read is waiting: the next one arms the timer again
        if self.loop.time() >= self._deadline:
            self.expire()
        else:  # armed for an earlier read's deadline: wait on for this one's
            self._timer, self._timer_at = self.loop.call_at(self._deadline, self._fire), self._deadline


class AsyncPool:
    """Kept-alive connections to one origin; used from one event loop. ``epoch``: connections opened before the
    origin's epoch changed (its replica was ejected: they point at a dead or restarted process) are not reused."""

    def __init__(
        self, origin: Origin, timeouts: Timeouts, tls: Callable[[], ssl.SSLContext], *, idle: int = 32
    ) -> None:
        self.origin, self.timeouts, self.tls, self.idle = origin, timeouts, tls, idle
        self._idle: list[Connection] = []

    async def _open(self, epoch: int) -> Connection:
        host, port = self.origin.host, self.origin.port or 0  # http(s) origins always have one
        context = self.tls() if self.origin.scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            transport, stream = await asyncio.wait_for(
                loop.create_connection(lambda: Stream(loop), host, port, ssl=context), self.timeouts.connect
            )
        except (OSError, asyncio.TimeoutError) as exc:
            error = exc if isinstance(exc, OSError) else TimeoutError()
            raise map_exception(error, self.origin.url, self.timeouts, connecting=True) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(stream, epoch)

    async def send(self, epoch: int, head: bytes, body: bytes | None, what: str) -> tuple[Connection, ResponseHead]:
        """Send a request (``head``: its line and headers, ``wire.request_head``) and wait for its answer's head;
        the body is the caller's to read (``Body``), then ``release`` or close the connection. ``what``: the URL
        named in errors."""
        while self._idle:
            conn = self._idle.pop()
            if conn.epoch != epoch or conn.stream.is_closing() or conn.stream.at_eof():
                conn.close()
                continue
            try:
                return conn, await self._exchange(conn, head, body, what)
            except STALE as exc:
                conn.close()
                if conn.expired:
                    raise ResponseTimeoutError(what, f"no answer within {self.timeouts.read:g} s") from exc
                break  # closed by the server while it idled: the request was never seen
            except BaseException:
                conn.close()
                raise
        conn = await self._open(epoch)
        try:
            return conn, await self._exchange(conn, head, body, what)
        except (OSError, asyncio.IncompleteReadError) as exc:
            conn.close()
            if conn.expired:
                raise ResponseTimeoutError(what, f"no answer within {self.timeouts.read:g} s") from exc
            cause = exc if isinstance(exc, OSError) else ConnectionResetError("closed without answering")
            raise map_exception(cause, what, self.timeouts) from exc
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, conn: Connection, head: bytes, body: bytes | None, what: str) -> ResponseHead:
        stream = conn.stream
        stream.write(head + body if body and len(body) < PIECE else head)
        if body and len(body) >= PIECE:
            stream.write(body)
        while True:
            try:
                raw = await stream.read_until(HEAD_END, self.timeouts.read)
            except asyncio.LimitOverrunError as exc:
                conn.close()
                raise ExchangeError(what, f"answer headers over {MAX_HEAD_BYTES} bytes") from exc
            parsed = parse_response_head(raw)
            if isinstance(parsed, str):
                conn.close()
                raise ExchangeError(what, parsed)
            if not 100 <= parsed.status < 200:
                return parsed  # an interim answer (100 Continue) is skipped, as http.client skips it

    def release(self, conn: Connection, head: ResponseHead, body: Body) -> None:
        """``conn`` back to the pool when its answer was read to the end and neither side asked to close."""
        if not body.done or not head.keep_alive or conn.expired or len(self._idle) >= self.idle:
            conn.close()
            return
        conn.reused = True
        self._idle.append(conn)

    def close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
