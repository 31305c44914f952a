"""``--load-format preheat`` with the ``bucket`` option, without vLLM: the weights handed over bucket by bucket from
private memory (on CUDA from device memory, by default), checked before each bucket, on the timeline as the mapping's
stages. tests/engines/test_vllm_load.py runs the same code inside vLLM itself."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from checkpoints import WrittenCheckpoint, assert_same_tensors, write
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.convert import convert
from preheat.core.errors import CheckpointError, ConfigError
from preheat.integrations.vllm.options import LoadOptions, parse_options
from preheat.integrations.vllm.session import load_for_engine
from preheat.integrations.vllm.sharded import RankShard
from preheat.testing.synthetic import LlamaShape


class Engine:
    """vLLM's ``model.load_weights``: copies what it is handed, returns the names loaded; one call per bucket."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[list[str]] = []

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = []
        for name, tensor in pairs:
            self.weights[name] = tensor.clone()
            names.append(name)
        self.calls.append(names)
        return set(names)


@pytest.fixture
def checkpoint(tmp_path: Path) -> WrittenCheckpoint:
    written = write(tmp_path / "model", shards=2)
    (written.root / MANIFEST_NAME).write_bytes(build_manifest(str(written.root)).to_json())
    return written


@pytest.mark.parametrize(("given", "size"), [("256MiB", 256 << 20), (4096, 4096), ("1.5KiB", 1536), (" 64K ", 64_000)])
def test_bucket_takes_a_size_or_bytes(given: object, size: int) -> None:
    assert parse_options({"bucket": given}, env={}).bucket == size


def test_bucket_comes_from_its_variable_when_not_given() -> None:
    assert parse_options({}, env={"PREHEAT_VLLM_BUCKET": "1MiB"}).bucket == 1 << 20
    assert parse_options({"bucket": 10}, env={"PREHEAT_VLLM_BUCKET": "1MiB"}).bucket == 10
    assert parse_options({}, env={}).bucket is None


@pytest.mark.parametrize("given", [0, -5, True, "lots", "0.1", [1]])
def test_a_bucket_that_is_no_size_is_refused_naming_the_option(given: object) -> None:
    with pytest.raises(ConfigError, match="bucket"):
        parse_options({"bucket": given}, env={})


def test_a_zero_bucket_variable_is_refused() -> None:
    with pytest.raises(ConfigError, match="bucket"):
        parse_options({}, env={"PREHEAT_VLLM_BUCKET": "0"})


@pytest.mark.parametrize("bucket", [1024, 40_000, 1 << 30])
def test_bucketed_cpu_load_hands_over_the_same_tensors_in_bounded_buckets(
    checkpoint: WrittenCheckpoint, tmp_path: Path, bucket: int
) -> None:
    engine = Engine()
    timeline = tmp_path / "timeline.json"
    outcome = load_for_engine(
        str(checkpoint.root), LoadOptions(bucket=bucket, timeline=str(timeline)), engine.load_weights
    )
    assert_same_tensors(engine.weights, checkpoint.tensors)
    assert outcome.verified  # read into memory with a manifest: every tensor checked before its bucket went over
    assert outcome.loaded == set(checkpoint.tensors)  # the union over the calls, for the loader's missing check
    stages = {s["name"]: s for s in json.loads(timeline.read_text())["stages"]}
    report = stages["weight_load"]["detail"]["bucket"]
    assert stages["weight_load"]["detail"]["mode"] == "bucketed read"
    assert report["buckets"] == len(engine.calls) == stages["weight_handoff"]["detail"]["buckets"]
    largest = max(t.numel() * t.element_size() for t in checkpoint.tensors.values())
    assert report["peak_extra_bytes"] <= max(bucket, largest) + 64 * len(checkpoint.tensors)
    assert report["retained_bytes"] == 0
    assert stages["weight_load"]["end"] <= stages["weight_handoff"]["start"]
    if bucket == 1 << 30:
        assert len(engine.calls) == 1  # the whole model in one bucket, both files in it
    else:
        assert len(engine.calls) > 2


def test_without_bucket_the_cpu_keeps_the_mapping(checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    engine = Engine()
    timeline = tmp_path / "timeline.json"
    load_for_engine(str(checkpoint.root), LoadOptions(timeline=str(timeline)), engine.load_weights)
    stages = {s["name"]: s for s in json.loads(timeline.read_text())["stages"]}
    assert stages["weight_load"]["detail"]["mode"] == "mmap"
    assert len(engine.calls) == 1


def test_a_bad_digest_stops_the_bucketed_load_before_its_bucket(checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    last = checkpoint.root / "model-00002-of-00002.safetensors"
    raw = bytearray(last.read_bytes())
    raw[-3] ^= 0xFF  # the last tensor of the last file: the header still matches the manifest, the digest does not
    last.write_bytes(bytes(raw))
    engine = Engine()
    timeline = tmp_path / "timeline.json"
    with pytest.raises(CheckpointError, match="does not match its digest"):
        load_for_engine(str(checkpoint.root), LoadOptions(bucket=1, timeline=str(timeline)), engine.load_weights)
    handed = [name for call in engine.calls for name in call]
    assert len(handed) == len(checkpoint.tensors) - 1  # every bucket before the bad one, not the bad one
    stages = {s["name"]: s for s in json.loads(timeline.read_text())["stages"]}
    assert "weight_handoff" not in stages
    assert "does not match" in stages["weight_load"]["detail"]["error"]
    assert stages["weight_load"]["detail"]["buckets_handed"] == len(handed)


# vLLM pads the vocabulary to 64 rows before splitting it: 256 tokens cut in the same blocks as preheat's plan.
VLLM_CUT = LlamaShape(256, 64, 128, 2, 4, 2)


def test_a_presharded_rank_gets_its_slices_dressed_in_buckets(tmp_path: Path) -> None:
    written = write(tmp_path / "model", VLLM_CUT)
    convert(written.root, tmp_path / "tp2", tp=2)
    for rank in (0, 1):
        handed: dict[str, torch.Tensor] = {}

        def narrowing(
            pairs: Iterable[tuple[str, torch.Tensor]], rank: int = rank, handed: dict[str, torch.Tensor] = handed
        ) -> set[str]:
            for name, tensor in pairs:
                full = written.tensors[name]
                assert tuple(tensor.shape) == tuple(full.shape), name  # dressed as the full tensor
                if isinstance(tensor, RankShard):
                    dim = tensor._preheat_split.dim
                    block = -(-full.shape[dim] // 2)
                    got = tensor.narrow(dim, rank * block, block)
                    assert torch.equal(got, full.narrow(dim, rank * block, block)), name
                else:
                    assert torch.equal(tensor, full), name
                handed[name] = tensor.clone()
            return set(handed)

        outcome = load_for_engine(
            str(tmp_path / "tp2"), LoadOptions(bucket=8192, verify=True), narrowing, rank=rank, world_size=2
        )
        assert set(handed) == set(written.tensors)
        assert outcome.verified


def test_a_quantized_checkpoint_is_refused_in_buckets(tmp_path: Path) -> None:
    written = write(tmp_path / "model", VLLM_CUT)
    convert(written.root, tmp_path / "int8", dtype="int8")
    with pytest.raises(ConfigError, match="quantized"):
        load_for_engine(str(tmp_path / "int8"), LoadOptions(bucket=1 << 20), Engine().load_weights)
