"""CUDA and GPUDirect Storage paths. Skipped without a GPU; scripts/device_check.sh runs them on a lent one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import preheat
from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = LlamaShape(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("gpu-ckpt")
    return root, write_llama_checkpoint(root, SHAPE, shards=2)


@pytest.mark.parametrize("mode", ["auto", "read", "direct"])
def test_cuda_load_matches_written_tensors(checkpoint: tuple[Path, dict[str, torch.Tensor]], mode: str) -> None:
    root, expected = checkpoint
    weights = preheat.load(root, "cuda", mode=mode)
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert weights[name].device.type == "cuda"
        assert torch.equal(weights[name].cpu(), tensor), name


@pytest.mark.parametrize("mode", ["read", "direct"])
def test_pipeline_reuses_staging_buffers_correctly(checkpoint: tuple[Path, dict[str, torch.Tensor]], mode: str) -> None:
    """Tiny chunks force every lane through many read/copy rounds, so a staging buffer overwritten before its copy
    finished would corrupt weights."""
    root, expected = checkpoint
    weights = preheat.load(root, "cuda", mode=mode, threads=3, chunk_bytes=4096)
    for name, tensor in expected.items():
        assert torch.equal(weights[name].cpu(), tensor), name


@pytest.mark.parametrize("mode", ["read", "direct"])
def test_cuda_rank_gets_its_slice(checkpoint: tuple[Path, dict[str, torch.Tensor]], mode: str) -> None:
    root, expected = checkpoint
    for rank in range(2):
        weights = preheat.load(root, "cuda", mode=mode, rank=rank, world_size=2, chunk_bytes=8192)
        o_proj = "model.layers.0.self_attn.o_proj.weight"
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(weights[o_proj].cpu(), expected[o_proj].chunk(2, 1)[rank])
        assert torch.equal(weights[q_proj].cpu(), expected[q_proj].chunk(2, 0)[rank])


@pytest.mark.skipif(importlib.util.find_spec("kvikio") is None, reason="needs kvikio")
def test_gds_load_matches_written_tensors(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, expected = checkpoint
    weights = preheat.load(root, "cuda", mode="gds")
    for name, tensor in expected.items():
        assert torch.equal(weights[name].cpu(), tensor), name
