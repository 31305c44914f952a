"""What the KV tiers know of the engine whose chunks they hold: ``KVLayout`` (what a chunk's bytes mean) and
``KVSpec`` (the layout plus the checkpoint identity, RoPE settings and where the engine computes).

The engine builds a ``KVSpec`` (``Engine.kv_spec``) and the server hands it to ``kv.build.build_tiers``, so
``preheat.kv`` never imports the engine: the tiers depend on these values, not on model code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from preheat.checkpoint import torch_dtypes


@dataclass(frozen=True)
class KVLayout:
    """The shape of the engine's cache: what a KV chunk's bytes mean. Part of the KV fingerprint (a chunk is only
    valid for the same layout, model and RoPE settings)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block: ``(num_layers, 2, num_kv_heads, block_size, head_dim)``."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def chunk_shape(self, n_tokens: int) -> tuple[int, ...]:
        """Shape of an exported chunk of ``n_tokens`` (a multiple of ``block_size``)."""
        return (n_tokens // self.block_size, *self.block_shape)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready description (dtype as its safetensors name), for fingerprints and chunk file headers."""
        return {
            "order": "blocks,layers,kv,heads,tokens,head_dim",
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": torch_dtypes.from_torch(self.dtype),
        }


@dataclass(frozen=True)
class KVSpec:
    """Everything ``build_tiers`` reads about an engine.

    ``identity``: the checkpoint's ``preheat.json`` identity, None when it has none (L1 only: two checkpoints of the
    same shape would share keys). ``rope``: the RoPE settings as they enter the fingerprint (with ``max_model_len``
    for dynamic NTK, whose frequencies depend on it). ``pin``: the engine computes on CUDA, so host copies are pinned.

    >>> layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    >>> KVSpec(layout, identity="abc", rope={"theta": 10000.0}).pin
    False
    """

    layout: KVLayout
    identity: str | None
    rope: Mapping[str, object]
    pin: bool = False
