"""The weights vLLM is handed: full tensors lazily mapped by ``preheat.load``, checked before the hand-off.

vLLM's parameter loaders narrow each full tensor to their rank's shard themselves (``weight_loader`` of its parallel
layers), so a rank is handed every tensor whole, as views of a private mapping, and only the pages it copies from are
read. With ``world_size > 1`` kernel read-around is switched off on the mappings (it would fetch other ranks' bytes)
and the rank's own pages, as preheat's TP plan cuts them (docs/loader.md), are requested at once, asynchronously.
A ``preheat convert --tp N`` checkpoint is read rank-locally instead: rank r maps only its own files, and each split
tensor is handed over as its slice dressed as the full tensor (``sharded.py``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from preheat.checkpoint.layout import Checkpoint, open_checkpoint, read_manifest
from preheat.core.errors import ConfigError
from preheat.integrations.vllm.options import LoadOptions
from preheat.integrations.vllm.sharded import Split, check_engine_cut, dress, rank_splits
from preheat.io.buffers import PAGE, populate_read, round_down, round_up
from preheat.io.reads import plan_ops
from preheat.loader.load import LoadResult, load, plan_file

log = logging.getLogger("preheat.vllm")


@dataclass
class Prepared:
    """A checkpoint ready to hand over: every tensor by name in file order, and what the load did."""

    tensors: LoadResult
    checkpoint: Checkpoint
    mode: str
    verify: bool | None
    notes: list[str] = field(default_factory=list)
    # A pre-sharded checkpoint's split tensors: where this rank's slice sits in each (empty when unsharded).
    splits: dict[str, Split] = field(default_factory=dict)
    # Pages being faulted in behind the hand-off's back (advise_pages): finish() waits for it.
    prefault: Prefault | None = None

    def finish(self) -> None:
        """Wait for the background prefault (at once, its queue dropped, if the hand-off stopped early): no thread
        may touch the mappings once they are let go."""
        if self.prefault is not None:
            self.prefault.join()

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor once, in the files' order (what vLLM's own iterators do), then any the headers do not list
        (a dequantized checkpoint's restored weights replace their int8/fp8 originals under the same names)."""
        listed = set()
        for _, entry in self.checkpoint.entries():
            listed.add(entry.name)
            tensor = self.tensors.get(entry.name)
            if tensor is not None:
                yield entry.name, dress(entry.name, tensor, self.splits)
        for name, tensor in self.tensors.items():
            if name not in listed:
                yield name, dress(name, tensor, self.splits)


def prepare(path: str, options: LoadOptions, *, rank: int = 0, world_size: int = 1) -> Prepared:
    """Map (or read) the checkpoint at ``path`` (rank ``rank``'s files of a pre-sharded one) and check it as
    ``options.verify`` says; nothing is returned unless every check passed. Raises ``CheckpointError`` (a tensor that
    does not match its digest, a header that does not match the manifest, a file that is not safetensors) or
    ``ConfigError`` (a pre-sharded checkpoint for another TP world size, or one vLLM's layers would cut otherwise)."""
    manifest = read_manifest(path)
    mode = "mmap" if options.mode == "auto" else options.mode
    if manifest is not None and manifest.tp_world_size > 1:
        return _prepare_presharded(path, options, mode, manifest.tp_world_size, rank=rank, world_size=world_size)
    checkpoint = open_checkpoint(path)  # headers only; checked against preheat.json when there is one
    # verify None is preheat.load's own local rule (docs/loader.md): a mapping is not hashed (the header check above
    # still runs; a pulled source was checked byte for byte by the node cache), bytes read into memory are.
    tensors = load(path, "cpu", mode=mode, threads=options.threads, verify=options.verify, dequantize=True)
    prepared = Prepared(tensors, checkpoint, mode, options.verify, list(tensors.report.notes))
    if mode == "mmap":
        prepared.prefault = advise_pages(prepared, rank=rank, world_size=world_size, threads=options.threads)
    return prepared


def _prepare_presharded(
    path: str, options: LoadOptions, mode: str, parts: int, *, rank: int, world_size: int
) -> Prepared:
    """Rank ``rank`` of a ``preheat convert --tp N`` checkpoint: only its own files are opened, mapped, checked
    (``verify: true`` hashes them: the rank's bytes alone, since its files have their own digests) and faulted in."""
    check_presharded_world(path, parts, world_size)
    checkpoint = open_checkpoint(path, rank=rank, world_size=world_size)  # this rank's headers, against the manifest
    assert checkpoint.manifest is not None  # a pre-sharded checkpoint is one because of its manifest
    check_engine_cut(checkpoint.manifest, world_size, path)
    tensors = load(
        path,
        "cpu",
        rank=rank,
        world_size=world_size,
        mode=mode,
        threads=options.threads,
        verify=options.verify,
        dequantize=True,
    )
    splits = rank_splits(checkpoint.manifest, rank)
    prepared = Prepared(tensors, checkpoint, mode, options.verify, list(tensors.report.notes), splits)
    if mode == "mmap":  # the rank's files hold its bytes only: fault all of them in
        prepared.prefault = advise_pages(prepared, rank=0, world_size=1, threads=options.threads)
    return prepared


