"""Small, explicit file primitives: exact reads, size checks and page-cache advice."""

from __future__ import annotations

import os
from dataclasses import dataclass

from preheat.core.errors import CheckpointError


def read_exact(fd: int, offset: int, n: int, *, path: str) -> bytes:
    """Read exactly ``n`` bytes at ``offset`` or raise ``CheckpointError`` naming ``path``."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise CheckpointError(
                f"{path}: unexpected end of file at byte {offset + got} (wanted {n} bytes at {offset}); "
                "the file is truncated or was modified while loading",
                path=path,
            )
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def ensure_size(fd: int, needed: int, *, path: str) -> int:
    """Check that the open file still has ``needed`` bytes; return its size.

    Why: mapping a file that has shrunk and touching the missing pages kills the process with SIGBUS, and a short
    pread must never leave zeros where weights belong. Checking the size of the open descriptor right before use turns
    both into a clear error.
    """
    size = os.fstat(fd).st_size
    if size < needed:
        raise CheckpointError(
            f"{path}: file is {size} bytes but its header needs {needed}; it was truncated after it was opened "
            "or is still being written",
            path=path,
        )
    return size


def drop_page_cache(path: str) -> None:
    """Ask the kernel to evict ``path`` from the page cache (clean pages only; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class MountInfo:
    """Which mount a path lives on: its filesystem type and backing device."""

    mountpoint: str
    fstype: str
    device: str


def mount_of(path: str) -> MountInfo:
    """The mount holding ``path`` (longest matching mountpoint in /proc/mounts); unknown fields are empty."""
    real = os.path.realpath(path)
    best = MountInfo("/", "", "")
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                device, point, fstype = fields[0], fields[1].replace("\\040", " "), fields[2]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best.mountpoint):
                    best = MountInfo(point, fstype, device)
    except OSError:
        pass
    return best
