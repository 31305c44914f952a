"""``TieredKV.close`` at shutdown: what is queued reaches a healthy L2, and an L2 whose write hangs (a Redis that
accepts the write and never finishes answering) costs the shutdown its deadline, not forever; the chunks still
queued are dropped and counted."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchunks import CHUNK_TOKENS, FP, chunk, expect, exported, key, same
from preheat.kv.events import EventLog
from preheat.kv.fs import FileTier
from preheat.kv.redis_tier import RedisTier
from preheat.kv.tiered import TieredKV
from routing import wait_until

# What redis-py says on connecting (RESP3's HELLO, CLIENT SETINFO, ...) and PING are answered as Redis would.
HELLO = (b"%7\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.0.0\r\n$5\r\nproto\r\n:3\r\n"
         b"$2\r\nid\r\n:1\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n$4\r\nrole\r\n$6\r\nmaster\r\n"
         b"$7\r\nmodules\r\n*0\r\n")  # fmt: skip
ANSWERS = {b"HELLO": HELLO, b"PING": b"+PONG\r\n", b"CLIENT": b"+OK\r\n", b"SELECT": b"+OK\r\n"}


def commands(buffer: bytearray) -> list[bytes]:
    """The names of the complete commands (RESP arrays of bulk strings) at the front of ``buffer``, taken off it."""
    names: list[bytes] = []
    while True:
        lines = bytes(buffer).split(b"\r\n")
        if len(lines) < 3 or not lines[0].startswith(b"*"):
            return names
        count, used, parts = int(lines[0][1:]), len(lines[0]) + 2, []
        for i in range(count):
            if 2 * i + 2 >= len(lines):
                return names  # not all here yet
            parts.append(lines[2 * i + 2])
            used += len(lines[2 * i + 1]) + len(lines[2 * i + 2]) + 4
        del buffer[:used]
        names.append(parts[0].upper())


class HungRedis:
    """A Redis-protocol server on 127.0.0.1 that answers the connection's handshake and PING, then answers any other
    command one byte at a time, forever, never ending the line: every read of the client's gets a byte before its
    timeout, so the command never completes. ``writes`` counts the commands it is hanging on."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.writes = 0
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by close()
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray()
        with conn:
            conn.settimeout(0.1)
            while not self.stop.is_set():
                try:
                    data = conn.recv(1 << 20)
                except TimeoutError:
                    continue
                if not data:
                    return
                buffer += data
                for name in commands(buffer):
                    if name in ANSWERS:
                        conn.sendall(ANSWERS[name])
                        continue
                    self.writes += 1
                    self._hang(conn)
                    return

    def _hang(self, conn: socket.socket) -> None:
        conn.sendall(b"+")
        while not self.stop.wait(0.2):  # well within the client's 1 s socket timeout
            try:
                conn.sendall(b"O")
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self._threads[0].join(timeout=5)  # the acceptor first: it stops within its 0.1 s timeout
        self.listener.close()
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture
def hung_redis() -> Iterator[HungRedis]:
    server = HungRedis()
    yield server
    server.close()


def tiers_over(l2: RedisTier | FileTier, queue_size: int) -> TieredKV:
    return TieredKV(fingerprint=FP, chunk_tokens=CHUNK_TOKENS, events=EventLog(), l2=l2, queue_size=queue_size)


def test_close_returns_at_its_deadline_when_an_l2_write_hangs(hung_redis: HungRedis) -> None:
    tiers = tiers_over(RedisTier(hung_redis.url, expect()), queue_size=2)
    tiers.store(key(0), exported(0))
    wait_until(lambda: hung_redis.writes == 1, "the L2 writer to be stuck in its first write")
    for i in range(1, 4):  # two fill the queue behind the stuck write, the third finds it full
        tiers.store(key(i), exported(i))
    closing = threading.Thread(target=tiers.close, kwargs={"deadline_s": 0.5}, daemon=True)
    closing.start()
    closing.join(timeout=60)  # forever, before: close waited for room in the queue behind the hung write
    assert not closing.is_alive()
    assert tiers.dropped == 3  # one when the queue was full, two still queued at the deadline
    assert hung_redis.writes == 1  # nothing else reached L2


def test_close_writes_what_is_queued_to_a_healthy_l2(tmp_path: Path) -> None:
    tiers = tiers_over(FileTier(str(tmp_path), expect()), queue_size=8)
    for i in range(4):
        tiers.store(key(i), exported(i))
    tiers.close()
    reopened = FileTier(str(tmp_path), expect())
    found = [reopened.get(key(i)) for i in range(4)]
    assert tiers.dropped == 0
    assert all(got is not None and same(got, chunk(i)) for i, got in enumerate(found))
