"""Advisory file locks (flock) between processes on one node.

Why flock: the kernel drops the lock when its holder dies, so a killed pull never leaves a stale lock behind, and a
shared lock held by every process using an entry lets garbage collection see "in use" without a registry.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from preheat.core.errors import CacheError


def _open_lock(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise CacheError(f"{path}: cannot open lock file: {exc.strerror}") from None


@contextmanager
def exclusive(path: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path``, waiting for other holders to finish."""
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def shared(path: str) -> Iterator[None]:
    """Hold a shared lock on ``path`` (many readers at once; excludes an exclusive holder)."""
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def try_exclusive(path: str) -> int | None:
    """Take an exclusive lock without waiting; the descriptor to close to release it, or None when it is held."""
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def hold_shared(path: str) -> int:
    """Take a shared lock on ``path`` and return the descriptor; closing it releases the lock."""
    fd = _open_lock(path)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd
