"""What the network sources share: ``RemoteFile`` (cached size, ``readv`` as retried attempts) and ``Cursor``.

A subclass says how to learn the size (``_probe_size``) and how one attempt fetches the missing bytes of a read
(``_attempt``); the retry loop, resumption and byte accounting live here once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from preheat.sources.net import NetSettings, retrying
from preheat.sources.stats import TransferStats


class Cursor:
    """The buffers of one ``readv`` seen as one run of bytes (clamped to ``limit``), and how much of it is filled.

    The network sources keep it across retries, so a retry asks only for the bytes still missing and writes them
    exactly where they belong. Empty buffers are skipped; views of any format are filled as raw bytes.
    """

    def __init__(self, buffers: Sequence[memoryview], limit: int) -> None:
        self._views: list[memoryview] = []
        total = 0
        for buffer in buffers:
            if total >= limit:
                break
            view = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
            take = min(len(view), limit - total)
            if take > 0:
                self._views.append(view[:take])
                total += take
        self.total = total
        self.done = 0
        self._index = 0
        self._within = 0

    @property
    def remaining(self) -> int:
        return self.total - self.done

    def next_view(self, at_most: int) -> memoryview:
        """The next unfilled stretch of one buffer, at most ``at_most`` bytes (never empty while bytes remain)."""
        view = self._views[self._index]
        return view[self._within : self._within + min(at_most, len(view) - self._within)]

    def advance(self, n: int) -> None:
        """Record that ``n`` bytes were written into the view ``next_view`` returned."""
        self.done += n
        self._within += n
        while self._index < len(self._views) and self._within >= len(self._views[self._index]):
            self._within -= len(self._views[self._index])
            self._index += 1


class RemoteFile:
    """A ``Source`` over the network. Thread-safe: the size is probed once, reads run in the callers' threads.

    ``verbs`` names the size probe and the read in messages (``("HEAD", "GET")``, ``("HeadObject", "GetObject")``).
    """

    verbs = ("HEAD", "GET")

    def __init__(self, url: str, *, settings: NetSettings, stats: TransferStats) -> None:
        self._url = url
        self._settings = settings
        self._stats = stats
        self._size: int | None = None
        self._size_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._url

    def size(self) -> int:
        with self._size_lock:
            if self._size is None:
                what = f"{self.verbs[0]} {self._url}"
                self._size = retrying(self._probe_size, settings=self._settings, what=what, stats=self._stats)
            return self._size

    def readv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        size = self.size()
        cursor = Cursor(buffers, max(0, size - offset))
        if cursor.total == 0:
            return 0
        retrying(
            lambda: self._attempt(offset, cursor, size),
            settings=self._settings,
            what=f"{self.verbs[1]} {self._url} bytes {offset}-{offset + cursor.total - 1}",
            stats=self._stats,
            progress=lambda: cursor.done,
        )
        return cursor.total

    def close(self) -> None:
        """Nothing to release by default: connections belong to the origin."""

    def _probe_size(self) -> int:
        """One attempt at learning the size; raise ``TransientError`` for failures worth retrying."""
        raise NotImplementedError

    def _attempt(self, offset: int, cursor: Cursor, size: int) -> None:
        """One attempt at fetching bytes ``offset + cursor.done`` .. ``offset + cursor.total - 1`` into ``cursor``,
        advancing it as bytes land; raise ``TransientError`` for failures worth retrying."""
        raise NotImplementedError