def check_presharded_world(path: str, parts: int, world_size: int) -> None:
    """Refuse a ``preheat convert --tp PARTS`` checkpoint served with another tensor-parallel size."""
    if world_size != parts:
        raise ConfigError(
            f"{path} was pre-sharded with `preheat convert --tp {parts}` and vLLM runs with tensor parallel size "
            f"{world_size}: serve it with --tensor-parallel-size {parts}, or convert the model again with "
            f"--tp {world_size} (or without --tp: any TP size then reads only its own pages)"
        )


def advise_pages(prepared: Prepared, *, rank: int, world_size: int, threads: int | None = None) -> Prefault | None:
    """Ask for the pages rank ``rank`` will copy from, now and in large asynchronous reads; with TP, turn read-around
    off first, so that faults outside them fetch single pages, not the neighbours other ranks own. A rank that copies
    every page (TP 1, a pre-sharded rank's own files) has them faulted in by ``threads`` threads, in file order, in the
    background (the returned ``Prefault``): vLLM's single-threaded copy starts at once and follows them, finding the
    pages mapped, so a cold load costs about the reads alone instead of the reads and then the copy (measured here:
    one thread reads a cold file at 0.3-0.4 GB/s, eight at ~1 GB/s). Not when the file is already in the page
    cache, where there is nothing to read and mapping the pages first would be the copy's work."""
    chunks: list[tuple[int, int]] = []
    for file in prepared.checkpoint.files:
        first = next((prepared.tensors.get(e.name) for e in file.header.tensors), None)
        if first is None or first.device.type != "cpu":
            continue
        storage = first.untyped_storage()
        base, length = storage.data_ptr(), storage.nbytes()
        if base % PAGE or length < file.header.data_end:
            continue  # not this file's mapping (a dequantized copy): nothing to advise
        if world_size == 1:
            if _resident(base, length) >= WARM:
                continue  # nothing to read: mapping the pages is the copy's work either way, done as it goes
            _madvise(base, length, mmap.MADV_WILLNEED)
            chunks += [(base + at, min(PREFAULT_CHUNK, length - at)) for at in range(0, length, PREFAULT_CHUNK)]
            continue
        _madvise(base, length, mmap.MADV_RANDOM)
        plan = plan_file(file, "auto", rank, world_size, align_base=1)
        for op in plan_ops(plan.extents, chunk_bytes=64 * 1024 * 1024):
            start = round_down(op.file_offset, PAGE)
            end = min(round_up(op.file_offset + op.length, PAGE), length)
            if end > start:
                _madvise(base + start, end - start, mmap.MADV_WILLNEED)
    if not chunks:
        return None
    # Faulting is I/O-bound when cold: as many threads as preheat.load's digest pass (8), not one per core.
    return Prefault(chunks, max(1, min(threads or PREFAULT_THREADS, len(chunks))))


class Prefault:
    """``MADV_POPULATE_READ`` over ``chunks`` (address, length) by ``workers`` threads, in order, in the background."""

    def __init__(self, chunks: list[tuple[int, int]], workers: int) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="preheat-prefault")
        for address, length in chunks:
            self._pool.submit(_populate, address, length)

    def join(self) -> None:
        """Wait for the chunks under way; the ones not started are dropped (the copy faults what it still needs)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _populate(address: int, length: int) -> None:
    # io.buffers.populate_read: MADV_POPULATE_READ (Linux 5.14) through ctypes, the GIL released, so the prefault
    # threads run in parallel. An older kernel refuses it and the pages come in on vLLM's faults after the
    # MADV_WILLNEED read-ahead, as before.
    if not populate_read(address, length):
        log.debug("MADV_POPULATE_READ of %#x (%d bytes) refused; vLLM's copy faults these pages in", address, length)


_LIBC = ctypes.CDLL(None, use_errno=True)  # madvise/mincore; CDLL calls release the GIL
PREFAULT_CHUNK = 16 * 1024 * 1024
PREFAULT_THREADS = 8
WARM = 0.9  # a file this much in the page cache is not prefaulted


def _resident(address: int, length: int, samples: int = 64, window: int = 16) -> float:
    """Fraction of sampled pages of [address, address + length) in the page cache (mincore(2) over ``samples``
    windows of ``window`` pages: the whole range would cost ~70 ms per GB of page-cache lookups); 0.0 if unknown."""
    vector = (ctypes.c_ubyte * window)()
    seen = resident = 0
    for i in range(samples):
        start = round_down(i * length // samples, PAGE)
        size = min(window * PAGE, length - start)
        if size <= 0 or _LIBC.mincore(ctypes.c_void_p(address + start), ctypes.c_size_t(size), vector) != 0:
            continue
        pages = -(-size // PAGE)
        seen += pages
        resident += pages - bytes(vector)[:pages].count(0)  # bit 0 is residency; the others are reserved (zero)
    return resident / seen if seen else 0.0


def _madvise(address: int, length: int, advice: int) -> None:
    """madvise(2) on memory ``torch`` holds (Python's ``mmap.madvise`` needs the mmap object, which the tensors own).
    Advice is a hint: a failure is logged, never fatal."""
    if _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(advice)) != 0:
        errno = ctypes.get_errno()
        log.debug("madvise(%#x, %d, %d) failed: %s", address, length, advice, os.strerror(errno))


def read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage (``/proc/self/io`` ``read_bytes``), or None."""
    try:
        with open("/proc/self/io", encoding="ascii") as io:
            for line in io:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
