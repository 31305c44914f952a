"""Weights converted at load, and the node cache's converted copy (preheat.engine.weights, preheat.engine.copies).

A bf16 checkpoint computed in float32 (what a CPU without native bf16 does; asked for here with ``dtype="float32"``,
so it runs on any CPU) is converted by the first load, which writes the converted weights into the node cache;
every later load maps them instead and answers the same tokens. Real checkpoints on disk, a real node cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from preheat.checkpoint.writer import save_file
from preheat.convert import convert
from preheat.core.timeline import Timeline
from preheat.engine import Engine
from preheat.engine.copies import COPY_FILE, copy_key
from preheat.engine.sampling import SamplingParams
from preheat.store.cache import ModelCache

PROMPT = [1, 5, 9, 13, 2, 7]


@pytest.fixture(scope="module")
def tiny_bf16(tiny_servable_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny servable model as a bf16 preheat checkpoint (with the preheat.json identity a copy is keyed by)."""
    target = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    convert(tiny_servable_model, target, dtype="bf16")
    return target


def load(path: Path, cache: ModelCache | None) -> tuple[Engine, dict[str, Any]]:  # Any: the stage's JSON detail
    """An engine computing in float32, and its ``model_build`` detail; ``cache``: where copies are kept, if any."""
    timeline = Timeline(0.0)
    engine = Engine.from_checkpoint(str(path), dtype="float32", timeline=timeline, copies=cache)
    build = next(s for s in timeline.stages() if s.name == "model_build")
    return engine, dict(build.detail)


def greedy(engine: Engine) -> list[int]:
    return [step.token_id for step in engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))]


def model_tensors(engine: Engine) -> list[torch.Tensor]:
    model = engine.model
    assert model is not None
    layers = [t for layer in model.layers for t in vars(layer).values() if t is not None]
    head = [] if model.lm_head is model.embed else [model.lm_head]
    return [model.embed, model.norm, *layers, *head]


def identity(path: Path) -> str:
    return str(json.loads((path / "preheat.json").read_text())["identity"])


def test_the_first_converting_load_keeps_a_copy_that_later_loads_map(tiny_bf16: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    first, built = load(tiny_bf16, cache)
    assert built["converted_bytes"] == sum(t.nbytes for t in model_tensors(first))  # every weight, in float32
    assert built["copy"] == "none yet: writing one"
    assert first.copy_writer is not None
    assert first.copy_writer.wait(60)
    published = cache.lookup(copy_key(identity(tiny_bf16), torch.float32))
    assert published is not None
    again, built = load(tiny_bf16, cache)
    assert built["converted_bytes"] == 0  # mapped, not converted
    assert built["copy"] == published
    assert again.copy_writer is None
    assert greedy(again) == greedy(first)  # the copy holds exactly what the conversion computes
    assert [e.in_use for e in cache.entries() if e.path == published] == [True]  # leased while the model maps it


def test_converted_weights_share_one_mapping(tiny_bf16: Path) -> None:
    engine, _ = load(tiny_bf16, None)
    storages = {t.untyped_storage().data_ptr() for t in model_tensors(engine)}
    assert len(storages) == 1  # freed together: a sleep gives them back whole (tests/integration/server/test_sleep.py)


def test_a_copy_that_does_not_match_the_checkpoint_is_not_used(tiny_bf16: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    cache.ensure_dirs()
    key = copy_key(identity(tiny_bf16), torch.float32)
    partial = Path(cache.partial_dir(key))
    partial.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, partial / COPY_FILE)
    cache.publish(key, "somewhere-else")
    engine, built = load(tiny_bf16, cache)
    assert built["converted_bytes"] > 0  # converted, as without a copy
    assert not any(e.in_use for e in cache.entries())  # and not kept leased
    reference, _ = load(tiny_bf16, None)
    assert greedy(engine) == greedy(reference)
