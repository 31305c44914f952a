"""L2 on a shared filesystem: one self-checking file per chunk under ``ROOT/v1/<fingerprint>/<key[:2]>/<key>.kvc``.

Safe for many processes on many nodes sharing one directory (an NVMe mount, NFS):

- **Writes** go to a temporary name in the chunk's own directory, then ``rename`` onto the final name (atomic on
  POSIX filesystems and NFS). A reader never sees a partial file; a writer killed mid-write leaves only a temporary
  file, removed by the next quota sweep once it is old. Two writers of the same chunk both rename complete, identical
  files: the last rename wins and one valid file remains.
- **Reads** open only regular files no larger than a chunk of the layout can be (a planted FIFO or huge file never
  blocks or fills memory), and verify the header, checksum and, with a fleet secret, the MAC (``chunk.decode_chunk``);
  a file that fails is a miss and is removed.
- **Stores** of a chunk whose file exists check that file first: a valid one is kept (its recency refreshed), a
  damaged one is replaced, so one recompute heals every damaged chunk of a prompt.
- **The index is the directory**: nothing lives only in memory, so a restarted replica hits its chunks at once.
- **LRU across processes**: a hit sets the file's mtime to now; the quota sweep (``--kv-l2-max-bytes``) removes the
  files with the oldest mtimes, whoever wrote them, until the directory is at 90% of the quota. A sweep runs after
  every 5% of the quota written by this process, under a non-blocking ``flock`` so only one process sweeps at a time;
  the quota can therefore be exceeded briefly by what other processes write between sweeps.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable

from preheat.kv import chunkfile
from preheat.kv.chunk import StoredChunk, decode_chunk, encode_chunk
from preheat.kv.tier import EvictHook, Health, TierStats

log = logging.getLogger("preheat.kv")

SUFFIX = ".kvc"
STALE_TEMP_S = 600.0  # a temporary file this old belongs to a dead writer
SWEEP_FRACTION = 0.05


class FileTier:
    """Chunks as files under ``root`` (which must exist: a missing mount marks the tier down, it is not created)."""

    name = "l2"

    def __init__(
        self,
        root: str,
        expect: chunkfile.Expect,
        *,
        max_bytes: int | None = None,
        on_evict: EvictHook | None = None,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = os.path.abspath(root)
        self.expect = expect
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self.health = Health("l2 " + self.describe(), retry_s, clock)
        self.dir = os.path.join(self.root, "v1", expect.fingerprint)
        self._on_evict = on_evict
        self._written_since_sweep = 0
        self._sweep_lock = threading.Lock()
        self._probe()
        if self.health.up and max_bytes is not None:
            self.sweep()

    @property
    def up(self) -> bool:
        return self.health.up

    def describe(self) -> str:
        return f"fs://{self.root}"

    def _probe(self) -> bool:
        """Check that the directory exists and takes a write (a read-only or missing mount marks the tier down)."""
        if not os.path.isdir(self.root):
            self.health.down(f"{self.root} does not exist or is not a directory")
            return False
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            with open(probe, "wb") as handle:
                handle.write(b"preheat")
            os.unlink(probe)
        except OSError as exc:
            self.health.down(f"cannot write under {self.root}: {exc.strerror or exc}")
            return False
        self.health.ok()
        return True

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + SUFFIX)

    def _usable(self) -> bool:
        """Up, or down long enough to try again and the probe now succeeds."""
        return self.health.should_try() and (self.health.up or self._probe())

    def get(self, key: str) -> StoredChunk | None:
        if not self._usable():
            self.stats.add(misses=1)
            return None
        path = self.path(key)
        start = time.perf_counter()
        try:
            chunk, size = self._read(path, key)
        except FileNotFoundError:
            self.stats.add(misses=1)
            return None
        except chunkfile.CorruptChunkError as exc:
            log.warning("KV L2: %s; removing %s", exc, path)
            self._remove(path, key)
            self.stats.rejected(exc)
            return None
        except OSError as exc:
            self.stats.add(misses=1, errors=1)
            self._failed(exc)
            return None
        self.stats.hit(size, time.perf_counter() - start)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the cross-process LRU sweep
        return chunk

    def _read(self, path: str, key: str) -> tuple[StoredChunk, int]:
        """The verified chunk at ``path`` and its size in bytes. Only regular files no larger than any chunk of the
        layout are opened and read: a FIFO, device, socket or symlink planted under the chunk's name, or a huge
        file, is refused without blocking or allocating (``CorruptChunkError``)."""
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise chunkfile.CorruptChunkError(f"chunk {key}: not a regular file")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # swapped for a symlink or a socket since the lstat
                raise chunkfile.CorruptChunkError(f"chunk {key}: not a regular file") from None
            raise
        with open(fd, "rb", buffering=0) as handle:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise chunkfile.CorruptChunkError(f"chunk {key}: not a regular file")
            if info.st_size > self.expect.max_size:
                raise chunkfile.CorruptChunkError(
                    f"chunk {key}: {info.st_size} bytes, more than any chunk of this layout ({self.expect.max_size})"
                )
            blob = bytearray(info.st_size)
            view, got = memoryview(blob), 0
            while got < len(blob) and (n := handle.readinto(view[got:])):
                got += n
        if got != len(blob):
            raise chunkfile.CorruptChunkError(f"chunk {key}: read {got} of {len(blob)} bytes")
        return decode_chunk(blob, key, self.expect), len(blob)

    def _holds(self, path: str, key: str) -> bool:
        """Whether ``path`` already holds a valid ``key``: a store then only refreshes its recency. A file that
        fails its checks is replaced by the store: a lookup stops at the first missing chunk, so damaged files
        after it are never read, and must not be mistaken for stored chunks (they would never heal)."""
        try:
            self._read(path, key)
        except FileNotFoundError:
            return False
        except chunkfile.CorruptChunkError as exc:
            log.warning("KV L2: %s; replacing %s", exc, path)
            self.stats.rejected(exc, miss=False)
            return False
        except OSError:
            return False  # the write that follows reports (and counts) what is wrong
        with contextlib.suppress(OSError):
            os.utime(path)
        return True

    def put(self, key: str, chunk: StoredChunk) -> bool:
        if not self._usable():
            return False
        path = self.path(key)
        if self._holds(path, key):
            return True
        pieces = encode_chunk(key, self.expect.fingerprint, chunk, self.expect.mac_key)
        temp = os.path.join(os.path.dirname(path), f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temp, "wb") as handle:
                handle.writelines(pieces)
            os.rename(temp, path)  # atomically replaces a damaged file (or a FIFO planted under the name)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            self.stats.add(errors=1)
            if exc.errno == errno.ENOSPC and self.max_bytes is not None:
                self.sweep()
            elif exc.errno != errno.ENOSPC:
                self._failed(exc)
            log.debug("KV L2: could not store %s: %s", key, exc)
            return False
        size = sum(len(p) for p in pieces)
        self.stats.add(stores=1, bytes_written=size)
        self.health.ok()
        if self.max_bytes is not None:
            self._written_since_sweep += size
            if self._written_since_sweep >= max(self.max_bytes * SWEEP_FRACTION, 1):
                self.sweep()
        return True

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
            if path.endswith(".tmp"):
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
        found = [(info.st_mtime, path) for path, info in _walk(self.dir) if path.endswith(SUFFIX)]
        found.sort(reverse=True)
        return [os.path.basename(path)[: -len(SUFFIX)] for _, path in found[:limit]]

    def close(self) -> None:
        return None


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
