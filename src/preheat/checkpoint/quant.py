"""Weight-only quantization, int8 with one scale per output row and fp8 with one per row and group of 32 inputs.

Only the 2-D weights of the linear projections are quantized: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``. They hold nearly all of a Llama's bytes, and a matmul tolerates per-row
rounding well. Left in their original dtype, on purpose:

- embeddings (``embed_tokens``): a lookup, not a matmul; each token's row is used as is, so its rounding error goes
  straight into the residual stream, and with tied embeddings the same matrix is also the output layer;
- ``lm_head``: its rows *are* the logits; rounding them flips near-tied top-1 tokens directly (the quality check
  measures exactly that), while it is only one matrix of dozens;
- norms and biases: 1-D, tiny, and they scale every activation they touch.

For a weight ``W`` of shape ``[out, in]`` (an ``nn.Linear`` weight, output channels on dim 0):
- int8: ``scale[r] = max|W[r]| / 127``, ``q = round(W / scale[:, None])`` clamped to [-127, 127] (symmetric);
- fp8:  ``scale[r, g] = max|W[r, 32g : 32g + 32]| / 448``, each element divided by its group's scale and cast to
  ``float8_e4m3fn`` (448 is its largest). ``in`` must be a multiple of ``GROUP`` = 32, the block size of the OCP
  Microscaling (MX) formats; one scale per row kept too little of SmolLM2's next tokens (docs/checkpoint-format.md).
A row (or group) of zeros gets scale 1. Scales are stored in F32 as a tensor named ``<weight>.scale`` of shape
``[out]`` (int8) or ``[out, in / 32]`` (fp8); dequantization multiplies each element by its row's (group's) scale.

A TP rank's slice of a weight is quantized with its own part of the scales (all of them for a per-row scale and a
column slice), so it is bit-identical to the same slice of the whole weight quantized at once; a column slice of a
grouped weight must start and end on group boundaries (``check_split``).
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

import torch

from preheat.checkpoint import torch_dtypes
from preheat.checkpoint.manifest import QUANT_METHODS, Manifest
from preheat.core.errors import CheckpointError, ConfigError

METHODS = tuple(QUANT_METHODS)
GROUP = 32  # fp8 input columns per scale: the OCP Microscaling (MX) block size
_GROUPS: dict[str, int | None] = {"int8": None, "fp8": GROUP}
_LIMIT = {"int8": 127.0, "fp8": float(torch.finfo(torch.float8_e4m3fn).max)}
_STORED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_LINEAR = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def is_quantizable(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """True for the 2-D floating-point weights of linear projections (see the module docstring for why only them)."""
    return bool(_LINEAR.search(name)) and len(shape) == 2 and dtype.is_floating_point and dtype.itemsize > 1


def scale_name(name: str) -> str:
    """The name of the scale tensor stored beside quantized weight ``name``."""
    return f"{name}.scale"


def group_size(method: str) -> int | None:
    """Input columns per scale for ``method``: None (one scale per whole row) for int8, ``GROUP`` for fp8."""
    if method not in _GROUPS:
        raise ConfigError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    return _GROUPS[method]


def scale_shape(name: str, shape: tuple[int, ...], method: str) -> tuple[int, ...]:
    """The shape of the scale of a ``[out, in]`` weight: ``[out]``, or ``[out, in / group]`` for a grouped method.

    >>> scale_shape("model.layers.0.mlp.down_proj.weight", (576, 1536), "fp8")
    (576, 48)

    Raises ``CheckpointError`` naming ``name`` if the weight is not 2-D, or if ``in`` is not a multiple of the group:
    a partial last group would let a rank's columns share a scale with its neighbour's.
    """
    group = group_size(method)
    if len(shape) != 2:
        raise CheckpointError(f"tensor {name!r} has shape {list(shape)}; only 2-D weights are quantized", tensor=name)
    if group is None:
        return shape[:1]
    if shape[1] % group:
        raise CheckpointError(
            f"tensor {name!r} has {shape[1]} input columns, not a multiple of {group}: {method} stores one scale per "
            f"{group} columns of each row; convert with --dtype int8 (one scale per row) instead",
            tensor=name,
        )
    return (shape[0], shape[1] // group)


def check_split(name: str, shape: tuple[int, ...], method: str, world_size: int) -> None:
    """Check that a column (dim 1) split of weight ``name`` over ``world_size`` ranks gives each rank whole groups:
    ``(in / world_size) % group == 0``. Raises ``CheckpointError`` naming the tensor otherwise."""
    group = group_size(method)
    if group is None or world_size == 1:
        return
    columns = shape[1]
    if columns % world_size or (columns // world_size) % group:
        raise CheckpointError(
            f"tensor {name!r} has {columns} input columns: split over {world_size} ranks, each rank's share must be a "
            f"multiple of {group} ({method} stores one scale per {group} columns), so use a world size that divides "
            f"{columns // group}, or --dtype int8",
            tensor=name,
        )


def quantize(name: str, weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[out, in]`` weight; returns ``(q, scale)`` with ``scale`` F32 of ``scale_shape``.

    Raises ``CheckpointError`` naming ``name`` if the weight holds NaN or infinity (its scale would be meaningless).
    """
    scale = compute_scales(name, weight, method)
    return quantize_with(weight, scale, method), scale


