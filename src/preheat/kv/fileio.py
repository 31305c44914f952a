"""The system calls of the file tier's reads and writes: straight into and out of the caller's buffers, no buffered
copy, short reads and writes continued, and the payload checksum computed while the bytes are in the CPU's cache.

Torch-free and tier-free: ``kv/fs.py`` (the tier: paths, temporary files, quota, recency) calls these on
descriptors it opened, as do the blob store's readers that it runs (``kv/blob_reads.py``: reads into an engine's
memory). ``make_root`` makes a missing L2 directory, here so that ``kv/settings.py`` (torch-free: the server checks
its flags before it imports the engine) refuses a directory that cannot be made with the rule the tier uses.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Callable, Sequence

from preheat.core.errors import ConfigError, CorruptChunkError
from preheat.kv import chunkfile

PIECE_BYTES = 1 << 20  # what is copied and then hashed in one go: small enough to stay in the CPU's cache
WHOLE_BYTES = 1 << 20  # a payload up to this size is written in one call and hashed after it (still in cache)


def fill(fd: int, buffers: list[memoryview], offset: int, size: int, name: str) -> None:
    """Read ``fd`` from ``offset`` to ``size`` into ``buffers`` (their lengths summing to that), ``CorruptChunkError``
    when the file ends early (truncated since its ``fstat``)."""
    if sum(map(len, buffers)) != size - offset:
        raise CorruptChunkError(f"chunk {name}: {size} bytes, not what its header says")
    got = os.preadv(fd, buffers, offset)  # one call for the whole file on a local filesystem
    if got == size - offset:
        return
    for buffer in buffers:  # a short read (a network filesystem, a signal): finish buffer by buffer
        if got >= len(buffer):
            got -= len(buffer)
            offset += len(buffer)
            continue
        while got < len(buffer) and (n := os.preadv(fd, [buffer[got:]], offset + got)):
            got += n
        if got != len(buffer):
            raise CorruptChunkError(f"chunk {name}: truncated while read")
        offset += got
        got = 0


def fill_pieces(fd: int, buffer: memoryview, offset: int, size: int, name: str, *,
                each: Callable[[memoryview], object], piece: int = PIECE_BYTES) -> None:
    """``fill`` of one large buffer in pieces of ``piece`` bytes, calling ``each(part)`` on each part right after
    it is read, while it is still in the CPU's cache: a checksum over the value then reads cache, not memory
    (measured here: 7% less time for a 16 MiB value than one read and one hash after it, 19% for 32 MiB)."""
    if len(buffer) != size - offset:
        raise CorruptChunkError(f"chunk {name}: {size} bytes, not what its header says")
    for start in range(0, len(buffer), piece):
        part = buffer[start : start + piece]
        fill(fd, [part], offset + start, offset + start + len(part), name)
        each(part)


def read_all(fd: int, size: int, name: str) -> bytearray:
    """The first ``size`` bytes of ``fd``, ``CorruptChunkError`` when it has fewer."""
    blob = bytearray(size)
    fill(fd, [memoryview(blob)], 0, size, name)
    return blob


def write_all(fd: int, pieces: Sequence[bytes | memoryview]) -> None:
    """Write ``pieces`` in order, no buffered copy of any: the first (the header) alone, then the rest in one
    ``writev``, continued after a short write (a signal; a full disk raises ``OSError``). Why the header alone:
    measured on Linux 6.18/ext4 with much of the page cache dirty, a new file whose first write is one large one
    (1 MiB at offset 0, as one ``write`` or ``writev``) took 3.2 ms, one written as a small write and then the rest
    0.6 ms (docs/kv-store.md, *Puts*). The blob store's unkeyed values on ``fs://`` take ``write_unsummed``."""
    views = [view for view in (memoryview(piece).cast("B") for piece in pieces) if len(view)]
    if len(views) > 1:
        write_all(fd, views[:1])
        views = views[1:]
    while views:
        done = os.writev(fd, views)
        if not done:  # not a regular file's behaviour; never spin on it
            raise OSError(errno.EIO, "write made no progress")
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


