"""The engine on the embedded default model, SmolLM2-135M-Instruct (converted once per machine, tests/smollm2.py)."""

from __future__ import annotations

import pytest
import torch

from preheat.engine import Engine, SamplingParams
from preheat.testing.smollm2 import SmolLM2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(smollm2: SmolLM2) -> Engine:
    built = Engine.from_checkpoint(str(smollm2.path("keep")))
    built.warmup()
    return built


def test_answers_the_capital_of_france(engine: Engine) -> None:
    ids = engine.encode_chat(QUESTION)
    steps = list(engine.generate(ids, SamplingParams(max_tokens=24, temperature=0)))
    answer = "".join(s.text for s in steps)
    assert "Paris" in answer, answer
    assert steps[-1].finish_reason in ("stop", "length")


def test_chat_prompt_tokens_equal_transformers(engine: Engine, smollm2: SmolLM2) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(smollm2.path("keep"))
    text = reference.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.render_chat(QUESTION) == text
    assert engine.encode_chat(QUESTION) == reference.encode(text, add_special_tokens=False)


def test_logits_match_transformers_on_the_same_weights(engine: Engine, smollm2: SmolLM2) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(engine.encode_chat(QUESTION))
    model = AutoModelForCausalLM.from_pretrained(smollm2.path("keep"), dtype=torch.float32)
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    ours, cache = engine.model, engine.kv_cache
    assert ours is not None
    assert cache is not None
    seq = cache.new_sequence()
    with torch.inference_mode():
        got = ours.forward(ids, 0, cache, seq, all_logits=True)
    cache.release(seq)
    assert engine.dtype == torch.float32  # float32 weights are computed as they are (zero-copy)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
