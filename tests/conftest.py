"""Tiny real checkpoints for the loader tests, written with preheat's own writer (and read back by the reference one).

Fixtures named ``*_checkpoint`` are shared by a whole session and must not be modified; ``fresh_checkpoint`` is a
private copy per test, for tests that truncate or rewrite files.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.testing.synthetic import LlamaShape, make_tiny_servable_model, write_llama_checkpoint
from redisserver import RedisServer
from smollm2 import SmolLM2, cache_root

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


@pytest.fixture(scope="session")
def single_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """A Hugging Face directory with one ``model.safetensors`` (about 200 KiB of bf16)."""
    return write(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """The same model in three shards with ``model.safetensors.index.json``."""
    return write(tmp_path_factory.mktemp("sharded"), shards=3, seed=1)


@pytest.fixture(scope="session")
def unindexed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """A directory of ``*.safetensors`` shards with no index file."""
    written = write(tmp_path_factory.mktemp("unindexed"), shards=2, seed=2)
    os.remove(written.root / "model.safetensors.index.json")
    return written


@pytest.fixture(scope="session")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """Hidden size 1024 (about 11 MiB): large enough for page-level read accounting to be meaningful."""
    return write(tmp_path_factory.mktemp("wide"), WIDE, seed=3)


@pytest.fixture
def fresh_checkpoint(tmp_path: Path) -> WrittenCheckpoint:
    """A single-file checkpoint this test may truncate or overwrite."""
    return write(tmp_path / "model")


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2:
    """SmolLM2-135M-Instruct converted per dtype (``smollm2.path("int8")``), cached across runs (tests/smollm2.py)."""
    return SmolLM2(cache_root())


@pytest.fixture(scope="session")
def tiny_servable_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama with a real byte-level tokenizer, chat template and EOS (``make_tiny_servable_model``):
    what the engine and server tests serve. Shared by the session: copy it before changing any file."""
    return make_tiny_servable_model(tmp_path_factory.mktemp("servable"))


@pytest.fixture(scope="session")
def kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny servable model with a ``preheat.json`` manifest, so it has the identity KV L2 tiers require."""
    root = make_tiny_servable_model(tmp_path_factory.mktemp("kv-model"))
    (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real ``redis-server`` for the session (tests use their own key prefixes or flush it)."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(params=["fs", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A KV store URL, once a fresh ``fs://`` directory and once the session's real Redis, flushed."""
    if request.param == "fs":
        return f"fs://{tmp_path}"
    server: RedisServer = request.getfixturevalue("redis_server")
    import redis

    redis.Redis.from_url(server.url).flushdb()
    return server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A ``redis-server`` of this test alone, which it may kill and restart."""
    server = RedisServer()
    yield server
    server.stop()
