"""What the network sources share: ``RemoteFile`` (cached size, ``readv`` as retried attempts, a pinned version) and
``Cursor``.

A subclass says how to learn the size (``_probe_size``, which also records the version it saw in ``_seen``) and how
one attempt fetches the missing bytes of a read (``_attempt``, which makes its request conditional on ``_pinned``);
the retry loop, resumption, byte accounting and ``validator()``/``require()`` live here once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from preheat.core.errors import SourceChangedError
from preheat.sources.base import Validator
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

    ``verbs`` names the size probe and the read in messages (``("HEAD", "GET")``, ``("HeadObject", "GetObject")``);
    ``changed`` says in messages that the file is now another version (``"changed on the server"``, ``"was replaced"``).
    """

    verbs = ("HEAD", "GET")
    changed = "changed on the server"

    def __init__(self, url: str, *, settings: NetSettings, stats: TransferStats) -> None:
        self._url = url
        self._settings = settings
        self._stats = stats
        self._size: int | None = None
        self._size_lock = threading.Lock()
        self._seen: Validator | None = None  # set by the size probe
        self._pinned: Validator | None = None  # set by ``require``; ``_attempt`` makes each read conditional on it

    @property
    def name(self) -> str:
        return self._url

    def size(self) -> int:
        with self._size_lock:
            if self._size is None:
                what = f"{self.verbs[0]} {self._url}"
                self._size = retrying(self._probe_size, settings=self._settings, what=what, stats=self._stats)
            return self._size

    def validator(self) -> Validator:
        """The file's size and version (strong ETag, Last-Modified) as the size probe saw them."""
        size = self.size()
        return self._seen if self._seen is not None else Validator(size)

    def require(self, pinned: Validator) -> None:
        """Read only version ``pinned``: ``SourceChangedError`` now if the origin names another one, and later when
        a conditional read is refused (412) or answered for another version."""
        seen = self.validator()
        if seen != pinned:
            raise SourceChangedError(f"{self._url} {self.changed}: it is now {seen}, was {pinned}")
        self._pinned = pinned

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