def compute_scales(name: str, weight: torch.Tensor, method: str) -> torch.Tensor:
    """The F32 scales of ``weight``: ``max|row| / 127`` per row (int8) or ``max|group| / 448`` per row and group of
    32 columns (fp8); 1 for a row or group of zeros."""
    shape = scale_shape(name, tuple(weight.shape), method)
    if weight.numel() == 0:
        absmax = torch.zeros(shape)
    else:
        groups = shape[1] if len(shape) == 2 else 1
        absmax = weight.detach().abs().reshape(weight.shape[0], groups, -1).amax(dim=2).to(torch.float32)
        absmax = absmax.reshape(shape)
    if not bool(torch.isfinite(absmax).all()):  # a NaN or infinity anywhere in a row reaches its absmax
        raise CheckpointError(
            f"tensor {name!r} holds NaN or infinite values, so it cannot be quantized (is the source corrupt?)",
            tensor=name,
        )
    return torch.where(absmax > 0, absmax / _LIMIT[method], torch.ones_like(absmax))


def quantize_with(weight: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """Quantize ``weight`` (or a TP slice of it) with its scales: ``[rows]`` per row, ``[rows, in / group]`` per
    group. A slice quantized with its part of the whole weight's scales is bit-identical to the same slice of the
    whole weight quantized at once."""
    limit = _LIMIT[method]
    values, scales = _grouped(weight.detach().to(torch.float32), scale)
    scaled = (values / scales).reshape(weight.shape)
    if method == "int8":
        return scaled.round_().clamp_(-limit, limit).to(torch.int8)
    # Rounding can push absmax/scale a hair past 448; clamping keeps it finite in e4m3fn (which has no inf).
    return scaled.clamp_(-limit, limit).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Restore a quantized weight: each element of ``q.float()`` times its row's (``scale`` of shape ``[rows]``) or
    its group's (``[rows, in / group]``) scale, cast to ``compute_dtype``."""
    values, scales = _grouped(q.to(torch.float32), scale.to(torch.float32))
    return (values * scales).reshape(q.shape).to(compute_dtype)


def _grouped(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` ``[rows, in]`` as ``[rows, groups, in / groups]`` and ``scale`` as ``[rows, groups, 1]``, so they
    broadcast: one group per column of a 2-D scale, a single group for a per-row (1-D) scale."""
    rows = values.shape[0]
    groups = scale.shape[1] if scale.dim() == 2 else 1
    width = values.shape[1] // groups if groups else 0
    return values.reshape(rows, groups, width), scale.reshape(rows, groups, 1)


def dequantize_weights(weights: MutableMapping[str, torch.Tensor], manifest: Manifest, *, where: str) -> None:
    """Replace each quantized weight in ``weights`` by its dequantized value and drop the ``.scale`` tensors.

    ``weights`` is what a load returned (possibly one TP rank's slices); names absent from it are skipped.
    """
    quantized = {t.name: t.quant for t in manifest.tensors if t.quant is not None}
    for name, info in quantized.items():
        if name not in weights:
            continue
        scale = weights.get(info.scale)
        if scale is None:
            raise CheckpointError(
                f"{where}: quantized tensor {name!r} was loaded without its scale {info.scale!r}",
                path=where,
                tensor=name,
            )
        q = weights[name]
        want = _scale_shape_for(tuple(q.shape), info.group)
        if want is None or tuple(scale.shape) != want:
            # Happens when a custom tp_plan splits a weight but not its scale alike (the built-in plan splits both).
            per = "row" if info.group is None else f"row and {info.group} columns"
            raise CheckpointError(
                f"{where}: tensor {name!r} of shape {list(q.shape)} cannot be restored with its scale {info.scale!r} "
                f"of shape {list(scale.shape)} (one scale per {per}): split the scale like the weight in tp_plan",
                path=where,
                tensor=name,
            )
        weights[name] = dequantize(q, scale, torch_dtypes.to_torch(info.compute_dtype))
    for info in quantized.values():
        weights.pop(info.scale, None)


def _scale_shape_for(shape: tuple[int, ...], group: int | None) -> tuple[int, ...] | None:
    """The scale shape a loaded ``[rows, columns]`` weight needs (None if it cannot have one)."""
    if len(shape) != 2:
        return None
    if group is None:
        return shape[:1]
    return None if shape[1] % group else (shape[0], shape[1] // group)


def stored_dtype(method: str) -> torch.dtype:
    """The torch dtype quantized weights of ``method`` are stored in."""
    return _STORED[method]
