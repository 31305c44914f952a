"""Write-through: a checkpoint streamed from a remote origin into memory is also saved into the node-local cache.

The load never waits for the cache: a background thread runs the store's one download path
(``preheat.store.pull.download``) with the load's buffers as a source of pieces and the origin as the fallback for
the bytes they do not hold (headers, small files, bytes after the last tensor). So write-through journals, resumes,
verifies every file and publishes exactly as a pull does, and fails the same way (``CacheError`` for a full disk).
Any failure degrades to "not cached" with a warning; the loaded tensors are unaffected. Only whole-file loads write
through (a TP rank holds slices, not files).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from preheat.core.errors import PreheatError, SourceError, SourceNotFoundError
from preheat.io.buffers import as_memoryview
from preheat.sources.base import Source
from preheat.sources.open import open_origin
from preheat.store import locks
from preheat.store.cache import ModelCache
from preheat.store.fetch import PieceSource
from preheat.store.pieces import Piece, plan_chunks
from preheat.store.pull import MiB, download, origin_key, plan_files

log = logging.getLogger("preheat.cache")


@dataclass(frozen=True)
class LoadedFile:
    """A remote file whose data region ``[data_start, data_end)`` sits in ``buffer`` (a CPU uint8 tensor)."""

    name: str
    size: int
    data_start: int
    data_end: int
    buffer: torch.Tensor


def start_write_through(cache: ModelCache, uri: str, files: Sequence[LoadedFile]) -> threading.Thread:
    """Save ``files`` (and the rest of the checkpoint's small files) from ``uri`` into ``cache`` in the background.

    The thread is not a daemon: a short script that loads and exits still finishes filling the cache.
    """
    thread = threading.Thread(target=_safely, args=(cache, uri, list(files)), name="preheat-write-through")
    thread.start()
    return thread


def _safely(cache: ModelCache, uri: str, files: list[LoadedFile]) -> None:
    try:
        key = write_through(cache, uri, files)
        if key:
            log.info("cached %s as %s", uri, key)
    except (PreheatError, OSError) as exc:
        log.warning("could not write %s through to the cache at %s: %s", uri, cache.root, exc)


def write_through(
    cache: ModelCache, uri: str, files: Sequence[LoadedFile], *, chunk_bytes: int = 16 * MiB
) -> str | None:
    """Do the write-through now; returns the published key, or None when another process owns this entry."""
    cache.ensure_dirs()
    origin = open_origin(uri)
    key, manifest = origin_key(origin)
    if cache.lookup(key) is not None:
        return None
    held = locks.try_exclusive(cache.lock_path(key, "pull"))
    if held is None:
        return None  # a pull of the same checkpoint is running; it will publish the entry
    try:
        if cache.lookup(key) is not None:
            return None
        large, small = plan_files(origin, manifest)
        loaded = {f.name: f for f in files if f.name in {r.name for r in large}}
        plan = plan_chunks(large, chunk_bytes, {f.name: (f.data_start, f.data_end) for f in loaded.values()})
        buffers = LoadBuffers(uri, loaded)
        sources = [
            PieceSource("load buffers", buffers, streams=4, holds=buffers.holds),
            PieceSource("origin", origin, streams=4, fallback=True),
        ]
        download(cache, key, uri, plan, sources, manifest=manifest, small=small, small_from=origin)
        return key
    finally:
        os.close(held)


class LoadBuffers:
    """The data regions of loaded files, as an origin of pieces: ``holds`` says which pieces lie inside them."""

    def __init__(self, uri: str, files: Mapping[str, LoadedFile]) -> None:
        self._uri, self._files = uri, dict(files)

    @property
    def uri(self) -> str:
        return f"{self._uri} (load buffers)"

    def join(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def holds(self, piece: Piece) -> bool:
        f = self._files.get(piece.file)
        return f is not None and f.data_start <= piece.offset and piece.offset + piece.length <= f.data_end

    def exists(self, name: str) -> bool:
        return name in self._files

    def read_bytes(self, name: str) -> bytes:
        raise SourceNotFoundError(f"{self.join(name)}: the load buffers hold tensor data only")

    def open(self, name: str) -> Source:
        if name not in self._files:
            raise SourceNotFoundError(f"{self.join(name)}: not loaded")
        return _BufferSource(self.join(name), self._files[name])


class _BufferSource:
    """One loaded file's data region, readable at the file's own offsets."""

    def __init__(self, name: str, file: LoadedFile) -> None:
        self._name, self._file = name, file
        self._view = as_memoryview(file.buffer)[: file.data_end - file.data_start]

    @property
    def name(self) -> str:
        return self._name

    def size(self) -> int:
        return self._file.size

    def readv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        at = offset - self._file.data_start
        if at < 0:
            raise SourceError(f"{self._name}: bytes before {self._file.data_start} are not in the load buffers")
        done = 0
        for buffer in buffers:
            chunk = self._view[at + done : at + done + len(buffer)]
            buffer[: len(chunk)] = chunk
            done += len(chunk)
            if len(chunk) < len(buffer):
                break
        return done

    def close(self) -> None:
        pass