def write_unsummed(fd: int, value: chunkfile.Unsummed, *, piece: int = PIECE_BYTES, whole: int = WHOLE_BYTES) -> None:
    """Write ``value`` (``chunkfile.encode_blob_unsummed``) into the empty file ``fd``: the payload first, from its
    offset, then the header with the checksum at offset 0. A payload of up to ``whole`` bytes goes in one write; a
    larger one in writes that end on multiples of ``piece`` in the file. Each piece is hashed just *before* it is
    written, so the kernel's copy reads it from the CPU's cache the hash left it in (measured here, 16 / 4 / 1 MiB
    values: 5.4 / 1.35 / 0.38 ms hashed then written, 7.3 / 2.0 / 0.50 ms written then hashed, 5.1 / 1.5 / 0.38 ms
    not hashed at all: the checksum costs the put next to nothing).

    Why pieces of a MiB: measured here with much of the page cache dirty, a 16 MiB value written in writes of
    2 MiB, 4 MiB or all at once took 56-60 ms (p50; SGLang's ``file`` backend, one write: 62 ms), in writes of
    1 MiB 6.5 ms; at 4 MiB the p90 was 9 ms against 2.9 ms.

    Why the payload first: the page cache sizes its folios by each write's length and position, so a file whose
    first write is a small header keeps small folios for the payload after it, and is read back slower than one
    whose payload went in as one large write from the file's first page (measured here, 1 MiB values: 67 us against
    57 us per read from the page cache; 4 MiB 204 against 193 us; SGLang's ``file`` backend writes its raw page in
    one write: 58 us). The bytes on disk are the same either way; only a finished file is renamed into place."""
    parts, position = value.parts, value.offset
    if value.frame.payload_bytes <= whole:  # one write per part (mostly one), hashed just before
        checksum = chunkfile.payload_checksum(parts[0]) if len(parts) == 1 else _checksum(parts)
        for part in parts:
            pwrite_all(fd, part, position)
            position += len(part)
        pwrite_all(fd, value.head(checksum), 0)
        return
    digest = chunkfile.payload_hasher()
    for part in parts:
        start = 0
        while start < len(part):
            end = min(len(part), start + piece - position % piece)  # the next write starts on a piece boundary
            digest.update(part[start:end])
            pwrite_all(fd, part[start:end], position)
            position += end - start
            start = end
    pwrite_all(fd, value.head(digest.hexdigest()), 0)


def _checksum(parts: Sequence[memoryview]) -> str:
    digest = chunkfile.payload_hasher()
    for part in parts:
        digest.update(part)
    return str(digest.hexdigest())


def preallocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` of disk for the new file ``fd`` before it is written (``fallocate`` with
    ``FALLOC_FL_KEEP_SIZE``, as numpy's ``tofile`` does: the size still grows only as bytes are written), so each
    write need not reserve blocks for the pages it dirties (measured here on ext4: a 16 MiB value in writes of a
    MiB 3.2 ms instead of 4.6 ms, 4 MiB 0.86 against 1.23 ms, 1 MiB 0.66 against 0.73 ms). Best effort: a
    filesystem without ``fallocate`` (or a full disk, which the writes then report) changes nothing. Not
    ``os.posix_fallocate``: where the filesystem lacks the call, glibc emulates it by writing every block."""
    call = _fallocate()
    if call is not None and nbytes > 0:
        call(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes)


_FALLOC_FL_KEEP_SIZE = 1


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate(2)`` (Linux), or None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset``, continued after a short write (a full disk raises ``OSError``)."""
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        if not done:  # not a regular file's behaviour; never spin on it
            raise OSError(errno.EIO, "write made no progress")
        view = view[done:]
        offset += done


ROOT_MODE = 0o700  # a directory this tier makes: its chunks hold K/V (prompt content), and writing them steers answers


def make_root(root: str) -> bool:
    """Make ``root``, the directory of an ``fs://`` L2, when it does not exist; True when this call made it.

    The one home of this rule, for every opener (``preheat serve`` refuses to start on its ``ConfigError``, before
    loading anything; a tier opened by an engine's integration is marked down with it). Only the last component is
    made, and only when its parent is a directory: a missing parent is a share that is not mounted, or a typo, and
    making a tree there would put the shared cache on the local disk instead, where it could fill the root file
    system. It is made ``ROOT_MODE``: no other local user can read the chunks (they reveal prompts) or plant K/V;
    a directory the operator made stays as it is, so a fleet shared by a group keeps its group's mode.

    ``ConfigError`` names the path when something that is not a directory is in the way, the parent is missing or
    not a directory, or the directory cannot be made (permission, a read-only file system).
    """
    if os.path.isdir(root):
        return False
    in_the_way = f"{root} is not a directory (something else is in the way)"
    if os.path.lexists(root):  # a file, or a symlink to nothing: never replaced
        raise ConfigError(in_the_way)
    parent = os.path.dirname(root)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ConfigError(f"cannot create {root}: its parent {parent} is not a directory")
    if not os.path.isdir(parent):
        raise ConfigError(
            f"cannot create {root}: its parent {parent} does not exist (mount the shared directory there, or make "
            f"the whole path first: mkdir -p {root})"
        )
    try:
        os.mkdir(root, ROOT_MODE)
    except FileExistsError:
        if os.path.isdir(root):  # another replica starting beside this one made it first
            return False
        raise ConfigError(in_the_way) from None
    except OSError as exc:
        raise ConfigError(f"cannot create {root}: {exc.strerror or exc}") from None
    return True
