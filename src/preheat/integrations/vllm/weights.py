"""The weights vLLM is handed: full tensors lazily mapped by ``preheat.load``, checked before the hand-off.

vLLM's parameter loaders narrow each full tensor to their rank's shard themselves (``weight_loader`` of its parallel
layers), so a rank is handed every tensor whole, as views of a private mapping, and only the pages it copies from are
read. With ``world_size > 1`` kernel read-around is switched off on the mappings (it would fetch other ranks' bytes)
and the rank's own pages, as preheat's TP plan cuts them (docs/loader.md), are requested at once, asynchronously.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from preheat.checkpoint.layout import Checkpoint, open_checkpoint, read_manifest
from preheat.errors import ConfigError
from preheat.integrations.vllm.options import LOAD_FORMAT, LoadOptions
from preheat.io.buffers import PAGE, round_down, round_up
from preheat.io.reads import plan_ops
from preheat.loader import LoadResult, load, plan_file

log = logging.getLogger("preheat.vllm")


@dataclass
class Prepared:
    """A checkpoint ready to hand over: every tensor by name in file order, and what the load did."""

    tensors: LoadResult
    checkpoint: Checkpoint
    mode: str
    verify: bool | None
    notes: list[str] = field(default_factory=list)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor once, in the files' order (what vLLM's own iterators do), then any the headers do not list
        (a dequantized checkpoint's restored weights replace their int8/fp8 originals under the same names)."""
        listed = set()
        for _, entry in self.checkpoint.entries():
            listed.add(entry.name)
            tensor = self.tensors.get(entry.name)
            if tensor is not None:
                yield entry.name, tensor
        for name, tensor in self.tensors.items():
            if name not in listed:
                yield name, tensor


def verify_rule(verify: bool | None, *, has_manifest: bool, world_size: int) -> bool | None:
    """What ``preheat.load`` is asked to check. Default: hash every tensor before the hand-off when there is a
    ``preheat.json`` and the rank reads the whole checkpoint; a TP rank keeps its reads to its own pages and relies on
    the headers' check against the manifest (and on the node cache having checked every file when it published)."""
    if verify is not None:
        return verify
    if has_manifest and world_size == 1:
        return True
    return None  # preheat's local rule: a mapping is not hashed


def prepare(path: str, options: LoadOptions, *, rank: int = 0, world_size: int = 1) -> Prepared:
    """Map (or read) the checkpoint at ``path`` and check it as ``options.verify`` says; nothing is returned unless
    every check passed. Raises ``CheckpointError`` (a tensor that does not match its digest, a header that does not
    match the manifest, a file that is not safetensors) or ``ConfigError`` (a ``preheat convert --tp`` checkpoint)."""
    manifest = read_manifest(path)
    if manifest is not None and manifest.tp_world_size > 1:
        raise ConfigError(
            f"{path} was pre-sharded with `preheat convert --tp {manifest.tp_world_size}`: vLLM's parameter loaders "
            f"shard full tensors themselves, and --load-format {LOAD_FORMAT} does not map preheat's rank files onto "
            "vLLM's fused parameters; convert the model without --tp (vLLM ranks then read only their own pages)"
        )
    checkpoint = open_checkpoint(path)  # headers only; checked against preheat.json when there is one
    mode = "mmap" if options.mode == "auto" else options.mode
    verify = verify_rule(options.verify, has_manifest=manifest is not None, world_size=world_size)
    tensors = load(path, "cpu", mode=mode, threads=options.threads, verify=verify, dequantize=True)
    prepared = Prepared(tensors, checkpoint, mode, verify, list(tensors.report.notes))
    if mode == "mmap":
        advise_pages(prepared, rank=rank, world_size=world_size)
    return prepared


def advise_pages(prepared: Prepared, *, rank: int, world_size: int) -> None:
    """Ask for the pages rank ``rank`` will copy from, now and in large asynchronous reads; with TP, turn read-around
    off first, so that faults outside them fetch single pages, not the neighbours other ranks own."""
    for file in prepared.checkpoint.files:
        first = next((prepared.tensors.get(e.name) for e in file.header.tensors), None)
        if first is None or first.device.type != "cpu":
            continue
        storage = first.untyped_storage()
        base, length = storage.data_ptr(), storage.nbytes()
        if base % PAGE or length < file.header.data_end:
            continue  # not this file's mapping (a dequantized copy): nothing to advise
        if world_size == 1:
            _madvise(base, length, mmap.MADV_WILLNEED)
            continue
        _madvise(base, length, mmap.MADV_RANDOM)
        plan = plan_file(file, "auto", rank, world_size, align_base=1)
        for op in plan_ops(plan.extents, chunk_bytes=64 * 1024 * 1024):
            start = round_down(op.file_offset, PAGE)
            end = min(round_up(op.file_offset + op.length, PAGE), length)
            if end > start:
                _madvise(base + start, end - start, mmap.MADV_WILLNEED)


_LIBC = ctypes.CDLL(None, use_errno=True)


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
