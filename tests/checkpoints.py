"""Tiny real checkpoints for the loader tests, written with preheat's own writer (and read back by the reference one),
and the ways the tests compare what a load returned with what was written.

The fixtures that hold them (``single_checkpoint``, ``sharded_checkpoint``, ...) are in tests/conftest.py; a test
module imports what it needs from here (``from checkpoints import WrittenCheckpoint, assert_same_tensors``), never from
a conftest.py.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint

# Odd vocabulary: not divisible by 2 or 4, so vocab-parallel tensors are cut in uneven, ceil-sized blocks.
TINY = LlamaShape(
    vocab_size=251,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# Big enough that a TP rank's slices leave whole pages of the file unread (o_proj rows are 2 KiB, down_proj 4 KiB).
WIDE = LlamaShape(
    vocab_size=251,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=1,
)

# One layer of an MHA Llama at real widths (16 KV heads, hidden 2048, intermediate 5632): the shape whose TP ranks'
# reads are checked against their page bound on a cold cache (tests/integration/loader/test_disk_reads.py).
MHA_LAYER = LlamaShape(
    vocab_size=251,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=1,
    num_attention_heads=16,
    num_key_value_heads=16,
)


@dataclass(frozen=True)
class WrittenCheckpoint:
    """A checkpoint on disk and the tensors that were written into it."""

    root: Path
    tensors: dict[str, torch.Tensor]

    @property
    def single_file(self) -> Path:
        return self.root / "model.safetensors"

    @property
    def data_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def write(root: Path, shape: LlamaShape = TINY, *, shards: int = 1, seed: int = 0) -> WrittenCheckpoint:
    return WrittenCheckpoint(root, write_llama_checkpoint(root, shape, shards=shards, seed=seed))


def write_raw(
    path: Path, header: Mapping[str, object], data: bytes = b"", *, declared_length: int | None = None
) -> Path:
    """Write a safetensors file byte by byte, so tests can build the malformed ones the writer refuses to produce."""
    raw = json.dumps(header).encode()
    length = len(raw) if declared_length is None else declared_length
    path.write_bytes(struct.pack("<Q", length) + raw + data)
    return path


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype, shape and bit pattern (works for float8 and bool, and treats NaNs as the bits they are)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    return bool(torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)))


def assert_same_tensors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert same_bytes(got[name], tensor), name


def page_bound(runs: list[tuple[int, int]], page: int) -> int:
    """Bytes in the distinct pages that hold ``(offset, length)`` runs: the most a reader of those runs should fetch."""
    pages: set[int] = set()
    for offset, length in runs:
        if length:
            pages.update(range(offset // page, math.ceil((offset + length) / page)))
    return len(pages) * page
