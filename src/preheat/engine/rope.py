"""Rotary position embeddings: inverse frequencies per RoPE type, and one cos/sin table for every position.

The arithmetic follows transformers' ``modeling_rope_utils`` step by step (same dtypes, same order of operations), so
keys and logits match it bit for bit in float32. The table is computed once for ``max_model_len`` positions; a
forward pass only indexes it.

``dynamic`` (NTK) scaling in transformers recomputes the frequencies whenever a sequence grows past
``max_position_embeddings``, which would change the keys already cached. Here the frequencies are fixed when the
engine starts: identical to transformers while ``max_model_len <= max_position_embeddings`` (the scaling is then a
no-op), and scaled once for ``max_model_len`` otherwise (documented in docs/engine.md).
"""

from __future__ import annotations

import math

import torch

from preheat.core.errors import ConfigError
from preheat.engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, *, max_position_embeddings: int, max_len: int) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies for ``rope``."""
    dim = head_dim
    base = rope.theta
    if rope.rope_type == "dynamic" and max_len > max_position_embeddings:
        scale = rope.factor * max_len / max_position_embeddings - (rope.factor - 1)
        base = base * scale ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope, max_position_embeddings)
    if rope.rope_type not in ("default", "dynamic"):
        raise ConfigError(f"rope type {rope.rope_type!r} is not implemented natively")
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, the band between interpolated."""
    old_context = rope.original_max_position_embeddings or max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_table(inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[2, max_len, head_dim]``: cos and sin of every position, computed in float32 and cast once to ``dtype``."""
    positions = torch.arange(max_len, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin())).to(dtype=dtype, device=device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[heads, T, head_dim]`` by per-position ``cos``/``sin`` ``[T, head_dim]`` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
