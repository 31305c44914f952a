"""The engine with KV tiers: hits restore exactly what prefill computes, so greedy output does not change; chunks of
another checkpoint or dtype never hit."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.engine import Engine
from preheat.engine.sampling import SamplingParams
from preheat.kv.build import build_tiers
from preheat.kv.fs import FileTier
from preheat.kv.keys import chunk_keys
from preheat.kv.settings import KVSettings
from preheat.kv.tiered import TieredKV
from preheat.testing.smollm2 import SmolLM2
from preheat.testing.synthetic import make_tiny_servable_model

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def prompt_ids(engine: Engine, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, engine.config.vocab_size) for _ in range(n)]


def generate(engine: Engine, ids: list[int]) -> tuple[list[int], int]:
    steps = list(engine.generate(ids, GREEDY))
    return [s.token_id for s in steps], steps[0].cached_tokens


def with_tiers(engine: Engine, **settings: object) -> TieredKV:
    spec = engine.kv_spec()
    assert spec is not None
    tiers = build_tiers(spec, KVSettings(**settings))  # type: ignore[arg-type]
    assert tiers is not None
    engine.attach_kv_tiers(tiers)
    return tiers


@pytest.fixture
def kv_engine(kv_model: Path) -> Engine:
    return Engine.from_checkpoint(str(kv_model))


@pytest.mark.parametrize("length", [300, 512, 513, 1000])
def test_l1_hits_give_token_identical_greedy_output(kv_engine: Engine, length: int) -> None:
    ids = prompt_ids(kv_engine, length)
    expected, _ = generate(kv_engine, ids)
    tiers = with_tiers(kv_engine, l1="64MiB")
    first, cached_first = generate(kv_engine, ids)
    again, cached_again = generate(kv_engine, ids)
    assert cached_first == 0
    assert cached_again == (length - 1) // 256 * 256  # every full chunk but never the last prompt token
    assert first == expected
    assert again == expected
    assert tiers.l1 is not None
    assert tiers.l1.stats.snapshot()["hits"] == cached_again // 256


def test_a_shared_prefix_with_a_new_suffix_reuses_the_prefix(kv_engine: Engine) -> None:
    with_tiers(kv_engine, l1="64MiB")
    system = prompt_ids(kv_engine, 600, seed=1)
    generate(kv_engine, [*system, *prompt_ids(kv_engine, 50, seed=2)])
    other = [*system, *prompt_ids(kv_engine, 80, seed=3)]
    tokens, cached = generate(kv_engine, other)
    assert cached == 512
    kv_engine.attach_kv_tiers(None)
    assert generate(kv_engine, other) == (tokens, 0)


def test_l2_hits_from_another_engine_give_identical_output(kv_model: Path, tmp_path: Path) -> None:
    writer, reader = Engine.from_checkpoint(str(kv_model)), Engine.from_checkpoint(str(kv_model))
    ids = prompt_ids(writer, 800)
    expected, _ = generate(reader, ids)
    shared = f"fs://{tmp_path}"
    tiers_w = with_tiers(writer, l1="64MiB", l2=shared)
    generate(writer, ids)
    tiers_w.flush()
    tiers_r = with_tiers(reader, l1="64MiB", l2=shared)
    tokens, cached = generate(reader, ids)
    assert (tokens, cached) == (expected, 768)
    assert tiers_r.l2 is not None
    assert tiers_r.l2.stats.snapshot()["hits"] == 3
    assert generate(reader, ids) == (expected, 768)  # promoted: now from L1
    assert tiers_r.l1 is not None
    assert tiers_r.l1.stats.snapshot()["hits"] == 3


@pytest.mark.parametrize("l1", [None, "64MiB"])
def test_a_damaged_l2_heals_after_one_recompute(kv_model: Path, tmp_path: Path, l1: str | None) -> None:
    writer, replica = Engine.from_checkpoint(str(kv_model)), Engine.from_checkpoint(str(kv_model))
    ids = prompt_ids(writer, 2000)
    expected, _ = generate(replica, ids)
    full = (len(ids) - 1) // 256 * 256  # 7 chunks
    shared = f"fs://{tmp_path}"
    tiers = with_tiers(writer, l2=shared)
    generate(writer, ids)
    tiers.flush()
    assert isinstance(tiers.l2, FileTier)
    for index in (2, 3, 5):  # damage three chunk files; the lookup will stop at the first
        path = Path(tiers.l2.path(chunk_keys(tiers.fingerprint, ids, 256)[index]))
        data = bytearray(path.read_bytes())
        data[-10] ^= 0x01
        path.write_bytes(bytes(data))
    restarted = with_tiers(replica, l2=shared, **({"l1": l1} if l1 else {}))  # a replica restarted on the damage
    cached = []
    for _ in range(3):
        tokens, hit = generate(replica, ids)
        restarted.flush()
        assert tokens == expected
        cached.append(hit)
    assert cached == [512, full, full]  # one recompute stored every damaged chunk again
    assert restarted.l2 is not None
    assert restarted.l2.stats.snapshot()["corrupt"] == 3  # one found by the lookup, two by the stores
    with_tiers(writer, l2=shared)  # another replica, L2 only: the directory itself healed
    assert generate(writer, ids) == (expected, full)


def test_another_checkpoint_never_hits_its_chunks(kv_model: Path, tmp_path: Path) -> None:
    other_root = make_tiny_servable_model(tmp_path / "other", seed=1)  # same shapes, other weights
    (other_root / MANIFEST_NAME).write_bytes(build_manifest(str(other_root)).to_json())
    shared = f"fs://{tmp_path / 'kv'}"
    (tmp_path / "kv").mkdir()
    first, second = Engine.from_checkpoint(str(kv_model)), Engine.from_checkpoint(str(other_root))
    ids = prompt_ids(first, 600)
    with_tiers(first, l2=shared)
    generate(first, ids)
    assert first.kv_tiers is not None
    first.kv_tiers.flush()
    with_tiers(second, l2=shared)
    assert generate(second, ids)[1] == 0


def test_another_dtype_never_hits_its_chunks(kv_model: Path, tmp_path: Path) -> None:
    f32, bf16 = Engine.from_checkpoint(str(kv_model)), Engine.from_checkpoint(str(kv_model), dtype="bfloat16")
    shared = f"fs://{tmp_path}"
    ids = prompt_ids(f32, 600)
    tiers = with_tiers(f32, l2=shared)
    generate(f32, ids)
    tiers.flush()
    with_tiers(bf16, l2=shared)
    assert generate(bf16, ids)[1] == 0
    int8 = Engine.from_checkpoint(str(kv_model))  # quantized chunks have a fingerprint of their own
    with_tiers(int8, l2=shared, kv_dtype="int8")
    assert generate(int8, ids)[1] == 0


@pytest.mark.parametrize(("kv_dtype", "min_cosine"), [("int8", 0.999), ("fp8", 0.99)])
def test_quantized_chunks_restore_close_logits(kv_engine: Engine, kv_dtype: str, min_cosine: float) -> None:
    ids = prompt_ids(kv_engine, 700)
    exact = last_logits(kv_engine, ids)
    with_tiers(kv_engine, l1="64MiB", kv_dtype=kv_dtype)
    generate(kv_engine, ids)
    tokens, cached = generate(kv_engine, ids)
    assert cached == 512
    assert len(tokens) == GREEDY.max_tokens
    restored = last_logits(kv_engine, ids)
    # Random tiny weights turn any rounding into different later tokens; what quantization must keep is the
    # prompt's logits. SmolLM2's greedy agreement with int8/fp8 chunks is measured in docs/kv-cache.md.
    assert torch.nn.functional.cosine_similarity(exact, restored, dim=0).item() >= min_cosine
    assert not torch.equal(exact, restored)  # the chunks really were quantized


def last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The logits after the prompt, with the prefix restored from the tiers when the engine has them."""
    state = engine.backend.begin()
    try:
        keys = engine._chunk_keys(ids)
        cached = engine._restore_prefix(state, keys, len(ids))
        return engine.backend.step(state, ids[cached:], cached).float()
    finally:
        engine.backend.end(state)


def test_a_model_without_identity_gets_l1_only(tiny_servable_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "no-manifest"
    shutil.copytree(tiny_servable_model, root)
    engine = Engine.from_checkpoint(str(root))
    tiers = with_tiers(engine, l1="16MiB", l2=f"fs://{tmp_path}")
    assert tiers.l1 is not None
    assert tiers.l2 is None


def test_smollm2_cache_hits_give_token_identical_chat_answers(smollm2: SmolLM2) -> None:
    engine = Engine.from_checkpoint(str(smollm2.path("keep")))
    facts = " ".join(f"Fact {i}: the code word for day {i} is w{i * 7}." for i in range(60))
    system = "You are a careful assistant. " + facts
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
    ids = engine.encode_chat(messages)
    assert len(ids) > 600
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [s.token_id for s in engine.generate(ids, params)]
    with_tiers(engine, l1="256MiB")
    list(engine.generate(ids, params))
    steps = list(engine.generate(ids, params))
    assert steps[0].cached_tokens == (len(ids) - 1) // 256 * 256
    assert [s.token_id for s in steps] == expected
