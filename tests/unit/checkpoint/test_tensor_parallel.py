"""Tensor-parallel loads: rank r of W gets exactly its Megatron slice of every tensor and reads little more."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import preheat
from checkpoints import WrittenCheckpoint, page_bound, same_bytes
from preheat.checkpoint.layout import open_checkpoint
from preheat.checkpoint.tp import TPPlan, rank_slice
from preheat.checkpoint.writer import save_file
from preheat.core.errors import CheckpointError, ConfigError
from preheat.io.buffers import PAGE
from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint

TP_MODES = ["mmap", "read", "direct", "auto"]
WORLD_SIZES = [2, 4]

# The Megatron layout, written out independently of preheat's own rules.
_EXPECTED_DIM = (
    (re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$"), 0),
    (re.compile(r"(o_proj|down_proj)\.weight$"), 1),
    (re.compile(r"(embed_tokens|lm_head)\.weight$"), 0),
)


def expected_dim(name: str) -> int | None:
    for pattern, dim in _EXPECTED_DIM:
        if pattern.search(name):
            return dim
    return None


def load_all_ranks(root: Path, world_size: int, mode: str, tp_plan: TPPlan = "auto") -> list[preheat.LoadResult]:
    return [preheat.load(root, mode=mode, rank=r, world_size=world_size, tp_plan=tp_plan) for r in range(world_size)]


@pytest.mark.parametrize("mode", TP_MODES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rank_gets_its_chunk_of_every_tensor(sharded_checkpoint: WrittenCheckpoint, world_size: int, mode: str) -> None:
    for rank, result in enumerate(load_all_ranks(sharded_checkpoint.root, world_size, mode)):
        assert sorted(result) == sorted(sharded_checkpoint.tensors)
        for name, full in sharded_checkpoint.tensors.items():
            dim = expected_dim(name)
            want = full if dim is None else full.chunk(world_size, dim)[rank]
            assert same_bytes(result[name], want), (name, rank)


@pytest.mark.parametrize("mode", TP_MODES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_concatenating_all_ranks_gives_back_the_full_tensor(
    sharded_checkpoint: WrittenCheckpoint, world_size: int, mode: str
) -> None:
    results = load_all_ranks(sharded_checkpoint.root, world_size, mode)
    for name, full in sharded_checkpoint.tensors.items():
        dim = expected_dim(name)
        if dim is None:
            assert all(same_bytes(r[name], full) for r in results), name
        else:
            assert same_bytes(torch.cat([r[name] for r in results], dim), full), name


@pytest.mark.parametrize("mode", TP_MODES)
def test_vocabulary_is_cut_in_ceil_sized_blocks(sharded_checkpoint: WrittenCheckpoint, mode: str) -> None:
    vocab = sharded_checkpoint.tensors["lm_head.weight"].shape[0]
    assert vocab % 4, "the fixture's vocabulary must not divide evenly"
    block = math.ceil(vocab / 4)
    rows = [r["model.embed_tokens.weight"].shape[0] for r in load_all_ranks(sharded_checkpoint.root, 4, mode)]
    assert rows == [block, block, block, vocab - 3 * block]
    last = preheat.load(sharded_checkpoint.root, mode=mode, rank=3, world_size=4)["lm_head.weight"]
    assert same_bytes(last, sharded_checkpoint.tensors["lm_head.weight"][3 * block :])


@pytest.mark.parametrize("mode", TP_MODES)
def test_custom_tp_plan_is_honoured(sharded_checkpoint: WrittenCheckpoint, mode: str) -> None:
    plan: dict[str, int | None] = {
        "*.self_attn.q_proj.weight": 1,  # against the usual layout, to prove the mapping wins
        "*.mlp.*": None,
        "*layernorm.weight": 0,
    }
    for rank, result in enumerate(load_all_ranks(sharded_checkpoint.root, 2, mode, tp_plan=plan)):
        for name, full in sharded_checkpoint.tensors.items():
            if name.endswith("q_proj.weight"):
                want = full.chunk(2, 1)[rank]
            elif name.endswith("layernorm.weight"):
                want = full.chunk(2, 0)[rank]
            else:
                want = full
            assert same_bytes(result[name], want), (name, rank)


@pytest.mark.parametrize("mode", TP_MODES)
def test_tp_plan_may_count_dims_from_the_end(sharded_checkpoint: WrittenCheckpoint, mode: str) -> None:
    plan: dict[str, int | None] = {"*.o_proj.weight": -1, "*.q_proj.weight": -2}
    for rank, result in enumerate(load_all_ranks(sharded_checkpoint.root, 2, mode, tp_plan=plan)):
        for name, full in sharded_checkpoint.tensors.items():
            if name.endswith("o_proj.weight"):
                want = full.chunk(2, 1)[rank]
            elif name.endswith("q_proj.weight"):
                want = full.chunk(2, 0)[rank]
            else:
                want = full
            assert same_bytes(result[name], want), (name, rank)


@pytest.mark.parametrize("dim", [1, -2])
def test_tp_plan_naming_a_missing_dim_names_the_tensor(single_checkpoint: WrittenCheckpoint, dim: int) -> None:
    with pytest.raises(CheckpointError, match=f"has no dim {dim}") as caught:
        preheat.load(single_checkpoint.root, mode="read", rank=0, world_size=2, tp_plan={"model.norm.weight": dim})
    assert caught.value.tensor == "model.norm.weight"
    assert caught.value.path == str(single_checkpoint.single_file)


def test_auto_mode_reads_a_tp_rank_into_contiguous_tensors(sharded_checkpoint: WrittenCheckpoint) -> None:
    result = preheat.load(sharded_checkpoint.root, mode="auto", rank=1, world_size=2)
    assert result.report.mode == "read"
    assert all(t.is_contiguous() for t in result.values())


def test_first_matching_pattern_of_a_tp_plan_wins(sharded_checkpoint: WrittenCheckpoint) -> None:
    plan: dict[str, int | None] = {"model.layers.0.*": None, "*.q_proj.weight": 0}
    result = preheat.load(sharded_checkpoint.root, mode="read", rank=1, world_size=2, tp_plan=plan)
    layer0 = sharded_checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]
    layer1 = sharded_checkpoint.tensors["model.layers.1.self_attn.q_proj.weight"]
    assert same_bytes(result["model.layers.0.self_attn.q_proj.weight"], layer0)
    assert same_bytes(result["model.layers.1.self_attn.q_proj.weight"], layer1.chunk(2, 0)[1])


def test_unknown_tp_plan_name_is_a_config_error(single_checkpoint: WrittenCheckpoint) -> None:
    with pytest.raises(ConfigError, match="megatron"):
        preheat.load(single_checkpoint.root, rank=0, world_size=2, tp_plan="megatron")


@pytest.mark.parametrize("mode", TP_MODES)
@pytest.mark.parametrize(
    ("name", "shape"),
    [("model.layers.0.mlp.gate_proj.weight", (6, 4)), ("model.layers.0.self_attn.o_proj.weight", (4, 6))],
)
def test_non_divisible_split_names_the_tensor(tmp_path: Path, mode: str, name: str, shape: tuple[int, int]) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"model.norm.weight": torch.ones(4), name: torch.zeros(shape)}, path)
    with pytest.raises(CheckpointError, match=re.escape(name)) as caught:
        preheat.load(path, mode=mode, rank=0, world_size=4)
    assert caught.value.tensor == name
    assert caught.value.path == str(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("mode", ["read", "direct", "auto"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_read_modes_return_contiguous_tensors(
    sharded_checkpoint: WrittenCheckpoint, world_size: int, mode: str
) -> None:
    for result in load_all_ranks(sharded_checkpoint.root, world_size, mode):
        assert all(t.is_contiguous() for t in result.values())


@pytest.mark.parametrize("world_size", [1, *WORLD_SIZES])
def test_rank_reads_only_its_slice(wide_checkpoint: WrittenCheckpoint, world_size: int) -> None:
    checkpoint = open_checkpoint(wide_checkpoint.root)
    (file,) = checkpoint.files
    for rank in range(world_size):
        runs = [
            run
            for entry in file.header.tensors
            for run in rank_slice(entry, "auto", rank, world_size, path=file.path).runs
        ]
        result = preheat.load(wide_checkpoint.root, mode="read", rank=rank, world_size=world_size)
        assert result.report.bytes_read >= sum(length for _, length in runs)
        assert result.report.bytes_read <= page_bound(runs, PAGE)
        if world_size > 1:
            assert result.report.bytes_read < file.size


@pytest.fixture(scope="module")
def long_rows_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reviewed shape's MLP (intermediate 5632: ``down_proj`` rows of 11 KiB, so a rank's half rows start and
    end mid-page) at hidden 512, one layer: about 18 MiB."""
    root = tmp_path_factory.mktemp("long-rows")
    write_llama_checkpoint(root, LlamaShape(256, 512, 5632, 1, 4, 4), seed=4)
    return root


