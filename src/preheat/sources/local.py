"""Local, NFS and Lustre paths: the kernel does the work, ``preadv`` releases the GIL."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from preheat.core.errors import SourceChangedError, SourceError
from preheat.sources.base import READ_BYTES_LIMIT, Validator, check_name, too_large


class LocalFile:
    """A file opened read-only; ``readv`` is one ``preadv`` (thread-safe: no shared file position)."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        self._path = path
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise SourceError(f"{path}: cannot open: {exc.strerror}") from None
        self._fd: int | None = fd
        self._pinned: Validator | None = None

    @classmethod
    def from_fd(cls, path: str, fd: int) -> LocalFile:
        """Wrap a descriptor opened elsewhere (e.g. with O_DIRECT); closing the source closes it."""
        return cls(path, fd)

    @property
    def name(self) -> str:
        return self._path

    def size(self) -> int:
        return os.fstat(self._require()).st_size

    def readv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        # OSError propagates: the reader turns it into a CheckpointError naming the file and offset.
        n = os.preadv(self._require(), list(buffers), offset)
        if self._pinned is not None and self.validator() != self._pinned:  # written in place while we read it
            raise SourceChangedError(f"{self._path} changed while it was read: it is now {self.validator()}")
        return n

    def validator(self) -> Validator:
        """Size, ``st_mtime_ns`` and inode of the open file."""
        info = os.fstat(self._require())
        return Validator(info.st_size, modified=str(info.st_mtime_ns), inode=info.st_ino)

    def require(self, pinned: Validator) -> None:
        """Read only version ``pinned``: ``SourceChangedError`` now or after any read that finds the file changed."""
        seen = self.validator()
        if seen != pinned:
            raise SourceChangedError(f"{self._path} changed: it is now {seen}, was {pinned}")
        self._pinned = pinned

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _require(self) -> int:
        if self._fd is None:
            raise SourceError(f"{self._path}: already closed")
        return self._fd


class LocalOrigin:
    """A directory on a local or mounted filesystem."""

    def __init__(self, root: str) -> None:
        self._root = root

    @property
    def uri(self) -> str:
        return self._root

    def join(self, name: str) -> str:
        return os.path.join(self._root, check_name(name))

    def exists(self, name: str) -> bool:
        return os.path.isfile(self.join(name))

    def read_bytes(self, name: str) -> bytes:
        """The whole of regular file ``name``, at most ``READ_BYTES_LIMIT`` bytes (``SourceError`` otherwise)."""
        path = self.join(name)
        try:
            # O_NONBLOCK: opening a FIFO planted under this name would otherwise wait for a writer forever.
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as handle:
                info = os.fstat(handle.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise SourceError(f"{path}: not a regular file")
                if info.st_size > READ_BYTES_LIMIT:
                    raise too_large(path, info.st_size, READ_BYTES_LIMIT)
                data = handle.read(READ_BYTES_LIMIT + 1)
        except OSError as exc:
            raise SourceError(f"{path}: cannot read: {exc.strerror}") from None
        if len(data) > READ_BYTES_LIMIT:  # it grew while being read
            raise too_large(path, None, READ_BYTES_LIMIT)
        return data

    def open(self, name: str) -> LocalFile:
        return LocalFile(self.join(name))
