"""Tensor-parallel plans: which dimension of each tensor is split across ranks, and which bytes rank r needs.

Built-in plan ("auto") for Llama, Mistral and Qwen2-style names (Megatron layout):
- column-parallel, split on dim 0: ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` (weights, biases,
  and the ``.weight.scale`` of a quantized weight, per row or per group, which must follow its rows);
- row-parallel, split on dim 1: ``o_proj``, ``down_proj`` weights, and their ``.weight.scale`` when it is 2-D (fp8's
  ``[out, in / 32]`` group scales follow the columns they scale); a 1-D per-row scale (int8) belongs to every column,
  so it is replicated, as are their biases, if any;
- vocabulary-parallel, split on dim 0: ``embed_tokens`` and ``lm_head``;
- everything else (norms, rotary buffers) is replicated.
A split dimension must divide evenly, except the vocabulary, which is cut in ceil(V / W)-row blocks (the last rank
gets the remainder), as vLLM's vocab-parallel embedding does before padding. For a group scale that means each rank's
share of the weight's columns is a whole number of groups.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from preheat.checkpoint import dtypes
from preheat.checkpoint.safetensors import TensorEntry
from preheat.core.errors import CheckpointError, ConfigError

TPPlan = str | Mapping[str, int | None]

_AUTO_RULES: tuple[tuple[re.Pattern[str], int | None], ...] = (
    (re.compile(r"(^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias|weight\.scale)$"), 0),
    (re.compile(r"(^|\.)(o_proj|down_proj)\.weight$"), 1),
    (re.compile(r"(^|\.)(embed_tokens\.weight|lm_head\.weight)$"), 0),
)
_ROW_PARALLEL_SCALE = re.compile(r"(^|\.)(o_proj|down_proj)\.weight\.scale$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class Slice:
    """Rank's part of one tensor: the shape it gets and the file byte runs ``(offset, length)`` that hold it."""

    shape: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]
    dim: int | None
    start: int = 0  # first index along ``dim`` that belongs to the rank

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.runs)


def split_dim(name: str, plan: TPPlan, *, ndim: int) -> int | None:
    """The dimension ``plan`` splits tensor ``name`` (of ``ndim`` dimensions) on, or None when it is replicated."""
    if isinstance(plan, str):
        if plan != "auto":
            raise ConfigError(f"unknown tp_plan {plan!r}: use 'auto' or a mapping of name patterns to a dim or None")
        if _ROW_PARALLEL_SCALE.search(name):
            return 1 if ndim == 2 else None
        for pattern, dim in _AUTO_RULES:
            if pattern.search(name):
                return dim
        return None
    for glob, glob_dim in plan.items():
        if fnmatch.fnmatchcase(name, glob):
            return glob_dim
    return None


def bounds(size: int, rank: int, world_size: int, *, uneven: bool) -> tuple[int, int]:
    """[lo, hi) of rank's block of a dimension of ``size``; uneven blocks only where ``uneven`` allows it."""
    if uneven:
        block = math.ceil(size / world_size)
        return min(size, rank * block), min(size, (rank + 1) * block)
    block = size // world_size
    return rank * block, (rank + 1) * block


def rank_slice(entry: TensorEntry, plan: TPPlan, rank: int, world_size: int, *, path: str) -> Slice:
    """Compute which bytes of ``entry`` rank ``rank`` of ``world_size`` needs, as few contiguous runs as possible."""
    dim = split_dim(entry.name, plan, ndim=len(entry.shape)) if world_size > 1 else None
    if dim is None or not entry.shape:
        return Slice(entry.shape, ((entry.start, entry.nbytes),), None)
    if not -len(entry.shape) <= dim < len(entry.shape):
        raise CheckpointError(
            f"{path}: tensor {entry.name!r} of shape {list(entry.shape)} has no dim {dim} to split for TP",
            path=path,
            tensor=entry.name,
        )
    dim %= len(entry.shape)  # a plan may count dims from the end, as torch does; the byte math needs dim >= 0
    size = entry.shape[dim]
    uneven = bool(_VOCAB.search(entry.name))
    if not uneven and size % world_size:
        grouped = dim == 1 and entry.name.endswith(".weight.scale")
        hint = " (each rank needs whole quantization groups of the weight's input columns)" if grouped else ""
        raise CheckpointError(
            f"{path}: tensor {entry.name!r} dim {dim} has size {size}, not divisible by world size {world_size}{hint}",
            path=path,
            tensor=entry.name,
        )
    lo, hi = bounds(size, rank, world_size, uneven=uneven)
    inner = math.prod(entry.shape[dim + 1 :]) * dtypes.itemsize(entry.dtype)
    outer = math.prod(entry.shape[:dim])
    shape = (*entry.shape[:dim], hi - lo, *entry.shape[dim + 1 :])
    if hi - lo == size:
        return Slice(shape, ((entry.start, entry.nbytes),), dim, lo)
    if outer == 1:
        return Slice(shape, ((entry.start + lo * inner, (hi - lo) * inner),), dim, lo)
    row = size * inner
    runs = tuple((entry.start + o * row + lo * inner, (hi - lo) * inner) for o in range(outer))
    return Slice(shape, runs, dim, lo)
