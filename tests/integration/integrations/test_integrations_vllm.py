"""``--load-format preheat`` without vLLM: options, versions, where the weights come from, the checks before the
hand-off, and the timeline. The hand-off here is a plain consumer of ``(name, tensor)`` pairs, as vLLM's
``model.load_weights`` is; tests/engines/test_vllm_load.py runs the same code inside vLLM itself."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from checkpoints import WIDE, WrittenCheckpoint, assert_same_tensors, write
from peers import SeedPeer
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.convert import convert
from preheat.core.errors import CheckpointError, ConfigError
from preheat.core.timeline import Timeline
from preheat.integrations.vllm import ALLOWED, register
from preheat.integrations.vllm.options import LoadOptions, check_vllm_version, parse_options
from preheat.integrations.vllm.session import load_for_engine, timeline_path
from preheat.integrations.vllm.sharded import RankShard
from preheat.testing.fileserver import FileServer
from preheat.testing.synthetic import LlamaShape
from preheat.timeline.waterfall import Waterfall


class Engine:
    """What vLLM's ``model.load_weights`` is to the loader: something that takes the pairs and keeps copies."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        for name, tensor in pairs:
            self.weights[name] = tensor.clone()
        return set(self.weights)


@pytest.fixture
def checkpoint(tmp_path: Path) -> WrittenCheckpoint:
    """A checkpoint with a ``preheat.json`` (per-tensor digests) and a config.json, private to the test."""
    written = write(tmp_path / "model")
    (written.root / MANIFEST_NAME).write_bytes(build_manifest(str(written.root)).to_json())
    return written


@pytest.fixture
def cache_dir(tmp_path: Path) -> str:
    return str(tmp_path / "node-cache")


def corrupt_one_tensor(root: Path) -> None:
    """Flip a byte inside the last tensor's data: the header still matches the manifest, the digest does not."""
    path = root / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_register_without_vllm_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"vLLM, which is not installed.*pip install 'vllm==0\.33\.\*'"):
        register()


def test_unknown_extra_config_key_is_named_with_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_options({"treads": 4}, env={})
    message = str(caught.value)
    assert "'treads'" in message
    for key in ALLOWED:
        assert key in message


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"threads": 0}, "threads"),
        ({"threads": True}, "threads"),
        ({"verify": "sometimes"}, "verify"),
        ({"mode": "gds"}, "mode"),
        ({"registry": 5}, "registry"),
    ],
)
def test_bad_option_values_are_refused_naming_the_option(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_options(extra, env={})


def test_extra_config_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        parse_options(["threads", 4], env={})


def test_extra_config_wins_over_variables_which_win_over_defaults() -> None:
    env = {"PREHEAT_THREADS": "3", "PREHEAT_REGISTRY": "file:///reg", "PREHEAT_VLLM_VERIFY": "0"}
    options = parse_options({"threads": 5}, env=env)
    assert (options.threads, options.registry, options.verify, options.mode) == (5, "file:///reg", False, "auto")
    assert parse_options(None, env={}) == LoadOptions()


def test_a_bad_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="PREHEAT_THREADS"):
        parse_options({}, env={"PREHEAT_THREADS": "many"})


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0", "0.33.2rc1"])
def test_supported_vllm_versions_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0"])
def test_other_vllm_versions_are_refused_with_the_fix(version: str) -> None:
    with pytest.raises(ConfigError, match=rf"this is vLLM {version}: install vllm==0\.33\.\*"):
        check_vllm_version(version)


def test_local_checkpoint_is_handed_over_whole_mapped_as_preheat_load_maps_it(checkpoint: WrittenCheckpoint) -> None:
    engine = Engine()
    outcome = load_for_engine(str(checkpoint.root), LoadOptions(), engine.load_weights)
    assert_same_tensors(engine.weights, checkpoint.tensors)
    assert not outcome.verified  # preheat.load's local mmap rule: headers checked, pages left lazy (verify: true)
    assert outcome.tensors == len(checkpoint.tensors)


def test_verify_true_hashes_every_tensor_before_the_hand_off(checkpoint: WrittenCheckpoint) -> None:
    engine = Engine()
    outcome = load_for_engine(str(checkpoint.root), LoadOptions(verify=True), engine.load_weights)
    assert_same_tensors(engine.weights, checkpoint.tensors)
    assert outcome.verified


