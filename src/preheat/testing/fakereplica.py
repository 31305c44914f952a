"""A fast fake OpenAI replica for router tests and benchmarks: thousands of concurrent streams on one event loop.

``/health`` answers ``{"status": "ok"}``; ``POST /v1/completions`` with ``"stream": true`` answers ``tokens``
server-sent events (``data: {"id": ID, "i": K}``, one chunk each, ``gap`` seconds apart) and ``data: [DONE]``,
where ``ID`` is the request body's ``user``, so a client can check that every token of its own stream came, in order;
without ``stream`` a plain completion. It runs its loop on a daemon thread (``start``/``stop``, or ``with``).

    with FakeReplica(gap=0.01) as replica:
        ...  # replica.url
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from types import TracebackType

from preheat.core.jsonsafe import loads_bounded
from preheat.http.wire import RequestHead, chunk, parse_request_head, response_head

TOKENS = 16


class FakeReplica:
    """See the module docstring. ``streams``: how many streams it has begun, since the start."""

    def __init__(self, *, gap: float = 0.0, host: str = "127.0.0.1") -> None:
        self.gap = gap
        self.sock = socket.create_server((host, 0), backlog=4096)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.streams = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="fake-replica", daemon=True)
        self._ready = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve_start())
        self._ready.set()
        self._loop.run_forever()

    async def _serve_start(self) -> None:
        self._server = await asyncio.start_server(self._client, sock=self.sock, backlog=4096)  # not asyncio's 100

    def start(self) -> FakeReplica:
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self) -> None:
        """Stop listening, cut every connection and close the loop (no socket outlives it)."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close_all(), self._loop)
            self._thread.join(timeout=10)
            self._loop.close()

    async def _close_all(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        # Each connection's task ends before the loop does (a task left pending is an asyncio warning at exit).
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.stop()

    def __enter__(self) -> FakeReplica:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                while True:
                    head = parse_request_head(await reader.readuntil(b"\r\n\r\n"))
                    if not isinstance(head, RequestHead):
                        return
                    length = int(head.headers.get("Content-Length") or 0)
                    body = await reader.readexactly(length) if length else b""
                    await self._answer(head, body, writer)
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _answer(self, head: RequestHead, body: bytes, writer: asyncio.StreamWriter) -> None:
        if head.path == "/health":
            data = b'{"status": "ok"}'
            writer.write(response_head(200, [("Content-Type", "application/json"),
                                             ("Content-Length", str(len(data)))], "fake") + data)  # fmt: skip
            await writer.drain()
            return
        request = loads_bounded(body, max_bytes=1 << 20) if body else {}
        assert isinstance(request, dict)
        ident, tokens = request.get("user", ""), int(request.get("max_tokens", TOKENS))
        if not request.get("stream"):
            data = json.dumps({"id": ident, "choices": [{"text": "x" * tokens}]}).encode()
            writer.write(response_head(200, [("Content-Type", "application/json"),
                                             ("Content-Length", str(len(data)))], "fake") + data)  # fmt: skip
            await writer.drain()
            return
        self.streams += 1
        writer.write(response_head(200, [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked")],
                                   "fake"))  # fmt: skip
        for i in range(tokens):
            writer.write(chunk(b"data: " + json.dumps({"id": ident, "i": i}).encode() + b"\n\n"))
            await writer.drain()
            if self.gap:
                await asyncio.sleep(self.gap)
        writer.write(chunk(b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()
