"""L1: chunks in this process's host memory, least recently used out first.

Capacity is a byte budget (``--kv-l1 8GiB`` or ``--kv-l1 20%`` of RAM). On a CUDA engine the chunks are in pinned
memory (``store_form(pin=True)``), so a hit is copied back to the device at full PCIe speed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from preheat.kv.chunk import StoredChunk
from preheat.kv.tier import EvictHook, TierStats


class MemoryTier:
    """An LRU of ``StoredChunk``s bounded by ``capacity`` bytes. Thread-safe."""

    name = "l1"

    def __init__(self, capacity: int, on_evict: EvictHook | None = None) -> None:
        self.capacity = capacity
        self.stats = TierStats()
        self.used = 0
        self._chunks: OrderedDict[str, StoredChunk] = OrderedDict()
        self._lock = threading.Lock()
        self._on_evict = on_evict

    @property
    def up(self) -> bool:
        return True

    def describe(self) -> str:
        return "memory"

    def get(self, key: str) -> StoredChunk | None:
        start = time.perf_counter()
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self._chunks.move_to_end(key)
        if chunk is None:
            self.stats.add(misses=1)
            return None
        self.stats.hit(chunk.nbytes, time.perf_counter() - start)
        return chunk

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._chunks

    def put(self, key: str, chunk: StoredChunk) -> bool:
        size = chunk.nbytes
        if size > self.capacity:
            return False
        evicted: list[str] = []
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self.used -= old.nbytes
            while self.used + size > self.capacity and self._chunks:
                victim, dropped = self._chunks.popitem(last=False)
                self.used -= dropped.nbytes
                evicted.append(victim)
            self._chunks[key] = chunk
            self.used += size
        self.stats.add(stores=1, bytes_written=size, evictions=len(evicted))
        if self._on_evict is not None:
            for victim in evicted:
                self._on_evict(self.name, victim)
        return True

    def keys(self, limit: int) -> list[str]:
        with self._lock:
            return list(reversed(self._chunks))[:limit]

    def entries(self, limit: int) -> list[tuple[str, int]]:
        with self._lock:
            return [(key, self._chunks[key].nbytes) for key in reversed(self._chunks)][:limit]

    def __len__(self) -> int:
        return len(self._chunks)

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
            self.used = 0
