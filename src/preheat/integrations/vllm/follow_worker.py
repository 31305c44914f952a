"""The worker side of a vLLM replica that follows a refit name: a worker extension, mixed into vLLM's worker by
``--worker-extension-cls preheat.integrations.vllm.follow_worker.RefitWorker`` (``LLM(worker_extension_cls=...)``)
and called through ``collective_rpc``, which vLLM's engine core runs between two engine steps.

``preheat_refit_install(path, index)``: every rank reads the staged tensors (``follow_plan.Staged``) from the file
the replica's follower wrote, checks each against its digest, and hands them to vLLM's own ``reload_weights``, the
model's ``load_weights`` under vLLM's layerwise reload: fused q/k/v and gate/up are loaded as vLLM loads them, each
TP rank keeps its shard, and a layer's kernel form (oneDNN packing on a CPU) is rebuilt once its weights are in.
Nothing of vLLM is patched.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, cast

import torch

from preheat.checkpoint.digest import digest_bytes
from preheat.checkpoint.torch_dtypes import to_torch
from preheat.core.errors import VerificationError
from preheat.integrations.vllm.follow_plan import Staged

log = logging.getLogger("preheat.vllm")
# vLLM's reload warns about every layer a partial reload leaves as it was ("Failed to load weights") and lists
# every weight not given: for a refit that installs only what changed, both are the expected case.
_QUIET = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")


class _Worker(Protocol):
    """What the extension uses of vLLM's worker (``vllm.v1.worker.gpu_worker.Worker`` and the CPU worker)."""

    model_runner: object
    rank: int

    def reload_weights(
        self, *, weights_iterator: Iterator[tuple[str, torch.Tensor]], is_checkpoint_format: bool
    ) -> None: ...


class RefitWorker:
    """vLLM worker extension: install a refit version's staged tensors (see the module docstring)."""

    def preheat_refit_layout(self) -> dict[str, list[str]]:
        """The model's ``packed_modules_mapping``: which checkpoint modules vLLM fuses into one (``follow_plan``)."""
        worker = cast(_Worker, self)
        get_model = getattr(worker.model_runner, "get_model", None)
        model = get_model() if callable(get_model) else getattr(worker.model_runner, "model", None)
        packed = getattr(model, "packed_modules_mapping", None) or {}
        return {str(k): [str(p) for p in v] for k, v in dict(packed).items()}

    def preheat_refit_install(self, path: str, index: list[object]) -> dict[str, int]:
        """Check and load the tensors of ``index`` from ``path``; the count and bytes installed by this rank."""
        worker = cast(_Worker, self)
        staged = [Staged.from_wire(item) for item in index]
        with _mapped(path) as data:
            tensors = [(s.name, _checked(data, s, path)) for s in staged]
            with _quiet():
                worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        nbytes = sum(s.nbytes for s in staged)
        log.info("preheat: refit installed %d tensors (%d bytes) on rank %s", len(staged), nbytes, worker.rank)
        return {"tensors": len(staged), "bytes": nbytes, "rank": int(worker.rank)}


def _checked(data: memoryview, staged: Staged, path: str) -> torch.Tensor:
    """The staged bytes as a tensor (a copy: the file is unmapped after the install), if they match the digest."""
    with data[staged.offset : staged.offset + staged.nbytes] as raw:  # released: the file is unmapped after this
        if len(raw) != staged.nbytes or digest_bytes(raw) != staged.digest:
            raise VerificationError(f"{path}: staged tensor {staged.name} does not match its digest {staged.digest}")
        copy = bytearray(raw)
    dtype = to_torch(staged.dtype)
    if not staged.nbytes:
        return torch.empty(staged.shape, dtype=dtype)
    return torch.frombuffer(copy, dtype=dtype).reshape(staged.shape)


@contextmanager
def _mapped(path: str) -> Iterator[memoryview]:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                yield view
            finally:
                view.release()
    finally:
        os.close(fd)


@contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _QUIET]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