def test_manifest_mismatch_stops_the_load_before_the_engine_gets_anything(checkpoint: WrittenCheckpoint) -> None:
    corrupt_one_tensor(checkpoint.root)
    engine = Engine()
    with pytest.raises(CheckpointError, match="digest"):
        load_for_engine(str(checkpoint.root), LoadOptions(verify=True), engine.load_weights)
    assert engine.calls == 0


def test_header_that_disagrees_with_the_manifest_stops_even_a_tp_rank(
    checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    # The manifest of another model: the headers' check against it refuses before a byte of weights is read.
    other = write(tmp_path / "other", WIDE)
    (checkpoint.root / MANIFEST_NAME).write_bytes(build_manifest(str(other.root)).to_json())
    engine = Engine()
    with pytest.raises(CheckpointError):
        load_for_engine(str(checkpoint.root), LoadOptions(), engine.load_weights, rank=1, world_size=2)
    assert engine.calls == 0


def test_a_tp_rank_is_handed_full_tensors_of_an_unsharded_checkpoint(checkpoint: WrittenCheckpoint) -> None:
    engine = Engine()
    outcome = load_for_engine(str(checkpoint.root), LoadOptions(), engine.load_weights, rank=1, world_size=2)
    assert_same_tensors(engine.weights, checkpoint.tensors)  # vLLM's parameter loaders cut their shard themselves
    assert not outcome.verified  # a rank keeps to its own pages: only headers were checked against the manifest


# vLLM pads the vocabulary to 64 rows before splitting it: 256 tokens cut in the same blocks as preheat's plan.
VLLM_CUT = LlamaShape(256, 64, 128, 2, 4, 2)


class NarrowingEngine:
    """vLLM's parameter loaders to a pre-sharded rank: check the full shape, then narrow to the rank's block."""

    def __init__(self, full: dict[str, torch.Tensor], rank: int) -> None:
        self.full, self.rank, self.handed = full, rank, dict[str, torch.Tensor]()

    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in pairs:
            full = self.full[name]
            assert tuple(tensor.shape) == tuple(full.shape), name
            if isinstance(tensor, RankShard):
                dim = tensor._preheat_split.dim
                block = -(-full.shape[dim] // 2)
                part = tensor.narrow(dim, self.rank * block, block)
                assert torch.equal(part, full.narrow(dim, self.rank * block, block)), name
                with pytest.raises(CheckpointError, match="convert the model without --tp"):
                    tensor.narrow(dim, (1 - self.rank) * block, 1)  # the other rank's rows: never handed over
            else:
                assert torch.equal(tensor, full), name
            self.handed[name] = tensor
        return set(self.handed)


def test_presharded_rank_gets_its_slices_dressed_as_the_full_tensors(tmp_path: Path) -> None:
    written = write(tmp_path / "model", VLLM_CUT)
    convert(written.root, tmp_path / "tp2", tp=2)
    for rank in (0, 1):
        engine = NarrowingEngine(written.tensors, rank)
        outcome = load_for_engine(
            str(tmp_path / "tp2"), LoadOptions(verify=True), engine.load_weights, rank=rank, world_size=2
        )
        assert set(engine.handed) == set(written.tensors)
        assert any(isinstance(t, RankShard) for t in engine.handed.values())
        assert outcome.verified  # the rank's own files have their own digests: hashing reads its bytes alone


def test_presharded_vocabulary_vllm_would_cut_otherwise_is_refused(
    checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    convert(checkpoint.root, tmp_path / "tp2", tp=2)  # 251 tokens: vLLM cuts 128-row blocks, preheat 126
    engine = Engine()
    with pytest.raises(ConfigError, match=r"251-token vocabulary .* blocks of 128 .* blocks of 126"):
        load_for_engine(str(tmp_path / "tp2"), LoadOptions(), engine.load_weights, rank=0, world_size=2)
    assert engine.calls == 0


def test_presharded_checkpoint_at_another_tp_size_is_refused_naming_both(
    checkpoint: WrittenCheckpoint, tmp_path: Path
) -> None:
    sharded = tmp_path / "tp2"
    convert(checkpoint.root, sharded, tp=2)
    engine = Engine()
    with pytest.raises(ConfigError, match=r"convert --tp 2.*--tensor-parallel-size 2"):
        load_for_engine(str(sharded), LoadOptions(), engine.load_weights)
    assert engine.calls == 0


def test_a_directory_that_does_not_exist_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nowhere: not a checkpoint directory"):
        load_for_engine(str(tmp_path / "nowhere"), LoadOptions(), Engine().load_weights)


def test_a_directory_without_weights_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError):
        load_for_engine(str(tmp_path), LoadOptions(), Engine().load_weights)


def test_http_source_is_pulled_into_the_node_cache_then_handed_over(
    checkpoint: WrittenCheckpoint, tmp_path: Path, cache_dir: str
) -> None:
    configs = tmp_path / "configs"  # what vLLM reads before the loader runs: config.json (and a tokenizer)
    configs.mkdir()
    shutil.copy(checkpoint.root / "config.json", configs)
    timeline = Timeline()
    with FileServer(checkpoint.root) as origin:
        options = LoadOptions(source=origin.url, cache_dir=cache_dir)
        engine = Engine()
        outcome = load_for_engine(str(configs), options, engine.load_weights, timeline=timeline)
        again = Timeline()
        load_for_engine(str(configs), options, Engine().load_weights, timeline=again)
    assert_same_tensors(engine.weights, checkpoint.tensors)
    assert outcome.path.startswith(cache_dir)
    fetch = next(s for s in timeline.stages() if s.name == "fetch")
    assert fetch.detail["cache"] == "miss"
    assert fetch.nbytes
    assert next(s for s in again.stages() if s.name == "fetch").detail["cache"] == "hit"


def test_a_model_config_that_is_not_the_sources_is_refused(
    checkpoint: WrittenCheckpoint, tmp_path: Path, cache_dir: str
) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 7}))
    engine = Engine()
    with FileServer(checkpoint.root) as origin, pytest.raises(ConfigError, match=r"differs from the config\.json"):
        load_for_engine(str(configs), LoadOptions(source=origin.url, cache_dir=cache_dir), engine.load_weights)
    assert engine.calls == 0


