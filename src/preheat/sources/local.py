"""Local, NFS and Lustre paths: the kernel does the work, ``preadv`` releases the GIL."""

from __future__ import annotations

import os
from collections.abc import Sequence

from preheat.errors import SourceError
from preheat.sources.base import check_name


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
        return os.preadv(self._require(), list(buffers), offset)

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
        path = self.join(name)
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except OSError as exc:
            raise SourceError(f"{path}: cannot read: {exc.strerror}") from None

    def open(self, name: str) -> LocalFile:
        return LocalFile(self.join(name))
