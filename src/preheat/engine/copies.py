"""A checkpoint's weights converted to the compute dtype, kept in the node cache for the next start on the node.

Where the engine computes a 16-bit checkpoint in float32 (bf16 on a CPU without AVX512-BF16 or AMX, fp16 on any CPU:
docs/engine.md, *Weights and dtype*), a load converts every weight into fresh memory. The conversion itself is cheap;
the fresh memory is not: SmolLM2's 538 MB of float32 are 131,000 page faults, ~0.3 s of CPU on the 2-core benchmark
VM when quiet and seconds when it is busy (the host backs a VM's fresh pages at first touch), paid again by every
start, activation and wake. So the first load on a node that converts also writes the converted weights, in a process
of its own and from the checkpoint's files (not from the live model, which a refit may change), into a node-cache
entry keyed by the checkpoint's identity and the dtype (``copy_key``); the entry is published as every entry is
(fsynced, then renamed into ``models/``). Every later load on the node maps that copy instead, as it would a float32
checkpoint: no conversion, the pages shared with every replica through the page cache, unmapped by a sleep.

The copy holds exactly what the conversion computes (the loaded, dequantized tensors, converted as
``tensor.to(dtype)`` converts them), so a replica serving from it answers bitwise as one that converted. Only
checkpoints with a ``preheat.json`` identity get one (nothing else names their bytes), and a cache that cannot be
written degrades to converting at every load: a cache failure is a miss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preheat.checkpoint.safetensors import encode_header
from preheat.core.errors import PreheatError
from preheat.io.buffers import as_memoryview, mapped_buffer
from preheat.kv.fileio import write_all
from preheat.store import locks
from preheat.store.cache import EntryMeta, Lease, ModelCache

if TYPE_CHECKING:  # torch is imported by what converts: the writer's process imports it only once it starts work
    import torch

log = logging.getLogger("preheat.engine")

FORMAT = 1  # in every key: a change to what a copy holds or how it is laid out makes new keys, never a stale hit
COPY_FILE = "model.safetensors"
CHUNK_BYTES = 16 << 20  # converted bytes staged per write: bounds the writer's memory whatever the tensor's size
# Seconds the writer's process waits before it starts (importing torch, ~1 s of a core; converting; writing 538 MB
# for SmolLM2): niced, it would still take the replica's idle core, memory bandwidth and the disk, and the requests
# right after a start are the ones a fast start is for.
WRITE_AFTER_S = 5.0


def copy_key(identity: str, dtype: torch.dtype | str) -> str:
    """The node-cache key of ``identity``'s weights converted to ``dtype`` (a torch dtype or its name).

    >>> import torch
    >>> copy_key("xxh3-128:0123", torch.float32)
    'xxh3-128:0123-float32-copy1'
    """
    return f"{identity}-{str(dtype).removeprefix('torch.')}-copy{FORMAT}"


@dataclass
class Copy:
    """A published copy, and the lease that keeps the node cache from evicting it while a model maps it."""

    path: str
    lease: Lease


def find(cache: ModelCache, identity: str, dtype: torch.dtype) -> Copy | None:
    """The copy of ``identity`` in ``dtype``, leased, or None. Looked up again once leased: a gc that removed it
    in between must not leave a load mapping what is gone."""
    key = copy_key(identity, dtype)
    if cache.lookup(key) is None:
        return None
    try:
        lease = cache.lease(key)
    except PreheatError as exc:  # its lock cannot be taken (a read-only cache): convert, as without a copy
        log.info("converted copy %s: cannot lease it (%s)", key, exc)
        return None
    path = cache.lookup(key)
    if path is None:
        lease.close()
        return None
    return Copy(path, lease)


class CopyWriter:
    """Writes one copy in a process of its own (``python -m preheat.engine.copies``), at the lowest priority, one
    thread, its own session, ``WRITE_AFTER_S`` after the load: it must not slow this replica's first requests (a
    niced thread of the server could: CPython's thread that drops the GIL for another waits until that one runs),
    it keeps no memory in the replica (a sleep measures the replica's), and it finishes when the replica exits
    first. ``wait`` for it where its result matters (tests)."""

    def __init__(self, cache: ModelCache, identity: str, *, root: str, dtype: torch.dtype) -> None:
        self.key = copy_key(identity, dtype)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, root, cache.root, identity, str(dtype).removeprefix("torch.")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # its one line of log goes to stderr, the replica's
            start_new_session=True,  # not signalled with the replica: a copy half written helps no one
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the writer is done (published, or given up) within ``timeout`` seconds."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def write_copy(cache: ModelCache, identity: str, *, root: str, dtype: torch.dtype) -> str | None:
    """Write the copy of checkpoint ``root`` in ``dtype`` into ``cache`` and publish it; its directory, or None when
    another process is writing it or the checkpoint is gone. Raises ``OSError`` or ``PreheatError`` when it cannot be
    written."""
    key = copy_key(identity, dtype)
    if not os.path.isdir(root):
        return None  # the checkpoint went while the writer waited (a temporary cache's entry): nothing to keep
    cache.ensure_dirs()
    held = locks.try_exclusive(cache.lock_path(key, "pull"))
    if held is None:
        return None
    try:
        found = cache.lookup(key)
        if found is not None:
            return found
        partial = cache.partial_dir(key)
        shutil.rmtree(partial, ignore_errors=True)  # a writer killed before it published (we hold its lock)
        os.makedirs(partial)
        _write_file(root, os.path.join(partial, COPY_FILE), dtype)
        name = str(dtype).removeprefix("torch.")
        with open(os.path.join(partial, "source.json"), "w", encoding="utf-8") as handle:
            json.dump({"identity": identity, "dtype": name, "root": root}, handle)
        meta = EntryMeta.read(root)  # the source is itself a node-cache entry: the copy is named after it
        source = meta.name if meta else os.path.basename(os.path.normpath(root))
        # Its own name and URI, so that neither a lookup by name nor a pull by URI ever finds it for the source.
        return cache.publish(key, f"{root}#{name}", name=f"{source} ({name} copy)")
    finally:
        os.close(held)


def _write_file(root: str, path: str, dtype: torch.dtype) -> None:
    """Every tensor of checkpoint ``root`` as the engine loads it (mapped, dequantized), converted to ``dtype``,
    into one safetensors file at ``path``; staged ``CHUNK_BYTES`` at a time, so the writer never holds a model's
    worth of converted memory beside the one that serves."""
    import torch

    from preheat.checkpoint import torch_dtypes
    from preheat.loader.load import load

    weights = load(root, torch.device("cpu"), mode="mmap", dequantize=True)
    tensors = dict(weights.items())
    if not all(t.is_floating_point() for t in tensors.values()):
        raise PreheatError(f"{root}: has tensors that are not floating point; no converted copy is kept for it")
    itemsize = torch.empty((), dtype=dtype).element_size()
    code = torch_dtypes.from_torch(dtype)
    header = encode_header({n: (code, tuple(t.shape), t.numel() * itemsize) for n, t in tensors.items()})
    staging = mapped_buffer(CHUNK_BYTES)
    per_chunk = CHUNK_BYTES // itemsize
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        total = len(header) + sum(t.numel() * itemsize for t in tensors.values())
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, total)  # a full disk fails here, before anything is converted
        write_all(fd, [header])
        for tensor in tensors.values():
            flat = tensor.reshape(-1)
            for start in range(0, flat.numel(), per_chunk):
                part = flat[start : start + per_chunk]
                staged = staging[: part.numel() * itemsize]
                staged.view(dtype).copy_(part)
                write_all(fd, [as_memoryview(staged)])
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    """``python -m preheat.engine.copies ROOT CACHE IDENTITY DTYPE``: what ``CopyWriter`` runs."""
    root, cache_root, identity, dtype_name = argv
    with contextlib.suppress(OSError):
        os.nice(19)
    time.sleep(WRITE_AFTER_S)
    cache = ModelCache(cache_root)
    if not os.path.isdir(root) or cache.lookup(copy_key(identity, dtype_name)) is not None:
        return 0  # gone (a temporary cache's entry), or another replica wrote it meanwhile: done, torch never imported
    import torch

    torch.set_num_threads(1)  # the replica's cores are for its requests
    logging.basicConfig(level=logging.WARNING, format="preheat copy: %(message)s")
    log.setLevel(logging.INFO)  # its own outcome, in one line; the loader's report stays out of the replica's log
    started = time.monotonic()
    try:
        path = write_copy(cache, identity, root=root, dtype=getattr(torch, dtype_name))
    except (OSError, PreheatError) as exc:  # a full disk, an unwritable cache: loads convert, as without a copy
        log.warning("%s: no converted copy kept in the node cache (%s); loads convert as before", root, exc)
        return 1
    if path is not None:
        log.info("%s: converted copy kept in %s (%.1f s)", root, path, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