def test_the_timeline_file_shows_the_load_stages_per_rank(checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    target = tmp_path / "out" / "load.json"
    load_for_engine(
        str(checkpoint.root), LoadOptions(timeline=str(target)), Engine().load_weights, rank=1, world_size=2
    )
    written = tmp_path / "out" / "load.rank1.json"
    assert written == Path(timeline_path(str(target), 1, 2))
    waterfall = Waterfall.from_dict(json.loads(written.read_text()), where=str(written))
    names = [row.name for row in waterfall.rows]
    assert names == ["weight_load", "weight_handoff", "weights_ready"]


def test_a_failed_load_still_writes_its_timeline_with_the_error(checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    corrupt_one_tensor(checkpoint.root)
    target = tmp_path / "load.json"
    with pytest.raises(CheckpointError):
        load_for_engine(str(checkpoint.root), LoadOptions(timeline=str(target), verify=True), Engine().load_weights)
    stages = json.loads(target.read_text())["stages"]
    assert [s["name"] for s in stages] == ["weight_load"]
    assert "digest" in stages[0]["detail"]["error"]


def test_peer_name_is_pulled_from_a_seed_peer_then_handed_over(
    checkpoint: WrittenCheckpoint, tmp_path: Path, cache_dir: str
) -> None:
    registry = f"file://{tmp_path / 'registry'}"
    timeline = Timeline()
    with SeedPeer(checkpoint.root, "--name", "tiny", "--registry", registry):
        options = LoadOptions(source="preheat://tiny", registry=registry, cache_dir=cache_dir)
        engine = Engine()
        load_for_engine(str(checkpoint.root), options, engine.load_weights, timeline=timeline)
    assert_same_tensors(engine.weights, checkpoint.tensors)
    sources = next(s for s in timeline.stages() if s.name == "fetch").detail["sources"]
    assert sources
    assert all(name.startswith("peer ") for name in sources)