@pytest.mark.parametrize("chunk", [8 * 1024, 64 * 1024, None])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["wide", "long_rows"])
def test_direct_rank_reads_within_its_page_bound(
    name: str, world_size: int, chunk: int | None, request: pytest.FixtureRequest
) -> None:
    """O_DIRECT reads whole pages: a rank must still fetch no more than the pages holding its slices (+2%), at any
    chunk size (cutting reads mid-page made it read most pages twice)."""
    root = request.getfixturevalue(f"{name}_checkpoint")
    root = root.root if isinstance(root, WrittenCheckpoint) else root
    (file,) = open_checkpoint(root).files
    for rank in range(world_size):
        runs = [r for e in file.header.tensors for r in rank_slice(e, "auto", rank, world_size, path=file.path).runs]
        report = preheat.load(root, mode="direct", rank=rank, world_size=world_size, chunk_bytes=chunk).report
        assert report.bytes_read <= page_bound(runs, PAGE) * 1.02, (rank, report.bytes_read / file.size)
        assert report.bytes_read >= sum(length for _, length in runs)


@pytest.mark.parametrize("mode", ["read", "direct"])
def test_ranks_together_deliver_each_byte_once(wide_checkpoint: WrittenCheckpoint, mode: str) -> None:
    split_bytes = sum(
        t.numel() * t.element_size() for name, t in wide_checkpoint.tensors.items() if expected_dim(name) is not None
    )
    replicated = wide_checkpoint.data_bytes - split_bytes
    delivered = [preheat.load(wide_checkpoint.root, mode=mode, rank=r, world_size=2).report.bytes for r in range(2)]
    assert sum(delivered) == split_bytes + 2 * replicated
