"""Getting the cache's bytes and names onto the disk, not just into the page cache.

``rename`` makes an entry appear atomically for every process, but only ``fsync`` makes it survive a power loss: without
it the new name can reach the disk before the data it names (the entry then holds zeros or old blocks). The rule every
publisher follows (``ModelCache.publish``): fsync every file and directory of the new entry, rename it into place,
then fsync the directories that changed (the new name's and the old name's).

Directories on some filesystems (a few FUSE mounts) refuse ``fsync`` with ``EINVAL``; that is taken as "nothing more
can be done here", as databases do, rather than as a failed publish.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def fsync_path(path: str) -> None:
    """fsync the file or directory at ``path``."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not (exc.errno in _UNSUPPORTED and os.path.isdir(path)):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root``, then every directory, deepest first, ``root`` last."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def write_file(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably: a temporary file of its own (unique to this process and
    call, so two writers never share one), fsynced, renamed over ``path``, then the directory fsynced.

    A reader (or a power loss) sees the old content or the new one, never a torn file. The temporary file ends in
    ``.tmp`` and is removed when anything fails before the rename.
    """
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(os.path.dirname(path) or ".")
