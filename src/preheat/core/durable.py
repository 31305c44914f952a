"""Getting the cache's bytes and names onto the disk, not just into the page cache.

``rename`` makes an entry appear atomically for every process, but only ``fsync`` makes it survive a power loss: without
it the new name can reach the disk before the data it names (the entry then holds zeros or old blocks). The rule every
publisher follows (``ModelCache.publish``): fsync every file and directory of the new entry, rename it into place,
then fsync the directories that changed (the new name's and the old name's).

Directories on some filesystems (a few FUSE mounts) refuse ``fsync`` with ``EINVAL``; that is taken as "nothing more
can be done here", as databases do, rather than as a failed publish.

This module is the one home of that discipline: ``replacing`` / ``write_file`` (the atomic write every file publisher
uses), ``temp_path`` (the one temporary-name scheme), ``discard`` (removing a temporary file after a failure) and
``fsync_dir``. Temporary names are hidden (a leading dot: manifest builders and listings skip them) and end in
``.tmp`` (sweeps recognise a killed writer's leftovers by it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from typing import BinaryIO

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)
TEMP_SUFFIX = ".tmp"


def fsync_dir(path: str) -> None:
    """fsync the directory at ``path`` (``""``: the current one), making the renames and creations inside it durable;
    a filesystem that does not support syncing a directory (``EINVAL``/``ENOTSUP``: some FUSE mounts, procfs) is let
    be."""
    fd = os.open(path or ".", os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsync the file or directory at ``path`` (a directory as ``fsync_dir`` does; a file that refuses is an error)."""
    if os.path.isdir(path):
        fsync_dir(path)
        return
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root``, then every directory, deepest first, ``root`` last."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def temp_path(path: str) -> str:
    """A temporary name beside ``path``, unique to this process and call (two writers never share one):
    ``DIR/.NAME.PID-RANDOM.tmp``."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}")


def discard(temp: str) -> None:
    """Remove the temporary file ``temp`` after a failed write; one already gone (or never made) is fine."""
    with contextlib.suppress(OSError):  # the failure being reported matters, not a second one while tidying up
        os.unlink(temp)


@contextlib.contextmanager
def replacing(path: str, *, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Replace ``path`` atomically and durably with what is written to the yielded file: it is open on a temporary
    name (``temp_path``); when the block ends it is fsynced, renamed over ``path``, and the directory fsynced.

    A reader (or a power loss) sees the old content or the new one, never a torn file. When anything fails (the block
    raises, the disk is full, the rename is refused) the temporary file is removed and ``path`` is left as it was.

    >>> with replacing("/tmp/settings.json") as out:  # doctest: +SKIP
    ...     out.write(b"{}")
    """
    temp = temp_path(path)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        discard(temp)
        raise
    fsync_dir(os.path.dirname(path))


def write_file(path: str, data: bytes | memoryview, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically and durably (``replacing``)."""
    with replacing(path, mode=mode) as out:
        out.write(data)
