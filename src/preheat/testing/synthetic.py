"""Random-weight, Llama-shaped checkpoints in Hugging Face layout, for tests, benchmarks and demos.

No hub access: the weights are random, the shapes and names are real (``model.layers.N.self_attn.q_proj.weight``
...), and the directory holds ``config.json`` plus either ``model.safetensors`` or shards with
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from preheat.checkpoint.writer import save_file


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-family model."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def nbytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(math.prod(s) for s in self.tensor_shapes().values()) * size

    @classmethod
    def of_size(cls, target_bytes: int, dtype: torch.dtype = torch.bfloat16) -> LlamaShape:
        """A Llama-proportioned shape (hidden 2048, 32k vocab) whose layer count brings it near ``target_bytes``."""
        base = cls(32000, 2048, 5632, 1, 16, 4)
        per_layer = base.nbytes(dtype) - cls(32000, 2048, 5632, 0, 16, 4).nbytes(dtype)
        fixed = base.nbytes(dtype) - per_layer
        layers = max(1, round((target_bytes - fixed) / per_layer))
        return cls(32000, 2048, 5632, layers, 16, 4)

    def config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **asdict(self),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": "bfloat16",
        }


def write_llama_checkpoint(
    directory: str | os.PathLike[str],
    shape: LlamaShape | None = None,
    *,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write a random Llama-shaped checkpoint into ``directory``; returns the tensors written (for comparisons)."""
    shape = shape or LlamaShape()
    out = os.fspath(directory)
    os.makedirs(out, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, dims in shape.tensor_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.1 * torch.randn(dims, generator=generator)).to(dtype)
        else:
            tensors[name] = (torch.randn(dims, generator=generator) * 0.05).to(dtype)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(shape.config(), handle, indent=2)
    if shards <= 1:
        save_file(tensors, os.path.join(out, "model.safetensors"), {"format": "pt"})
        return tensors
    names = list(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if size >= total * len(groups) / shards and len(groups) < shards:
            groups.append([])
        groups[-1].append(name)
        size += tensors[name].numel() * tensors[name].element_size()
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        file_name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(out, file_name), {"format": "pt"})
        weight_map |= dict.fromkeys(group, file_name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=2)
    return tensors


# A ChatML template (the one SmolLM2 and Qwen2 use, without a default system prompt), for servable test models.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TINY_CORPUS = (
    "The capital of France is Paris. What is the capital of France? Hello, world! "
    "Ünïcödé wörds: café, naïve, Straße, 世界, こんにちは, 🙂 and 🚀 travel through byte-level tokens. "
    "Cold starts are measured stage by stage; weights stream into memory and tokens stream out."
)


def make_tiny_servable_model(
    directory: str | os.PathLike[str], *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """A complete, servable random-weight Llama in ``directory``: ``config.json``, ``model.safetensors``, a byte-level
    BPE ``tokenizer.json`` (~380 tokens, so any UTF-8 text encodes), ``tokenizer_config.json`` with a ChatML
    template, and ``generation_config.json`` (EOS ``<|im_end|>``). Returns the directory.

    The text it generates is random, but real: every byte of the pipeline (loading, tokenizer, template, sampling,
    streaming) runs as for a real model. Needs the ``tokenizers`` package.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = os.fspath(directory)
    os.makedirs(out, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(_TINY_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    shape = LlamaShape(vocab, 64, 128, 2, 4, 2)
    write_llama_checkpoint(out, shape, dtype=dtype, seed=seed)
    bos, eos = (tokenizer.token_to_id(t) for t in _TINY_SPECIALS[1:])
    config = {
        **shape.config(),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    side = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos},
        "tokenizer_config.json": {
            "bos_token": _TINY_SPECIALS[1],
            "eos_token": _TINY_SPECIALS[2],
            "pad_token": _TINY_SPECIALS[2],
            "unk_token": _TINY_SPECIALS[0],
            "chat_template": TINY_CHAT_TEMPLATE,
            "model_max_length": 2048,
        },
    }
    for name, doc in side.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as handle:
            json.dump(doc, handle, indent=2, ensure_ascii=False)
    return Path(out)
