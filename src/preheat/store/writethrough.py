"""Write-through: a checkpoint streamed from a remote origin into memory is also saved into the node-local cache.

The load never waits for the cache: the bytes already in the load buffers are written out by a background thread,
the headers and any small files (config, tokenizer, manifest) are fetched again, every file is verified like a pull
verifies it, and only then is the entry published. Any failure degrades to "not cached" with a warning; the loaded
tensors are unaffected. Only whole-file loads write through (a TP rank holds slices, not files).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from preheat.checkpoint import manifest as mf
from preheat.errors import PreheatError
from preheat.io.buffers import as_memoryview
from preheat.io.reads import read_at_least
from preheat.sources.base import Origin, open_origin
from preheat.store import locks
from preheat.store.cache import ModelCache
from preheat.store.pull import RemoteFile, _describe, _plan_files, _verify, _write_small, origin_key

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


def write_through(cache: ModelCache, uri: str, files: Sequence[LoadedFile]) -> str | None:
    """Do the write-through now; returns the published key, or None when another process owns this entry."""
    cache.ensure_dirs()
    origin = open_origin(uri)
    key, manifest = origin_key(origin)
    if cache.lookup(key) is not None:
        return None
    held = locks.try_exclusive(cache.lock_path(key, "pull"))
    if held is None:
        return None  # a pull of the same checkpoint is running; it will publish the entry
    partial = cache.partial_dir(key)
    try:
        if cache.lookup(key) is not None:
            return None
        shutil.rmtree(partial, ignore_errors=True)  # a stale attempt: we hold the lock, nobody else writes here
        os.makedirs(partial)
        large, small = _plan_files(origin, manifest)
        loaded = {f.name: f for f in files}
        for remote in large:
            if remote.name in loaded:
                _write_loaded(partial, origin, loaded[remote.name])
            else:
                _write_small(partial, remote.name, origin.read_bytes(remote.name))
        for name in small:
            _write_small(partial, name, origin.read_bytes(name))
        _verify(partial, [RemoteFile(r.name, r.size, r.digest) for r in large], manifest, os.path.join(partial, ".j"))
        if manifest is None:
            _describe(partial)
        else:
            _write_small(partial, mf.MANIFEST_NAME, manifest.to_json())
        cache.publish(key, uri)
        return key
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        os.close(held)


def _write_loaded(partial: str, origin: Origin, file: LoadedFile) -> None:
    path = os.path.join(partial, file.name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    source = origin.open(file.name)
    try:
        head = bytearray(file.data_start)
        read_at_least(source, memoryview(head), 0, len(head), path=origin.join(file.name))
        with open(path, "wb") as out:
            out.write(head)
            out.write(as_memoryview(file.buffer)[: file.data_end - file.data_start])
            if file.size > file.data_end:  # bytes after the last tensor (unusual, but part of the file)
                tail = bytearray(file.size - file.data_end)
                read_at_least(source, memoryview(tail), file.data_end, len(tail), path=origin.join(file.name))
                out.write(tail)
    finally:
        source.close()
