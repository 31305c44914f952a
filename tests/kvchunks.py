"""Small KV chunks and tiers for the tier tests: a real layout, random K/V, the real file format."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from preheat.kv import chunkfile
from preheat.kv.chunk import StoredChunk, expect_for, store_form, stored_dtype
from preheat.kv.keys import chunk_keys, fingerprint
from preheat.kv.spec import KVLayout
from tmpfs import mounted_tmpfs

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
CHUNK_TOKENS = 32
FP = fingerprint(identity="test-model", layout=LAYOUT.to_dict(), chunk_tokens=CHUNK_TOKENS)


def expect(kv_dtype: str = "auto", fp: str = FP) -> chunkfile.Expect:
    return expect_for(fp, stored_dtype(kv_dtype, LAYOUT.dtype), LAYOUT.chunk_shape(CHUNK_TOKENS))


def exported(seed: int = 0) -> torch.Tensor:
    """What ``PagedKVCache.export_chunk`` returns for one chunk: random K/V of the layout's shape."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.chunk_shape(CHUNK_TOKENS), generator=generator, dtype=LAYOUT.dtype)


def chunk(seed: int = 0, kv_dtype: str = "auto") -> StoredChunk:
    return store_form(exported(seed), kv_dtype)


def key(i: int) -> str:
    return chunk_keys(FP, list(range(i * CHUNK_TOKENS, (i + 1) * CHUNK_TOKENS)), CHUNK_TOKENS)[0]


def same(a: StoredChunk, b: StoredChunk) -> bool:
    scales_equal = (a.scales is None and b.scales is None) or (
        a.scales is not None and b.scales is not None and torch.equal(a.scales, b.scales)
    )
    same_data = a.data.dtype == b.data.dtype and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    return same_data and scales_equal


class Clock:
    """A monotonic clock the test moves by hand: a tier's retry interval passes without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tiny_tmpfs(mount: Path, size: str) -> contextlib.AbstractContextManager[Path]:
    """A real tmpfs of ``size`` (``64k``) mounted at ``mount``, a disk that is full after a few writes, unmounted
    afterwards; skips the test where it cannot be mounted (it needs root)."""
    return mounted_tmpfs(mount, f"size={size}")
