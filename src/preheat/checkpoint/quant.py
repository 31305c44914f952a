"""Weight-only quantization with per-output-channel scales (int8 and fp8), and its inverse.

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
- fp8:  ``scale[r] = max|W[r]| / 448``, ``q = (W / scale[:, None])`` cast to ``float8_e4m3fn`` (448 is its largest).
A row of zeros gets scale 1. Scales are stored in F32 as a tensor named ``<weight>.scale``; dequantization is
``(q.float() * scale[:, None]).to(compute_dtype)``.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

import torch

from preheat.checkpoint import dtypes
from preheat.checkpoint.manifest import QUANT_METHODS, Manifest
from preheat.errors import CheckpointError, ConfigError

METHODS = tuple(QUANT_METHODS)
_LIMIT = {"int8": 127.0, "fp8": float(torch.finfo(torch.float8_e4m3fn).max)}
_STORED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_LINEAR = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def is_quantizable(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """True for the 2-D floating-point weights of linear projections (see the module docstring for why only them)."""
    return bool(_LINEAR.search(name)) and len(shape) == 2 and dtype.is_floating_point and dtype.itemsize > 1


def scale_name(name: str) -> str:
    """The name of the scale tensor stored beside quantized weight ``name``."""
    return f"{name}.scale"


def quantize(name: str, weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[out, in]`` weight per output row; returns ``(q, scale)`` with ``scale`` F32 of shape ``[out]``.

    Raises ``CheckpointError`` naming ``name`` if the weight holds NaN or infinity (its scale would be meaningless).
    """
    scale = row_scales(name, weight, method)
    return quantize_rows(weight, scale, method), scale


def row_scales(name: str, weight: torch.Tensor, method: str) -> torch.Tensor:
    """The F32 per-output-row scales of ``weight`` (``max|row| / 127`` or ``/ 448``; 1 for a row of zeros)."""
    if method not in _LIMIT:
        raise ConfigError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    if weight.dim() != 2:
        raise CheckpointError(
            f"tensor {name!r} has shape {list(weight.shape)}; only 2-D weights are quantized", tensor=name
        )
    absmax = weight.detach().abs().amax(dim=1).to(torch.float32) if weight.shape[1] else torch.zeros(weight.shape[0])
    if not bool(torch.isfinite(absmax).all()):  # a NaN or infinity anywhere in a row reaches its absmax
        raise CheckpointError(
            f"tensor {name!r} holds NaN or infinite values, so it cannot be quantized (is the source corrupt?)",
            tensor=name,
        )
    return torch.where(absmax > 0, absmax / _LIMIT[method], torch.ones_like(absmax))


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """Quantize ``weight`` (or any column slice of it) with its rows' ``scale``: a TP rank's slice quantized this way
    is bit-identical to the same slice of the whole weight quantized at once."""
    limit = _LIMIT[method]
    scaled = weight.detach().to(torch.float32) / scale[:, None]
    if method == "int8":
        return scaled.round_().clamp_(-limit, limit).to(torch.int8)
    # Rounding can push absmax/scale a hair past 448; clamping keeps it finite in e4m3fn (which has no inf).
    return scaled.clamp_(-limit, limit).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """Restore a quantized weight: ``(q.float() * scale[:, None]).to(compute_dtype)``."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(compute_dtype)


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
        if q.dim() != 2 or tuple(scale.shape) != (q.shape[0],):
            # Happens when a custom tp_plan splits a weight on dim 0 but not its scale (the built-in plan splits both).
            raise CheckpointError(
                f"{where}: tensor {name!r} has {q.shape[0]} rows but its scale {info.scale!r} has "
                f"{list(scale.shape)}: split the scale like the weight in tp_plan",
                path=where,
                tensor=name,
            )
        weights[name] = dequantize(q, scale, dtypes.to_torch(info.compute_dtype))
    for info in quantized.values():
        weights.pop(info.scale, None)


def stored_dtype(method: str) -> torch.dtype:
    """The torch dtype quantized weights of ``method`` are stored in."""
    return _STORED[method]
