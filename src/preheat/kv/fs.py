"""L2 on a shared filesystem: one self-checking file per chunk under ``ROOT/v1/<fingerprint>/<key[:2]>/<key>.kvc``.

Safe for many processes on many nodes sharing one directory (an NVMe mount, NFS):

- **Writes** go to a temporary name in the chunk's own directory, then ``rename`` onto the final name (atomic on
  POSIX filesystems and NFS). A reader never sees a partial file; a writer killed mid-write leaves only a temporary
  file, removed by the next quota sweep once it is old. Two writers of the same chunk both rename complete, identical
  files: the last rename wins and one valid file remains.
- **Reads** verify the header and checksum (``chunkfile.decode``); a file that fails is a miss and is removed.
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
import threading
import time

from preheat.kv import chunkfile
from preheat.kv.chunk import StoredChunk
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
    ) -> None:
        self.root = os.path.abspath(root)
        self.expect = expect
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self.health = Health("l2 " + self.describe(), retry_s)
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
            with open(path, "rb", buffering=0) as handle:
                size = os.fstat(handle.fileno()).st_size
                blob = bytearray(size)
                got = handle.readinto(blob)
            if got != size:
                raise chunkfile.CorruptChunkError(f"chunk {key}: read {got} of {size} bytes")
            chunk = chunkfile.decode(blob, key, self.expect)
        except FileNotFoundError:
            self.stats.add(misses=1)
            return None
        except chunkfile.CorruptChunkError as exc:
            log.warning("KV L2: %s; removing %s", exc, path)
            self._remove(path, key)
            self.stats.add(misses=1, corrupt=1)
            return None
        except OSError as exc:
            self.stats.add(misses=1, errors=1)
            self._failed(exc)
            return None
        self.stats.hit(size, time.perf_counter() - start)
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the cross-process LRU sweep
        return chunk

    def put(self, key: str, chunk: StoredChunk) -> bool:
        if not self._usable():
            return False
        path = self.path(key)
        if os.path.exists(path):
            with contextlib.suppress(OSError):
                os.utime(path)
            return True
        pieces = chunkfile.encode(key, self.expect.fingerprint, chunk)
        temp = os.path.join(os.path.dirname(path), f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(temp, "wb") as handle:
                handle.writelines(pieces)
            os.rename(temp, path)
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
        for path, stat in _walk(os.path.join(self.root, "v1")):
            if path.endswith(".tmp"):
                if now - stat.st_mtime > STALE_TEMP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                continue
            if not path.endswith(SUFFIX):
                continue  # the sweep lock, probes
            files.append((stat.st_mtime, stat.st_size, path))
            total += stat.st_size
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
        found = [(stat.st_mtime, path) for path, stat in _walk(self.dir) if path.endswith(SUFFIX)]
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
