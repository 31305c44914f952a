"""What every KV tier is: a small interface, its counters, and its up/down state.

A tier maps chunk keys (docs/kv-keys.md) to ``StoredChunk``s. Tiers never raise on a failed read or write: a
broken L2 (a missing mount, a dead Redis, a corrupt file) is a *miss* and a counter, never a failed request. A tier
that cannot be reached is marked down, logs one warning, and is retried after ``retry_s``; the first success marks it
up again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from preheat.core.errors import CorruptChunkError, KVError, MacError
from preheat.kv import chunkfile
from preheat.kv.chunk import StoredChunk

log = logging.getLogger("preheat.kv")

T = TypeVar("T")

EvictHook = Callable[[str, str], None]  # (tier name, key): a chunk left the tier (eviction, corruption, quota)
Encode = Callable[[], "list[bytes | memoryview]"]  # the pieces of a value to store, made only when it is written
Check = Callable[[bytes | bytearray], object]  # accepts a stored value's bytes, or raises CorruptChunkError


@dataclass
class TierStats:
    """Monotonic counters of one tier (rendered as Prometheus metrics by the server)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    stores: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corrupt: int = 0  # chunks that failed any check (the MAC included)
    mac_failures: int = 0  # of those, chunks refused by the keyed MAC (forged, other secret, keyed-ness mismatch)
    errors: int = 0
    refused: int = 0  # values a store would not take: larger than the whole quota (fs://) or than any value may be
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def hit(self, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.hits += 1
            self.bytes_read += nbytes
            self.read_seconds += seconds

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def rejected(self, exc: CorruptChunkError, *, miss: bool = True) -> None:
        """Count a chunk that failed its checks (a MAC failure too when the tag refused it), as a miss if ``miss``."""
        self.add(misses=int(miss), corrupt=1, mac_failures=int(isinstance(exc, MacError)))

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "bytes_read": self.bytes_read,
                "read_seconds": self.read_seconds,
                "stores": self.stores,
                "bytes_written": self.bytes_written,
                "evictions": self.evictions,
                "corrupt": self.corrupt,
                "mac_failures": self.mac_failures,
                "errors": self.errors,
                "refused": self.refused,
            }


class Health:
    """Up/down state of a tier that can fail (a filesystem mount, a Redis server), with a retry interval."""

    def __init__(self, name: str, retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.retry_s = retry_s
        self.clock = clock  # seconds, monotonic; tests pass their own to step past retry_s without sleeping
        self.up = True
        self.reason = ""
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def should_try(self) -> bool:
        """True when the tier is up, or down long enough to try again."""
        return self.up or self.clock() >= self._retry_at

    def down(self, reason: str) -> None:
        with self._lock:
            self._retry_at = self.clock() + self.retry_s
            if self.up:
                log.warning("KV tier %s is down: %s (requests recompute; retrying every %.0f s)", self.name, reason,
                            self.retry_s)
            self.up, self.reason = False, reason

    def ok(self) -> None:
        if self.up:
            return
        with self._lock:
            if not self.up:
                log.warning("KV tier %s is back up", self.name)
            self.up, self.reason = True, ""


class Tier(Protocol):
    """One level of the KV cache."""

    name: str  # "l1" or "l2"
    stats: TierStats

    @property
    def up(self) -> bool: ...

    def describe(self) -> str:
        """Where the tier lives, without credentials (``memory``, ``fs:///shared/kv``, ``redis://host:6379/0``)."""
        ...

    def get(self, key: str) -> StoredChunk | None:
        """The chunk, or None (absent, unreadable, corrupt, tier down); counts a hit or a miss."""
        ...

    def put(self, key: str, chunk: StoredChunk) -> bool:
        """Store ``chunk``; False when it was not stored (too big, tier down, disk full). Never raises."""
        ...

    def keys(self, limit: int) -> list[str]:
        """Up to ``limit`` keys this tier holds, most recently used first (for router snapshots)."""
        ...

    def entries(self, limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` (key, stored bytes), most recently used first (the warm-up order)."""
        ...

    def close(self) -> None: ...


class Storage(Protocol):
    """The storage path ``FileTier`` and ``RedisTier`` share (``kv/fs.py``, ``kv/redis_tier.py``): self-checking
    values under file- and Redis-safe names. ``decode``/``check`` raise ``CorruptChunkError`` for bytes
    they refuse, which the storage counts and removes."""

    stats: TierStats
    expect: chunkfile.AnyExpect

    @property
    def up(self) -> bool: ...

    def describe(self) -> str: ...

    def read(self, name: str, decode: Callable[[bytes | bytearray], T]) -> T | None: ...

    def read_many(
        self, names: Sequence[str], decodes: Sequence[Callable[[bytes | bytearray], T]]
    ) -> list[T | None]: ...

    def write(self, name: str, encode: Encode, check: Check) -> bool: ...

    def write_many(self, items: Sequence[tuple[str, Encode, Check]]) -> list[bool]: ...

    def describe_namespace(self, description: bytes) -> None: ...

    def contains(self, name: str) -> bool: ...

    def contains_many(self, names: Sequence[str]) -> list[bool]: ...

    def remove(self, name: str) -> bool: ...

    def entries(self, limit: int) -> list[tuple[str, int]]: ...

    def head(self, name: str, nbytes: int) -> bytes | None: ...

    def close(self) -> None: ...


class SharedTier(Tier, Storage, Protocol):
    """A shared L2 (``FileTier``, ``RedisTier``; opened by URL in ``kv/backends.py``): the reference engine's chunks
    as a ``Tier`` and any engine's values as a blob store's ``Storage``, through the same path."""


def chunk_expect(expect: chunkfile.AnyExpect) -> chunkfile.Expect:
    """``expect`` of a tier holding the reference engine's chunks; ``KVError`` for a tier opened for opaque values
    (a programming error: ``get``/``put`` of chunks on a blob store's storage)."""
    if not isinstance(expect, chunkfile.Expect):
        raise KVError(f"this tier holds opaque values of namespace {expect.fingerprint}, not KV chunks")
    return expect
