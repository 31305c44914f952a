"""Transfer counters for remote sources: requests sent, body bytes received, retries.

Every origin owns a ``TransferStats``; each one also adds into the process-wide ``TOTALS``, so a benchmark or the
cache can count what a ``preheat.load("http://...")`` moved without reaching into the loader:

>>> before = TOTALS.snapshot()                                          # doctest: +SKIP
>>> weights = preheat.load("http://127.0.0.1:8000/model")              # doctest: +SKIP
>>> (TOTALS.snapshot() - before).bytes                                  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferCounts:
    """A snapshot of counters. ``bytes`` counts every body byte received, including bytes that were read only to be
    skipped (``skipped``: a server that ignores Range makes the client read past what it wants)."""

    requests: int = 0
    bytes: int = 0
    skipped: int = 0
    retries: int = 0

    def __sub__(self, other: TransferCounts) -> TransferCounts:
        return TransferCounts(
            self.requests - other.requests,
            self.bytes - other.bytes,
            self.skipped - other.skipped,
            self.retries - other.retries,
        )


class TransferStats:
    """Thread-safe counters, optionally also adding into a ``parent`` (the process-wide ``TOTALS``)."""

    def __init__(self, parent: TransferStats | None = None) -> None:
        self._parent = parent
        self._lock = threading.Lock()
        self._requests = self._bytes = self._skipped = self._retries = 0

    def add(self, *, requests: int = 0, nbytes: int = 0, skipped: int = 0, retries: int = 0) -> None:
        with self._lock:
            self._requests += requests
            self._bytes += nbytes
            self._skipped += skipped
            self._retries += retries
        if self._parent is not None:
            self._parent.add(requests=requests, nbytes=nbytes, skipped=skipped, retries=retries)

    def snapshot(self) -> TransferCounts:
        with self._lock:
            return TransferCounts(self._requests, self._bytes, self._skipped, self._retries)


TOTALS = TransferStats()
"""Everything every remote source in this process has transferred."""
