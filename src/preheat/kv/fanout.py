"""Spreading one batch of the blob store's file reads or writes (``kv/store.py``) over a few threads.

An engine hands the store a batch at a time (SGLang HiCache's prefetch reads up to 128 pages per ``batch_get``, its
backup writes as many per ``batch_set``). Each value's work is a copy between the page cache and the engine's
memory plus the XXH3-128 pass over it (``kv/fileio.py``), and both run without the GIL (``os.preadv``/``pwrite``
and ``xxhash`` release it), so the values of a batch are split over ``threads`` threads: each value is still read
or written and hashed by one thread, while it is in that core's cache, and the batch takes the time of its share.

Why not for a small batch: handing work to another thread and waking it costs ~50 us on a VM (measured here: a 1
MiB read split over two threads took 86 us against 39 us on one), so a batch of fewer than ``MIN_BYTES`` stays on
the calling thread. One value is never split: its checksum is one sequential pass.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from preheat.core.errors import ConfigError
from preheat.io.tuning import cpu_cores

A = TypeVar("A")
R = TypeVar("R")

MIN_BYTES = 2 << 20  # a batch smaller than this is not worth waking another thread for
DEFAULT_THREADS = min(4, cpu_cores())  # at most 4: the engine's own threads want cores too


def check_threads(threads: int) -> int:
    """``threads`` when it is a usable ``io_threads`` setting; ``ConfigError`` naming that key when it is below 1.
    The one check: ``FanOut`` makes it for every store (``open_store``, ``BlobStore``), an engine's store settings
    when they are read (``integrations/store_settings.py``)."""
    if threads < 1:
        raise ConfigError(f"io_threads must be at least 1, not {threads}")
    return threads


class FanOut:
    """``map(one, items, nbytes)``: ``one`` of every item, in order, on up to ``threads`` threads (the calling
    thread is one of them). The store's per-value calls turn every failure into a miss or a False; should ``one``
    raise all the same, ``map`` raises the first exception only once every share has finished. The items must not
    share buffers: two threads may work on two items at once. Threads are started on first use and kept; ``close``
    lets them go."""

    def __init__(self, threads: int = DEFAULT_THREADS, *, min_bytes: int = MIN_BYTES) -> None:
        self.threads = check_threads(threads)
        self.min_bytes = min_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def map(self, one: Callable[[A], R], items: Sequence[A], nbytes: int) -> list[R]:
        n = min(self.threads, len(items))
        if n < 2 or nbytes < self.min_bytes:
            return [one(item) for item in items]
        pool = self._executor()
        shares = [range(i, len(items), n) for i in range(n)]  # interleaved: a batch of like values splits evenly
        futures: list[Future[list[R]]] = []
        mine: list[R] = []
        try:
            futures.extend(pool.submit(_run, one, items, share) for share in shares[1:])
            mine = _run(one, items, shares[0])
        finally:
            wait(futures)  # every share has finished, or failed, before map returns or raises: no thread is left
            # writing into the caller's buffers (an engine reuses them after a miss)
        done = [future.result() for future in futures]  # the first share's exception, if one failed
        out: list[R] = [None] * len(items)  # type: ignore[list-item]  # every slot is filled below
        for share, results in zip(shares, [mine, *done], strict=True):
            for i, result in zip(share, results, strict=True):
                out[i] = result
        return out

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():  # a forked child has none of its parent's threads
                self._pool, self._pid = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="preheat-kv-io"), \
                    os.getpid()
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _run(one: Callable[[A], R], items: Sequence[A], share: range) -> list[R]:
    return [one(items[i]) for i in share]
