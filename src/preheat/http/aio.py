"""HTTP/1.1 over asyncio streams: an answer's head and body read from a kept-alive connection, and a pool of such
connections per origin. The event-loop twin of ``http.pool`` (the threaded one): the same rules, one loop thread.

A request takes an idle connection (the most recently used first) or opens one (TCP_NODELAY; TLS with
``tls.client_context()``), and its connection goes back only once the answer was read to its end and neither side
asked to close. A kept-alive connection the server closed while it sat idle fails before any answer; ``AsyncPool.send``
resends such a request once on a fresh connection (the server never saw it). Failures are the ``HTTPClientError``
family, mapped by ``client.map_exception``: ``ConnectError`` (nothing sent), ``ResponseTimeoutError``,
``ExchangeError``.

Timeouts are timers that abort the transport (``Connection.expire``), not a task per read: a read waiting on an
aborted transport fails at once, and the connection knows it was the timer.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable

from preheat.core.errors import ExchangeError, ResponseTimeoutError
from preheat.http.client import Origin, Timeouts, map_exception
from preheat.http.wire import HEAD_END, MAX_HEAD_BYTES, ResponseHead, parse_chunk_size, parse_response_head

PIECE = 65536  # the most read at once: a huge body or chunk is relayed in pieces, never held whole
# What a request on a connection the server closed while it was idle fails with: safe to resend on a fresh one.
STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, asyncio.IncompleteReadError)


class Connection:
    """One kept-alive connection: its streams, and whether a timer cut it (``expired``)."""

    __slots__ = ("epoch", "expired", "reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, epoch: int) -> None:
        self.reader, self.writer, self.epoch = reader, writer, epoch
        self.expired = False
        self.reused = False

    def expire(self) -> None:
        self.expired = True
        self.writer.transport.abort()

    def close(self) -> None:
        self.writer.transport.abort()  # no graceful close: an unread answer must stop being generated now

    async def timed(self, seconds: float, read: Callable[[], Awaitable[bytes]]) -> bytes:
        """``await read()`` within ``seconds`` (the connection aborted past them: ``expired``)."""
        timer = asyncio.get_running_loop().call_later(seconds, self.expire)
        try:
            return await read()
        finally:
            timer.cancel()


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
        reader, timed = self.conn.reader, self.conn.timed
        if self.chunked:
            if not self.in_chunk:
                line = await timed(self.read_timeout, lambda: reader.readuntil(b"\n"))
                size = parse_chunk_size(line)
                if size is None:
                    raise ConnectionAbortedError(f"bad chunk size line {line[:40]!r}")
                if size == 0:
                    while (await timed(self.read_timeout, lambda: reader.readuntil(b"\n"))).strip():
                        pass  # trailers: read, not relayed
                    self.done = True
                    return b""
                self.in_chunk = size
            data = await timed(self.read_timeout, lambda: reader.read(min(self.in_chunk, PIECE)))
            if not data:
                raise asyncio.IncompleteReadError(b"", self.in_chunk)
            self.in_chunk -= len(data)
            if not self.in_chunk:
                await timed(self.read_timeout, lambda: reader.readexactly(2))
            return data
        if self.left is None:
            data = await timed(self.read_timeout, lambda: reader.read(PIECE))
            self.done = not data
            return data
        data = await timed(self.read_timeout, lambda: reader.read(min(self.left or 0, PIECE)))
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


async def read_head(reader: asyncio.StreamReader) -> bytes:
    """A message's line and headers up to the blank line. Raises ``asyncio.LimitOverrunError`` past the reader's
    limit (``MAX_HEAD_BYTES`` for the streams made here) and ``asyncio.IncompleteReadError`` at a close."""
    return await reader.readuntil(HEAD_END)


class AsyncPool:
    """Kept-alive connections to one origin; used from one event loop. ``epoch``: connections opened before the
    origin's epoch changed (its replica was ejected: they point at a dead or restarted process) are not reused."""

    def __init__(
        self, origin: Origin, timeouts: Timeouts, tls: Callable[[], ssl.SSLContext], *, idle: int = 32
    ) -> None:
        self.origin, self.timeouts, self.tls, self.idle = origin, timeouts, tls, idle
        self._idle: list[Connection] = []

    async def _open(self, epoch: int) -> Connection:
        host, port = self.origin.host, self.origin.port
        context = self.tls() if self.origin.scheme == "https" else None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=context, limit=MAX_HEAD_BYTES), self.timeouts.connect
            )
        except (OSError, asyncio.TimeoutError) as exc:
            error = exc if isinstance(exc, OSError) else TimeoutError()
            raise map_exception(error, self.origin.url, self.timeouts, connecting=True) from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(reader, writer, epoch)

    async def send(self, epoch: int, head: bytes, body: bytes | None, what: str) -> tuple[Connection, ResponseHead]:
        """Send a request (``head``: its line and headers, ``wire.request_head``) and wait for its answer's head;
        the body is the caller's to read (``Body``), then ``release`` or close the connection. ``what``: the URL
        named in errors."""
        while self._idle:
            conn = self._idle.pop()
            if conn.epoch != epoch or conn.writer.transport.is_closing() or conn.reader.at_eof():
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
        conn.writer.write(head + body if body and len(body) < PIECE else head)
        if body and len(body) >= PIECE:
            conn.writer.write(body)
        while True:
            try:
                raw = await conn.timed(self.timeouts.read, lambda: read_head(conn.reader))
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
