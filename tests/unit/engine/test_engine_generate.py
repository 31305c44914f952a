"""Generation through the whole engine on the tiny servable model: sampling, stopping, streaming text, limits.

The model's weights are random, so tests first observe what it generates (greedy is deterministic) and then ask for
behaviour relative to that: stop at a string it is known to produce, end at a token it is known to emit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from preheat.core.errors import RequestError
from preheat.core.timeline import Timeline
from preheat.engine import Engine, GenerationStep, SamplingParams
from preheat.engine.sampling import StopStrings, top_p_filter

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(tiny_servable_model: Path) -> Engine:
    built = Engine.from_checkpoint(str(tiny_servable_model))
    built.warmup()
    return built


def run(engine: Engine, params: SamplingParams, prompt: list[int] | None = None) -> list[GenerationStep]:
    return list(engine.generate(prompt or engine.encode_chat(CHAT), params))


def text_of(steps: list[GenerationStep]) -> str:
    return "".join(s.text for s in steps)


def test_chat_template_renders_messages_and_the_assistant_turn(engine: Engine) -> None:
    rendered = engine.tokenizer.render_chat(CHAT)
    assert rendered == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.encode_chat(CHAT)
    assert ids[0] == engine.tokenizer.tokenizer.token_to_id("<|im_start|>")  # a special token, not its characters
    assert engine.tokenizer.decode(ids) == "user\nWhat is the capital of France?\nassistant\n"


def test_messages_the_template_cannot_render_are_request_errors(engine: Engine) -> None:
    with pytest.raises(RequestError, match="role"):
        engine.encode_chat([{"content": "no role"}])


def test_max_tokens_ends_with_length(engine: Engine) -> None:
    steps = run(engine, SamplingParams(max_tokens=5, temperature=0))
    assert len(steps) == 5
    assert [s.finish_reason for s in steps] == [None] * 4 + ["length"]
    assert all(s.prompt_tokens == len(engine.encode_chat(CHAT)) and s.cached_tokens == 0 for s in steps)


def test_greedy_is_deterministic_and_tiny_top_p_is_greedy(engine: Engine) -> None:
    greedy = [s.token_id for s in run(engine, SamplingParams(max_tokens=12, temperature=0))]
    assert [s.token_id for s in run(engine, SamplingParams(max_tokens=12, temperature=0))] == greedy
    nucleus = run(engine, SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=1))
    assert [s.token_id for s in nucleus] == greedy


def test_seeded_sampling_reproduces_and_seeds_differ(engine: Engine) -> None:
    def sample(seed: int) -> list[int]:
        return [s.token_id for s in run(engine, SamplingParams(max_tokens=24, temperature=1.5, seed=seed))]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    torch.testing.assert_close(top_p_filter(probs.clone(), 0.7), torch.tensor([0.0, 0.625, 0.375, 0.0]))
    torch.testing.assert_close(top_p_filter(probs.clone(), 0.5), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_stop_string_ends_generation_and_is_not_in_the_text(engine: Engine) -> None:
    full = text_of(run(engine, SamplingParams(max_tokens=40, temperature=0)))
    assert len(full) > 8, full
    stop = full[4:7]
    steps = run(engine, SamplingParams(max_tokens=40, temperature=0, stop=["never appears", stop]))
    assert steps[-1].finish_reason == "stop"
    assert text_of(steps) == full[: full.index(stop)]


def test_stop_strings_across_deltas_are_held_back_then_released() -> None:
    stops = StopStrings(["STOP"])
    assert stops.feed("abcS") == ("abc", False)  # "S" might start STOP
    assert stops.feed("T") == ("", False)
    assert stops.feed("x") == ("STx", False)  # it did not: released
    assert stops.feed("yST") == ("y", False)
    assert stops.feed("OP and more") == ("", True)
    assert StopStrings(["ab"]).feed("xa") == ("x", False)


def test_eos_ends_with_stop_and_adds_no_text(engine: Engine, tiny_servable_model: Path, tmp_path: Path) -> None:
    greedy = run(engine, SamplingParams(max_tokens=12, temperature=0))
    ids = [s.token_id for s in greedy]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token greedy emits first at step k
    root = tmp_path / "model"
    shutil.copytree(tiny_servable_model, root)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[k]]}))
    other = Engine.from_checkpoint(str(root))
    steps = run(other, SamplingParams(max_tokens=12, temperature=0))
    assert [s.token_id for s in steps] == ids[: k + 1]
    assert steps[-1].finish_reason == "stop"
    assert text_of(steps) == other.tokenizer.decode(ids[:k])


def test_streamed_deltas_concatenate_to_the_decoded_text(engine: Engine) -> None:
    # Sampling from random weights emits arbitrary byte tokens, so multi-byte characters arrive split over tokens.
    steps = run(engine, SamplingParams(max_tokens=64, temperature=2.0, seed=5))
    assert text_of(steps) == engine.tokenizer.decode([s.token_id for s in steps])


def test_multibyte_characters_split_over_tokens_are_never_emitted_broken(engine: Engine) -> None:
    text = "héllo 世界 🙂 café"
    tok = engine.tokenizer.tokenizer
    # One token per byte: the worst case, every multi-byte character split over 2-4 tokens.
    found = [tok.token_to_id(ch) for word, _ in tok.pre_tokenizer.pre_tokenize_str(text) for ch in word]
    ids = [i for i in found if i is not None]
    assert len(ids) == len(text.encode())
    detok = engine.tokenizer.detokenizer([])
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens completed no character


def test_should_stop_ends_the_stream_between_tokens(engine: Engine) -> None:
    seen: list[GenerationStep] = []
    for step in engine.generate(
        engine.encode_chat(CHAT), SamplingParams(max_tokens=50, temperature=0), should_stop=lambda: len(seen) >= 3
    ):
        seen.append(step)
    assert len(seen) == 3
    assert seen[-1].finish_reason is None


def test_a_stream_closed_early_gives_its_kv_blocks_back(engine: Engine) -> None:
    assert engine.kv_cache is not None
    free = engine.kv_cache.free_blocks
    stream = engine.generate(engine.encode_chat(CHAT), SamplingParams(max_tokens=50, temperature=0))
    next(stream)
    assert engine.kv_cache.free_blocks < free
    stream.close()  # what a server does when its client disconnects
    assert engine.kv_cache.free_blocks == free


def test_prompt_longer_than_the_context_is_a_request_error(tiny_servable_model: Path) -> None:
    small = Engine.from_checkpoint(str(tiny_servable_model), max_model_len=32)
    with pytest.raises(RequestError, match="at most 31 tokens"):
        small.generate([5] * 32, SamplingParams())
    steps = list(small.generate([5] * 28, SamplingParams(max_tokens=10, temperature=0)))
    assert len(steps) == 4  # prompt and output together fill the context
    assert steps[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(stop=[""]), "stop"),
    ],
)
def test_bad_requests_are_refused_before_any_work(engine: Engine, params: SamplingParams, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        engine.generate([1, 2, 3], params)


def test_empty_prompt_and_unknown_token_ids_are_refused(engine: Engine) -> None:
    with pytest.raises(RequestError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        engine.generate([10**6], SamplingParams())


def test_load_stages_are_recorded_on_the_timeline(tiny_servable_model: Path) -> None:
    timeline = Timeline()
    Engine.from_checkpoint(str(tiny_servable_model), timeline=timeline, load_mode="read")
    stages = {s.name: s for s in timeline.stages()}
    assert list(stages) == ["weight_load", "model_build", "tokenizer"]
    assert (stages["weight_load"].nbytes or 0) > 0
    assert stages["weight_load"].detail["mode"] == "read"
    assert stages["model_build"].detail["backend"] == "native"
    assert all(s.end is not None and s.end >= s.start for s in stages.values())


def test_a_quantized_checkpoint_loads_dequantized(tiny_servable_model: Path, tmp_path: Path) -> None:
    from preheat.convert import convert

    convert(str(tiny_servable_model), tmp_path / "int8", dtype="int8")
    quantized = Engine.from_checkpoint(str(tmp_path / "int8"))
    steps = run(quantized, SamplingParams(max_tokens=4, temperature=0))
    assert steps[-1].finish_reason == "length"
    assert (quantized.identity or "").startswith("xxh3-128:")
