"""The built-in Llama-family model against transformers on the same random weights, and its KV cache.

Every model here is tiny (2 layers, hidden 64) and float32, so logits must agree with transformers to rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from preheat.checkpoint.writer import save_file
from preheat.core.errors import KVError
from preheat.engine import Engine, PagedKVCache, SamplingParams, Sequence
from preheat.engine.model import LlamaModel
from preheat.kv.spec import KVLayout

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
VOCAB, HIDDEN, INTER, LAYERS, HEADS = 384, 64, 96, 2, 4  # the vocabulary of the tiny servable tokenizer


@pytest.fixture
def model_dir(tmp_path: Path, tiny_servable_model: Path) -> Path:
    """An empty model directory holding only the tiny servable model's tokenizer (write_model adds the rest)."""
    root = tmp_path / "model"
    root.mkdir()
    (root / "tokenizer.json").write_bytes((tiny_servable_model / "tokenizer.json").read_bytes())
    return root


def write_model(root: Path, **options: object) -> Path:
    """A random float32 checkpoint in Hugging Face layout, into ``root``. ``options``: ``arch`` (llama, mistral,
    qwen2), ``kv_heads``, ``tied``, and any other config.json fields."""
    arch = str(options.pop("arch", "llama"))
    kv_heads = int(options.pop("kv_heads", 2))  # type: ignore[call-overload]  # an int by construction
    tied = bool(options.pop("tied", False))
    head_dim = HIDDEN // HEADS
    config: dict[str, object] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        **options,
    }
    g = torch.Generator().manual_seed(hash(arch) % 1000 + kv_heads)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    kv = kv_heads * head_dim
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        }
        if arch == "qwen2":  # Qwen2 has biases on q, k and v (and nowhere else)
            shapes |= {p + "self_attn.q_proj.bias": (HIDDEN,), p + "self_attn.k_proj.bias": (kv,)}
            shapes |= {p + "self_attn.v_proj.bias": (kv,)}
    tensors = {name: 0.08 * torch.randn(s, generator=g) for name, s in shapes.items()}
    tensors |= {name: 1 + t for name, t in tensors.items() if name.endswith("norm.weight")}  # norms near 1
    save_file(tensors, str(root / "model.safetensors"), {"format": "pt"})
    (root / "config.json").write_text(json.dumps(config))
    return root


