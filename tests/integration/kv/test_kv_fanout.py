"""A batch of the blob store's file reads and writes spread over threads (``kv/fanout.py``), and the disk reserved
before a value is written (``fileio.preallocate``): same bytes, same misses, every value in its place."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstorekit import NS, counters, damage, stored_path, value
from preheat.core.errors import ConfigError
from preheat.integrations.store_settings import StoreSettings
from preheat.kv import chunkfile, fanout
from preheat.kv.fileio import preallocate
from preheat.kv.store import open_store

BIG = 512 << 10  # eight of these make a batch worth spreading (fanout.MIN_BYTES)


def test_a_large_batch_runs_on_several_threads_in_order() -> None:
    pool = fanout.FanOut(3, min_bytes=100)
    seen: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> int:
        with lock:
            seen.append(threading.get_ident())
        return i * i

    assert pool.map(one, list(range(10)), nbytes=1000) == [i * i for i in range(10)]
    assert len(set(seen)) >= 2  # the caller's thread and the pool's (a fast share may leave one pool thread both)
    assert threading.get_ident() in seen
    pool.close()


def test_a_small_batch_stays_on_the_calling_thread() -> None:
    pool = fanout.FanOut(4, min_bytes=100)
    seen: set[int] = set()

    def one(i: int) -> int:
        seen.add(threading.get_ident())
        return i

    assert pool.map(one, [1, 2, 3], nbytes=99) == [1, 2, 3]
    assert seen == {threading.get_ident()}
    assert pool.map(lambda i: i, [7], nbytes=10**9) == [7]  # one value is never split
    assert pool._pool is None  # no thread was started
    with pytest.raises(ConfigError, match="io_threads must be at least 1"):
        fanout.FanOut(0)


def test_an_error_waits_for_every_share_before_it_is_raised() -> None:
    pool = fanout.FanOut(2, min_bytes=0)
    finished: list[int] = []

    def one(i: int) -> int:
        if i == 0:
            raise RuntimeError("boom")  # the caller's own share fails first
        threading.Event().wait(0.05)
        finished.append(i)
        return i

    with pytest.raises(RuntimeError, match="boom"):
        pool.map(one, [0, 1, 2, 3], nbytes=1)
    assert sorted(finished) == [1, 3]  # the other thread's share had finished when map raised
    pool.close()


def test_a_failing_share_of_another_thread_waits_for_every_other_share() -> None:
    pool = fanout.FanOut(4, min_bytes=0)
    finished: list[int] = []

    def one(i: int) -> int:
        if i == 1:  # the first pool thread's share fails at once
            raise RuntimeError("boom")
        threading.Event().wait(0.2 if i in (2, 3) else 0)  # the other pool threads' shares are still running
        finished.append(i)
        return i

    with pytest.raises(RuntimeError, match="boom"):
        pool.map(one, [0, 1, 2, 3], nbytes=1)
    assert sorted(finished) == [0, 2, 3]  # when map raised, nothing was left running
    pool.close()


def test_a_batch_read_over_threads_lands_each_value_in_its_own_buffer(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS, io_threads=2)
    items = [(f"page-{i}", value(i, BIG)) for i in range(8)]
    assert store.put_many(items) == [True] * 8  # written over two threads too
    buffers = [bytearray(BIG) for _ in items]
    threads: set[int] = set()

    def allocate(buffer: bytearray) -> Callable[[int, bytes], memoryview]:
        def give(n: int, peek: bytes) -> memoryview:
            threads.add(threading.get_ident())
            return memoryview(buffer)
        return give

    damage(store, "page-5", "flip")
    got = store.get_into_many([(key, allocate(b)) for (key, _), b in zip(items, buffers, strict=True)],
                              peek=False, nbytes=8 * BIG)
    assert got == [BIG] * 5 + [None] + [BIG] * 2  # the damaged value alone is a miss
    assert [bytes(b) for i, b in enumerate(buffers) if i != 5] == [v for i, (_, v) in enumerate(items) if i != 5]
    assert len(threads) == 2
    assert counters(store)["corrupt"] == 1
    assert not stored_path(store, "page-5").exists()  # removed, as on one thread
    many = store.get_many([key for key, _ in items])  # sized from the values read so far: spread as well
    assert [bytes(v) if v is not None else None for v in many] == [v for _, v in items[:5]] + [None] + [
        v for _, v in items[6:]]
    store.close()


def test_a_batch_write_over_threads_keeps_the_quota(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS, io_threads=3, max_bytes=4 * BIG)
    assert all(store.put_many([(f"k{i}", value(i, BIG)) for i in range(12)]))
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kvc")) <= 4 * BIG + 4 * 4096
    assert counters(store)["evictions"] >= 6
    assert counters(store)["stores"] == 12
    store.close()


def test_a_stored_file_is_as_long_as_its_bytes(tmp_path: Path) -> None:
    store = open_store(f"fs://{tmp_path}", NS)
    assert store.put("k", value(1, BIG + 123))
    path = stored_path(store, "k")
    head = chunkfile.blob_frame_for("k", NS.id, BIG + 123, keyed=False).offset
    assert path.stat().st_size == head + BIG + 123  # reserved blocks past the value are not part of the file
    assert bytes(store.get("k") or b"") == value(1, BIG + 123)
    with open(tmp_path / "f", "wb") as handle:
        preallocate(handle.fileno(), 1 << 20)  # reserved, not written: the size stays 0
        assert os.fstat(handle.fileno()).st_size == 0
    read, write = os.pipe()
    try:
        preallocate(write, 1 << 20)  # a descriptor that cannot be preallocated: nothing happens
    finally:
        os.close(read)
        os.close(write)


def test_io_threads_is_a_store_setting() -> None:
    settings = StoreSettings.from_mapping({"url": "fs:///kv", "io_threads": "3"}, where="test")
    assert settings.io_threads == 3
    assert StoreSettings.from_mapping({"url": "fs:///kv"}, where="test").io_threads == fanout.DEFAULT_THREADS
    with pytest.raises(ConfigError, match="test: io_threads must be at least 1, not 0"):
        StoreSettings.from_mapping({"url": "fs:///kv", "io_threads": 0}, where="test")
    with pytest.raises(ConfigError, match="test"):
        StoreSettings.from_mapping({"url": "fs:///kv", "io_threads": "many"}, where="test")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_process_pinned_to_one_core_spreads_no_batch() -> None:
    # A container's cpuset narrows the affinity, not os.cpu_count(): the default follows the cores it may run on.
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from preheat.kv import fanout; print(fanout.DEFAULT_THREADS)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "1"


def test_a_store_opened_with_no_io_threads_is_refused_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="io_threads must be at least 1, not 0"):
        open_store(f"fs://{tmp_path}", NS, io_threads=0)


def test_a_forked_child_spreads_its_batches_on_threads_of_its_own() -> None:
    pool = fanout.FanOut(2, min_bytes=0)
    assert pool.map(abs, [-1, -2, -3], nbytes=1) == [1, 2, 3]  # the parent's pool thread is running
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its copy of the pool has no threads; a batch must not wait for them forever
        try:
            os.write(write, b"ok" if pool.map(abs, [-4, -5], nbytes=1) == [4, 5] else b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = os.read(read, 2) if select.select([read], [], [], 20)[0] else b"hung"
    finally:
        os.close(read)
        if got == b"hung":
            os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert got == b"ok"
    pool.close()
