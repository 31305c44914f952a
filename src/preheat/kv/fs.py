"""L2 on a shared filesystem: one self-checking file per chunk under ``ROOT/v1/<fingerprint>/<key[:2]>/<key>.kvc``.

Safe for many processes on many nodes sharing one directory (an NVMe mount, NFS):

- **Writes** go to a temporary name in the chunk's own directory, then ``rename`` onto the final name (atomic on
  POSIX filesystems and NFS). A reader never sees a partial file; a writer killed mid-write leaves only a temporary
  file, removed by the next quota sweep once it is old. Two writers of the same chunk both rename complete, identical
  files: the last rename wins and one valid file remains. The blob store's unsigned values are written payload
  first, hashed as they go, header last (``fileio.write_unsummed``); the bytes are the same. The 256 shard
  directories are made when the tier comes up, not by the first write into each; so is the root itself, once, when
  the tier is opened and only if its parent exists (``fileio.make_root``).
- **Reads** read only regular files no larger than a chunk of the layout can be (a planted FIFO or huge file never
  blocks or fills memory: files are opened non-blocking, without following symlinks, and checked by ``fstat``), and
  verify the header, checksum and, with a fleet secret, the MAC (``chunk.decode_chunk``); a file that fails is a
  miss and is removed.
- **Stores** of a chunk whose file exists check that file first: a valid one is kept (its recency refreshed), a
  damaged one is replaced, so one recompute heals every damaged chunk of a prompt.
- **The index is the directory**: nothing lives only in memory, so a restarted replica hits its chunks at once.
- **LRU across processes**: a hit sets the file's mtime to now, unless it is under ``RECENCY_S`` (a second) old
  already: a hot file is not re-stamped on every read, so recency is kept to the second. The quota sweep
  (``--kv-l2-max-bytes``) removes the files with the oldest mtimes, whoever wrote them, until the directory is at
  90% of the quota. A sweep runs after every 5% of the quota written by this process, under a non-blocking ``flock``
  so only one process sweeps at a time; the quota can therefore be exceeded briefly by what other processes write
  between sweeps.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from preheat.core import durable
from preheat.core.errors import ConfigError, CorruptChunkError, Reframe, _NoRoomError
from preheat.kv import chunkfile
from preheat.kv.backends import fs_root
from preheat.kv.chunk import StoredChunk, decode_chunk, encode_chunk
from preheat.kv.fileio import fill, make_root, preallocate, read_all, write_all, write_unsummed
from preheat.kv.tier import Check, Encode, EvictHook, Health, TierStats, chunk_expect

log = logging.getLogger("preheat.kv")

SUFFIX = ".kvc"
STALE_TEMP_S = 600.0  # a temporary file this old belongs to a dead writer
SWEEP_FRACTION = 0.05
RECENCY_S = 1.0  # a hit re-stamps a file's mtime only when it is at least this old (LRU by the second)
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a writer's own temporary file
_SHARDS = [f"{i:02x}" for i in range(256)]
T = TypeVar("T")
# read_split's head_size, place and finish
_SplitParts = tuple[
    Callable[[bytes], int], Callable[[bytes, int], "list[memoryview] | None"], Callable[[bytes, "list[memoryview]"], T]
]


class FileTier:
    """Chunks as files under ``root``, made when the tier is opened if its parent exists (``fileio.make_root``); a
    root that cannot be made, or that goes away later (a share unmounted), marks the tier down and is never made
    again while it runs, so an unmounted share is not replaced by a directory on the local disk.

    ``get``/``put`` store the reference engine's chunks; ``read``/``write``/``contains`` are the same path for any
    self-checking value (``kv/store.py`` stores engines' opaque values through them). ``expect`` says what a read
    accepts: a chunk layout (``chunkfile.Expect``) or opaque values (``chunkfile.BlobExpect``); its fingerprint
    names the directory.
    """

    name = "l2"

    def __init__(
        self,
        root: str,
        expect: chunkfile.AnyExpect,
        *,
        max_bytes: int | None = None,
        on_evict: EvictHook | None = None,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = os.path.abspath(root)
        self.expect = expect
        self._max_size = expect.max_size
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self.health = Health("l2 " + self.describe(), retry_s, clock)
        self.dir = os.path.join(self.root, "v1", expect.fingerprint)
        self._on_evict = on_evict
        self._written_since_sweep = 0
        self._written_lock = threading.Lock()  # a blob store's batch writes from several threads (kv/fanout.py)
        self._sweep_lock = threading.Lock()
        self._probe(create=True)
        if self.health.up and max_bytes is not None:
            self.sweep()

    @property
    def up(self) -> bool:
        return self.health.up

    def describe(self) -> str:
        return f"fs://{self.root}"

    def _probe(self, *, create: bool = False) -> bool:
        """Check that the directory exists and takes a write (a read-only or missing mount marks the tier down);
        ``create``: make it first when it is missing (at open only)."""
        if create:
            try:
                make_root(self.root)
            except ConfigError as exc:
                self.health.down(str(exc))
                return False
        if not os.path.isdir(self.root):
            self.health.down(f"{self.root} does not exist or is not a directory")
            return False
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = durable.temp_path(os.path.join(self.dir, "probe"))
            try:
                with open(probe, "wb") as handle:
                    handle.write(b"preheat")
            finally:
                durable.discard(probe)
            self._make_shards()
        except OSError as exc:
            self.health.down(f"cannot write under {self.root}: {exc.strerror or exc}")
            return False
        self.health.ok()
        return True

    def _make_shards(self) -> None:
        """Make the directory's 256 shard directories (``00``..``ff``: every name this tier stores starts with two
        hex digits) that are not there yet, once, when the tier comes up: a put into a missing shard would pay a
        ``mkdir`` (measured here: ~0.25 ms on ext4, most of a 1 MiB put's gap to SGLang's flat ``file`` backend)
        for the first 256 or so values of a namespace. A restarted process finds them all in one ``listdir``.
        Best effort: a shard it cannot make (a disk or inode quota nearly full) is made by the first put into it
        (``_store``), so it never takes the tier down."""
        present = set(os.listdir(self.dir))
        for shard in _SHARDS:
            if shard not in present:
                try:
                    os.mkdir(os.path.join(self.dir, shard))
                except FileExistsError:  # another process made it meanwhile
                    continue
                except OSError as exc:
                    log.debug("KV L2: could not make the shard directories of %s: %s", self.dir, exc)
                    return

    def path(self, name: str) -> str:
        """The file of ``name`` (a chunk key, or a blob store's file-safe name): ``DIR/<name[:2]>/<name>.kvc``."""
        return f"{self.dir}/{name[:2]}/{name}{SUFFIX}"  # not os.path.join: ~1 us less per read

    def _usable(self) -> bool:
        """Up, or down long enough to try again and the probe now succeeds."""
        return self.health.should_try() and (self.health.up or self._probe())

    def get(self, key: str) -> StoredChunk | None:
        expect = chunk_expect(self.expect)
        return self.read(key, lambda blob: decode_chunk(blob, key, expect))

    def put(self, key: str, chunk: StoredChunk) -> bool:
        expect = chunk_expect(self.expect)
        return self.write(
            key,
            lambda: encode_chunk(key, expect.fingerprint, chunk, expect.mac_key),
            lambda blob: decode_chunk(blob, key, expect),
        )

    # -- the one storage path: the reference engine's chunks (above) and the blob store (kv/store.py) --------------

    def read(self, name: str, decode: Callable[[bytes | bytearray], T]) -> T | None:
        """``decode`` of the bytes stored under ``name``, or None (absent, unreadable, refused by ``decode`` with
        ``CorruptChunkError``, tier down); counts a hit or a miss, removes what ``decode`` refused, and refreshes
        the file's recency on a hit."""

        def whole(fd: int, size: int) -> T:
            return decode(read_all(fd, size, name))

        return self._counted(name, whole)

    def read_split(
        self,
        name: str,
        head_size: Callable[[bytes], int],
        place: Callable[[bytes, int], list[memoryview] | None],
        finish: Callable[[bytes, list[memoryview]], T],
        *,
        extra: int = 0,
    ) -> T | None:
        """``read`` without an intermediate buffer: the file's first bytes (``head_size`` of its first 16 says how
        many), then the rest scattered straight into the buffers ``place(head, file_size)`` hands back (the caller's
        own memory; None: no room, a miss), then ``finish(head, buffers)`` verifies them and makes the result.
        ``head`` holds up to ``extra`` bytes after the header too (what the buffers will hold first, unverified).
        ``head_size``, ``place`` and ``finish`` raise ``CorruptChunkError`` for bytes they refuse; counted and
        removed as ``read`` does."""
        return self._counted(name, lambda fd, size: _split(fd, size, name, (head_size, place, finish), extra))

    def read_framed(
        self,
        name: str,
        frame: Callable[[int, int], T],
        split: Callable[[], _SplitParts[T]],
    ) -> T | None:
        """``read_split`` in one ``preadv`` when the header's length can be told from the file's size:
        ``frame(fd, file_size)`` reads header and rest at once (``fill``) and verifies them. It raises
        ``Reframe`` to have the file read as ``read_split(name, *split())`` does instead: when it cannot
        predict the header or has no buffers for that size (the header then says whether the file is damaged or
        there is no room), or when the header is valid but not as long as predicted (a file of another writer).
        Counted, removed and refreshed as ``read`` does."""

        def framed(fd: int, size: int) -> T:
            try:
                return frame(fd, size)
            except Reframe:
                return _split(fd, size, name, split(), 0)

        return self._counted(name, framed)

    def _counted(self, name: str, reader: Callable[[int, int], T]) -> T | None:
        """``reader(fd, size)``'s value of the opened file of ``name``, counting a hit (with its size) or a miss,
        removing a file it refused, and refreshing the file's recency on a hit."""
        if not self._usable():
            self.stats.add(misses=1)
            return None
        start = time.perf_counter()
        path = self.path(name)
        try:
            fd, info = self._open(path, name)
            try:
                value = reader(fd, info.st_size)
                _touch(fd, info)
            finally:
                os.close(fd)
        except (FileNotFoundError, _NoRoomError):
            self.stats.add(misses=1)
            return None
        except CorruptChunkError as exc:
            log.warning("KV L2: %s; removing %s", exc, path)
            self._remove(path, name)
            self.stats.rejected(exc)
            return None
        except OSError as exc:
            self.stats.add(misses=1, errors=1)
            self._failed(exc)
            return None
        self.stats.hit(info.st_size, time.perf_counter() - start)
        return value

    def read_many(self, names: Sequence[str], decodes: Sequence[Callable[[bytes | bytearray], T]]) -> list[T | None]:
        """``read`` of every name, in order."""
        return [self.read(name, decode) for name, decode in zip(names, decodes, strict=True)]

    def contains_many(self, names: Sequence[str]) -> list[bool]:
        """``contains`` of every name, in order."""
        return [self.contains(name) for name in names]

    def contains(self, name: str) -> bool:
        """Whether a file that could hold ``name`` is there (a regular file no larger than ``expect.max_size``),
        without reading it: a later ``read`` still verifies it and may miss."""
        if not self._usable():
            return False
        try:
            info = os.lstat(self.path(name))
        except OSError:
            return False
        return stat.S_ISREG(info.st_mode) and info.st_size <= self.expect.max_size

    def _open(self, path: str, key: str) -> tuple[int, os.stat_result]:
        """The open descriptor of ``path`` and its ``fstat``. Only regular files no larger than any chunk of the
        layout are read: a FIFO, device or socket planted under the chunk's name is opened without blocking
        (``O_NONBLOCK``, ``O_NOCTTY``) and refused by its ``fstat``, a symlink is not followed (``O_NOFOLLOW``), a
        huge file is refused before anything is allocated (``CorruptChunkError``). The caller closes it."""
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink, or a socket, under the chunk's name
                raise CorruptChunkError(f"chunk {key}: not a regular file") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CorruptChunkError(f"chunk {key}: not a regular file")
            if info.st_size > self._max_size:
                raise CorruptChunkError(
                    f"chunk {key}: {info.st_size} bytes, more than any chunk of this layout ({self.expect.max_size})"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, info

    def _read(self, path: str, key: str) -> bytearray:
        """The bytes at ``path``, unverified (``_open`` says which files are read at all)."""
        fd, info = self._open(path, key)
        try:
            return read_all(fd, info.st_size, key)
        finally:
            os.close(fd)

    def _holds(self, path: str, key: str, check: Check) -> bool:
        """Whether ``path`` already holds a valid ``key`` (``check`` accepts its bytes): a store then only refreshes
        its recency. A file that fails its checks is replaced by the store: a lookup stops at the first missing
        chunk, so damaged files after it are never read, and must not be mistaken for stored chunks (they would
        never heal)."""
        try:
            check(self._read(path, key))
        except FileNotFoundError:
            return False
        except CorruptChunkError as exc:
            log.warning("KV L2: %s; replacing %s", exc, path)
            self.stats.rejected(exc, miss=False)
            return False
        except OSError:
            return False  # the write that follows reports (and counts) what is wrong
        with contextlib.suppress(OSError):
            os.utime(path)
        return True

    def write_many(self, items: Sequence[tuple[str, Encode, Check]]) -> list[bool]:
        """``write`` of every (name, encode, check), in order."""
        return [self.write(name, encode, check) for name, encode, check in items]

    def describe_namespace(self, description: bytes) -> None:
        """Leave ``description`` (JSON) as ``namespace.json`` beside the values, unless it is there already."""
        path = os.path.join(self.dir, "namespace.json")
        if not self._usable() or os.path.lexists(path):
            return
        try:
            durable.write_file(path, description, mode=0o666)  # as the chunk files: any sharer may replace it
        except OSError as exc:
            log.debug("KV L2: could not describe the namespace in %s: %s", path, exc)

    def write(self, name: str, encode: Encode, check: Check) -> bool:
        """Store the pieces ``encode`` makes under ``name`` (temporary file, then ``rename``), unless a file that
        ``check`` accepts is there already (its recency is refreshed instead: keys name their contents). False when
        nothing was stored: larger than the quota, tier down, disk full. Never raises ``OSError``."""
        return self._store(name, encode, check)

    def write_unsummed(self, name: str, encode: Callable[[], chunkfile.Unsummed], check: Check) -> bool:
        """``write`` of an unkeyed opaque value whose checksum is computed as its payload is written
        (``fileio.write_unsummed``: payload first, hashed piece by piece while in the CPU's cache, header last)."""
        return self._store(name, encode, check)

    def _store(self, name: str, encode: Callable[[], list[bytes | memoryview] | chunkfile.Unsummed],
               check: Check) -> bool:
        if not self._usable():
            return False
        path = self.path(name)
        if self._holds(path, name, check):
            return True
        pieces = encode()
        size = pieces.size if isinstance(pieces, chunkfile.Unsummed) else sum(len(p) for p in pieces)
        if self.max_bytes is not None and size > self.max_bytes:
            self.stats.add(refused=1)
            log.debug("KV L2: %s is %d bytes, more than the whole quota (%d); not stored", name, size, self.max_bytes)
            return False
        shard = f"{self.dir}/{name[:2]}"
        # durable's temporary name and clean-up, but not its write: a chunk is preallocated and written in pieces
        # (the unsummed kind hashed as it goes), and not fsynced: the L2 is a cache whose files check themselves, so
        # one torn by a power loss is a miss (and is replaced), never wrong bytes; a sync per put would cost more
        # than the put.
        temp = durable.temp_path(path)
        try:
            try:
                fd = os.open(temp, _CREATE_FLAGS, 0o666)
            except FileNotFoundError:  # a shard removed since the tier came up (``_make_shards``)
                with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
                    # The shard alone: a root that went away (a share unmounted) is not made again on the local
                    # disk; the mkdir fails and the tier goes down (``_failed``).
                    os.mkdir(shard)
                fd = os.open(temp, _CREATE_FLAGS, 0o666)
            try:
                preallocate(fd, size)
                if isinstance(pieces, chunkfile.Unsummed):
                    write_unsummed(fd, pieces)
                else:
                    write_all(fd, pieces)
            finally:
                os.close(fd)
            os.replace(temp, path)  # atomically replaces a damaged file (or a FIFO planted under the name)
        except OSError as exc:
            durable.discard(temp)
            self.stats.add(errors=1)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) and self.max_bytes is not None:
                self.sweep()
            elif exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                self._failed(exc)
            log.debug("KV L2: could not store %s: %s", name, exc)
            return False
        self.stats.add(stores=1, bytes_written=size)
        self.health.ok()
        if self.max_bytes is not None:
            with self._written_lock:
                self._written_since_sweep += size
                due = self._written_since_sweep >= max(self.max_bytes * SWEEP_FRACTION, 1)
                if due:  # claimed by this write: the others of a batch do not walk the directory again
                    self._written_since_sweep = 0
            if due:
                self.sweep()
        return True

    def remove(self, name: str) -> bool:
        """Remove what is stored under ``name``; False when nothing was."""
        path = self.path(name)
        existed = os.path.lexists(path)
        self._remove(path, name)
        return existed and not os.path.lexists(path)

    def _failed(self, exc: OSError) -> None:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ESTALE, errno.EIO, errno.ENOTDIR):
            self.health.down(f"{self.root}: {exc.strerror or exc}")

    def _remove(self, path: str, key: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            return
        if self._on_evict is not None and key:
            self._on_evict(self.name, key)

    def sweep(self) -> int:
        """Enforce the quota across every process sharing the directory; returns the bytes removed. Also removes
        temporary files of dead writers. Skips (returns 0) when another process is sweeping."""
        if self.max_bytes is None:
            return 0
        with self._sweep_lock:
            with self._written_lock:
                self._written_since_sweep = 0
            try:
                lock = os.open(os.path.join(self.root, "v1", ".sweep.lock"), os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                self._failed(exc)
                return 0
            try:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return 0  # another process is sweeping right now
                return self._sweep_locked(self.max_bytes)
            finally:
                os.close(lock)

    def _sweep_locked(self, quota: int) -> int:
        files, total, now = [], 0, time.time()
        for path, info in _walk(os.path.join(self.root, "v1")):
            if path.endswith(durable.TEMP_SUFFIX):
                if now - info.st_mtime > STALE_TEMP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                continue
            if not path.endswith(SUFFIX):
                continue  # the sweep lock, probes
            files.append((info.st_mtime, info.st_size, path))
            total += info.st_size
        if total <= quota:
            return 0
        files.sort()
        target, removed = int(quota * 0.9), 0
        for _mtime, size, path in files:
            if total - removed <= target:
                break
            key = os.path.basename(path)[: -len(SUFFIX)] if path.startswith(self.dir + os.sep) else ""
            self._remove(path, key)
            removed += size
            self.stats.add(evictions=1)
        log.info("KV L2 sweep: removed %d bytes to stay under %d", removed, quota)
        return removed

    def keys(self, limit: int) -> list[str]:
        return [name for name, _size in self.entries(limit)]

    def entries(self, limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` stored names with their sizes in bytes, most recently used first (the warm-up order)."""
        found = [(info.st_mtime, info.st_size, path) for path, info in _walk(self.dir) if path.endswith(SUFFIX)]
        found.sort(reverse=True)
        return [(os.path.basename(path)[: -len(SUFFIX)], size) for _, size, path in found[:limit]]

    def head(self, name: str, nbytes: int) -> bytes | None:
        """The first ``nbytes`` stored under ``name``, unverified (listing reads the key a header claims), or None."""
        try:
            fd = os.open(self.path(name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return os.pread(fd, nbytes, 0)
        except OSError:
            return None
        finally:
            os.close(fd)

    def close(self) -> None:
        return None


def open_url(
    url: str,
    expect: chunkfile.AnyExpect,
    *,
    max_bytes: int | None = None,
    ttl_s: int | None = None,
    on_evict: EvictHook | None = None,
) -> FileTier:
    """The ``FileTier`` of an ``fs://`` URL: the ``fs`` entry of ``kv/backends.py``, which checked the URL.
    ``ttl_s`` is Redis's: files live until the quota sweep removes them."""
    del ttl_s
    return FileTier(fs_root(url), expect, max_bytes=max_bytes, on_evict=on_evict)


def _walk(top: str) -> list[tuple[str, os.stat_result]]:
    """Every regular file under ``top`` with its stat (files vanishing under a concurrent sweep are skipped)."""
    out: list[tuple[str, os.stat_result]] = []
    stack = [top]
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    out.append((entry.path, entry.stat(follow_symlinks=False)))
            except OSError:
                continue
    return out


def _touch(fd: int, info: os.stat_result) -> None:
    """Recency for the cross-process LRU sweep: a hit sets the file's mtime to now, unless it is less than
    ``RECENCY_S`` old already (a hot value is not re-stamped on every read; the sweep's order is by the second)."""
    if time.time() - info.st_mtime >= RECENCY_S:
        with contextlib.suppress(OSError):
            os.utime(fd)


def _split(fd: int, size: int, name: str, parts: _SplitParts[T], extra: int) -> T:
    """``FileTier.read_split`` on an open file (``parts``: its ``head_size``, ``place`` and ``finish``)."""
    head_size, place, finish = parts
    first = os.pread(fd, min(size, chunkfile.HEAD_HINT), 0)
    wanted = head_size(first)
    need = min(size, wanted + extra)
    head = first if need <= len(first) else os.pread(fd, need, 0)
    if len(head) < wanted:
        raise CorruptChunkError(f"chunk {name}: {size} bytes, shorter than its header")
    buffers = place(head, size)
    if buffers is None:
        raise _NoRoomError
    fill(fd, buffers, wanted, size, name)
    return finish(head, buffers)