def transformers_logits(root: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    with torch.no_grad():
        logits: torch.Tensor = model(ids[None]).logits[0]
    return logits


def native(engine: Engine) -> tuple[LlamaModel, PagedKVCache]:
    assert engine.model is not None, "a Llama-family model runs natively"
    assert engine.kv_cache is not None
    return engine.model, engine.kv_cache


def our_logits(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position from one prefill of ``ids``."""
    model, cache = native(engine)
    seq = cache.new_sequence()
    try:
        with torch.inference_mode():
            logits: torch.Tensor = model.forward(ids, 0, cache, seq, all_logits=True)
    finally:
        cache.release(seq)
    return logits


IDS = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(7))
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES: dict[str, dict[str, object]] = {
    "llama-gqa": {"arch": "llama", "kv_heads": 2},
    "llama-mha": {"arch": "llama", "kv_heads": HEADS},
    "llama-mqa-tied": {"arch": "llama", "kv_heads": 1, "tied": True},
    "llama3-rope-scaling": {"arch": "llama", "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    "llama-linear-rope": {"arch": "llama", "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama-dynamic-rope": {"arch": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "mistral": {"arch": "mistral", "sliding_window": 4096, "head_dim": 16},
    "qwen2-biases": {"arch": "qwen2", "use_sliding_window": False, "sliding_window": 32, "tied": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(model_dir: Path, case: str) -> None:
    root = write_model(model_dir, **CASES[case])
    engine = Engine.from_checkpoint(str(root), dtype="float32")
    torch.testing.assert_close(our_logits(engine, IDS), transformers_logits(root, IDS), atol=1e-4, rtol=1e-4)


def test_float32_weights_are_bound_without_copies(model_dir: Path) -> None:
    root = write_model(model_dir)
    engine = Engine.from_checkpoint(str(root), dtype="float32", load_mode="mmap")
    model, _ = native(engine)
    q = model.layers[0].q
    # A view of the whole mapped file, not a tensor of its own.
    assert q.untyped_storage().nbytes() > q.numel() * q.element_size()
    assert model.converted_bytes == 0


def test_cached_prefill_and_decode_equal_full_recompute(model_dir: Path) -> None:
    engine = Engine.from_checkpoint(str(write_model(model_dir)), dtype="float32")
    full = our_logits(engine, IDS)
    model, cache = native(engine)
    seq = cache.new_sequence()
    pieces, start = [], 0
    with torch.inference_mode():
        for size in (7, 5, 1, 1, 9):  # a prefill, a cached prefill, single decode steps, another cached prefill
            pieces.append(model.forward(IDS[start : start + size], start, cache, seq, all_logits=True))
            start += size
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-5, rtol=1e-5)


def test_bfloat16_decode_agrees_with_bfloat16_recompute(model_dir: Path) -> None:
    # 16-bit single-token steps on CPU take their own attention path (two matmuls instead of torch's flash kernel).
    engine = Engine.from_checkpoint(str(write_model(model_dir)), dtype="bfloat16")
    full = our_logits(engine, IDS)
    model, cache = native(engine)
    seq = cache.new_sequence()
    with torch.inference_mode():
        model.forward(IDS[:-3], 0, cache, seq)
        steps = [model.forward(IDS[i : i + 1], i, cache, seq) for i in range(len(IDS) - 3, len(IDS))]
    torch.testing.assert_close(torch.stack(steps), full[-3:], atol=0.05, rtol=0.02)


def greedy_continue(engine: Engine, seq: Sequence, logits: torch.Tensor, steps: int) -> list[int]:
    model, cache = native(engine)
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            token = int(logits.argmax())
            out.append(token)
            logits = model.forward(torch.tensor([token]), seq.length, cache, seq)
    return out


def test_exported_chunks_imported_into_a_fresh_sequence_continue_identically(model_dir: Path) -> None:
    engine = Engine.from_checkpoint(str(write_model(model_dir)), dtype="float32")
    model, cache = native(engine)
    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(3))
    chunk = 32  # two 16-token blocks per chunk
    with torch.inference_mode():
        source = cache.new_sequence()
        want = model.forward(ids, 0, cache, source)
        # What a KV tier does: copy whole chunks out (from views of the pool), later bring them back.
        views = [cache.export_chunk(source, start, chunk) for start in (0, chunk)]
        assert all(v.untyped_storage().data_ptr() == cache.pool.untyped_storage().data_ptr() for v in views)
        assert views[0].is_contiguous()
        assert views[0].shape == cache.layout.chunk_shape(chunk)
        saved = [v.clone() for v in views]
        expected_tokens = greedy_continue(engine, source, want, 8)
        cache.release(source)

        restored = cache.new_sequence()
        cache.import_chunk(restored, 0, saved[0])
        cache.chunk_view(restored, chunk, chunk).copy_(saved[1])  # the zero-copy way: read straight into the pool
        cache.mark_filled(restored, 2 * chunk)
        got = model.forward(ids[2 * chunk :], 2 * chunk, cache, restored)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert greedy_continue(engine, restored, got, 8) == expected_tokens


def tiny_cache(num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(KVLayout(2, 2, 4, 4, torch.float32), num_blocks, torch.device("cpu"))


def test_fragmented_chunks_still_round_trip() -> None:
    cache = tiny_cache()
    a, b = cache.new_sequence(), cache.new_sequence()
    for _ in range(2):  # interleaved growth: a gets blocks 0 and 2, b gets 1 and 3
        cache.reserve(a, len(a.blocks) * 4 + 4)
        cache.reserve(b, len(b.blocks) * 4 + 4)
    assert a.blocks == [0, 2]
    data = torch.randn(cache.layout.chunk_shape(8))
    cache.import_chunk(a, 0, data)
    assert not cache.is_view(a, 0, 8)
    torch.testing.assert_close(cache.export_chunk(a, 0, 8), data)


def test_chunk_boundaries_and_shapes_are_checked() -> None:
    cache = tiny_cache()
    seq = cache.new_sequence()
    with pytest.raises(KVError, match="multiples of the block size"):
        cache.export_chunk(seq, 2, 4)
    with pytest.raises(KVError, match="holds K/V for 0 tokens"):
        cache.export_chunk(seq, 0, 4)
    with pytest.raises(KVError, match="does not fit"):
        cache.import_chunk(seq, 0, torch.zeros(1, 2, 2, 2, 4, 5))
    with pytest.raises(KVError, match="gap"):
        cache.import_chunk(seq, 4, torch.zeros(cache.layout.chunk_shape(4)))
    with pytest.raises(KVError, match="KV cache full"):
        cache.reserve(seq, 4 * 9)


def test_released_blocks_are_reused() -> None:
    cache = tiny_cache(4)
    for _ in range(3):
        seq = cache.new_sequence()
        cache.reserve(seq, 16)
        cache.release(seq)
    assert cache.free_blocks == 4


def test_other_architectures_run_through_transformers(tmp_path: Path, tiny_servable_model: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=128, n_embd=32, n_layer=2, n_head=2))
    root = tmp_path / "gpt2"
    model.save_pretrained(root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / name).write_bytes((tiny_servable_model / name).read_bytes())
    engine = Engine.from_checkpoint(str(root))
    assert engine.kv_cache is None  # no chunk export for the fallback
    assert engine.kv_spec() is None  # so no KV tiers either
    ids = engine.encode_prompt("The capital of France")
    steps = list(engine.generate(ids, SamplingParams(max_tokens=5, temperature=0)))
    want = list(ids)
    with torch.no_grad():
        for _ in range(5):  # greedy by full recompute, no cache
            want.append(int(model(torch.tensor([want])).logits[0, -1].argmax()))
    assert [s.token_id for s in steps] == want[len(ids) :]
    assert steps[-1].finish_reason == "length"


def test_importing_the_engine_loads_neither_transformers_nor_jinja2() -> None:
    code = "import sys, preheat.engine; print(sorted(m for m in ('transformers', 'jinja2') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
