"""The Llama family in plain torch (Llama 2/3, Mistral, Qwen2, SmolLM2), over weights bound straight from a load.

No ``nn.Module``s: a layer is a handful of tensors taken from ``preheat.load``'s dict as they are (on CPU with mode
``mmap`` those are views of the page cache, shared by every replica on the node), and the forward pass is functions
over them. Tensors are only copied when a dtype conversion was asked for (``dtype`` differs from the checkpoint's),
all of them into one mapping on CPU (``preheat.engine.weights``).

The math follows transformers' ``LlamaForCausalLM`` operation by operation (RMSNorm in float32 then cast, RoPE from
a float32 table, softmax over scaled dot products, SiLU-gated MLP), so logits agree with it to float32 rounding.
Biases of q/k/v (Qwen2), o_proj and the MLP are used when the checkpoint has them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  # the conventional alias

from preheat.core.errors import CheckpointError, KVError
from preheat.engine.config import ModelConfig
from preheat.engine.kv import PagedKVCache, Sequence
from preheat.engine.rope import apply_rotary, cos_sin_table, inverse_frequencies
from preheat.engine.weights import needs_conversion, to_compute_dtype
from preheat.kv.spec import KVLayout

log = logging.getLogger("preheat.engine")

# scaled_dot_product_attention groups query heads over KV heads itself from torch 2.5 on (no repeated K/V copies).
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None


def _layer_tensors(c: ModelConfig, n: int) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """Layer ``n``'s tensors: ``_Layer`` field -> (checkpoint name, shape the config implies, whether optional)."""
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    q_out, kv_out = c.num_heads * d, c.num_kv_heads * d
    a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
    return {
        "input_norm": (f"model.layers.{n}.input_layernorm.weight", (h,), False),
        "q": (a + "q_proj.weight", (q_out, h), False),
        "k": (a + "k_proj.weight", (kv_out, h), False),
        "v": (a + "v_proj.weight", (kv_out, h), False),
        "o": (a + "o_proj.weight", (h, q_out), False),
        "q_bias": (a + "q_proj.bias", (q_out,), True),
        "k_bias": (a + "k_proj.bias", (kv_out,), True),
        "v_bias": (a + "v_proj.bias", (kv_out,), True),
        "o_bias": (a + "o_proj.bias", (h,), True),
        "post_norm": (f"model.layers.{n}.post_attention_layernorm.weight", (h,), False),
        "gate": (m + "gate_proj.weight", (i, h), False),
        "up": (m + "up_proj.weight", (i, h), False),
        "down": (m + "down_proj.weight", (h, i), False),
        "gate_bias": (m + "gate_proj.bias", (i,), True),
        "up_bias": (m + "up_proj.bias", (i,), True),
        "down_bias": (m + "down_proj.bias", (h,), True),
    }


class WeightBinder:
    """Takes tensors out of a loaded state dict by name, checking shapes, converting dtype/device only if needed.

    ``names``: every tensor the model will take, so that those needing a conversion are converted together up
    front, on CPU into one mapping (``preheat.engine.weights``: a sleep then gives their memory back whole)."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        where: str,
        names: Collection[str] = (),
    ):
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.where = where
        self.used: set[str] = set()
        wanted = set(names)
        pending = {  # in the checkpoint's order: the copies then lie in memory as the files do
            name: tensor
            for name, tensor in weights.items()
            if name in wanted and needs_conversion(tensor, dtype, device)
        }
        self.converted = to_compute_dtype(pending, dtype, device)
        self.converted_bytes = sum(t.numel() * t.element_size() for t in self.converted.values())

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        found = self.optional(name, shape)
        if found is None:
            raise CheckpointError(f"{self.where}: tensor {name!r} is missing", path=self.where, tensor=name)
        return found

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        tensor = self.weights.get(name)
        if tensor is None:
            return None
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{self.where}: tensor {name!r} has shape {list(tensor.shape)}, the config implies {list(shape)}",
                path=self.where,
                tensor=name,
            )
        self.used.add(name)
        if not needs_conversion(tensor, self.dtype, self.device):
            return tensor  # bound as loaded: zero-copy
        copy = self.converted.get(name)
        if copy is None:  # a name the model did not announce: converted on its own
            copy = to_compute_dtype({name: tensor}, self.dtype, self.device)[name]
            self.converted_bytes += copy.numel() * copy.element_size()
        return copy


class LlamaModel:
    """A Llama-family decoder over bound weights, computing into a ``PagedKVCache``.

    >>> model = LlamaModel(config, weights, dtype=torch.float32, device=cpu, max_len=2048)   # doctest: +SKIP
    >>> logits = model.forward(torch.tensor([1, 2, 3]), 0, cache, seq)                     # doctest: +SKIP
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        where: str = "checkpoint",
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.max_len = max_len
        c = config
        h = c.hidden_size
        layers = [_layer_tensors(c, n) for n in range(c.num_layers)]
        names = {"model.embed_tokens.weight", "model.norm.weight", *(t[0] for specs in layers for t in specs.values())}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        bind = WeightBinder(weights, dtype, device, where, names)
        self.embed = bind.get("model.embed_tokens.weight", (c.vocab_size, h))
        self.layers: list[_Layer] = []
        for specs in layers:
            # A required field gets get()'s Tensor, an optional one optional()'s Tensor | None, as _Layer says.
            bound: dict[str, Any] = {  # Any: Tensor or Tensor | None by field, which one dict type cannot say
                field: (bind.optional if optional else bind.get)(name, shape)
                for field, (name, shape, optional) in specs.items()
            }
            self.layers.append(_Layer(**bound))
        self.norm = bind.get("model.norm.weight", (h,))
        head = None if c.tie_word_embeddings else bind.optional("lm_head.weight", (c.vocab_size, h))
        # Tied (or no lm_head stored, as converters write tied models): the output layer is the embedding.
        self.lm_head = head if head is not None else self.embed
        self.converted_bytes = bind.converted_bytes
        unused = sorted(set(weights) - bind.used - {"lm_head.weight"})
        if unused:  # tensors the model does not know: often a naming mismatch worth seeing, never fatal
            log.warning("%s: %d tensors not used by the model, e.g. %s", where, len(unused), ", ".join(unused[:3]))
        d = c.head_dim
        inv_freq = inverse_frequencies(c.rope, d, max_position_embeddings=c.max_position_embeddings, max_len=max_len)
        self.rope_table = cos_sin_table(inv_freq, max_len, dtype, device)
        self.scale = d**-0.5

    def move(self, device: torch.device, *, pin: bool = False) -> int:
        """Move every tensor of the model to ``device`` (``pin``: into page-locked host memory, for a fast copy
        back); returns the bytes moved. Sleep level 1 on CUDA (``Engine.offload``) and the wake after it."""
        moved = 0

        def to(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal moved
            moved += tensor.numel() * tensor.element_size()
            out = tensor.to(device, non_blocking=pin or device.type == "cuda")
            return out.pin_memory() if pin and not out.is_pinned() else out

        tied = self.lm_head is self.embed
        self.embed = to(self.embed)
        self.lm_head = self.embed if tied else to(self.lm_head)
        self.norm = to(self.norm)
        self.layers = [
            replace(layer, **{f.name: to(t) for f in fields(_Layer) if (t := getattr(layer, f.name)) is not None})
            for layer in self.layers
        ]
        self.rope_table = to(self.rope_table)
        self.device = device
        return moved

    def kv_layout(self, block_size: int) -> KVLayout:
        """The cache layout this model writes."""
        c = self.config
        return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, self.dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in float32 whatever the compute dtype, cast back, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, causal: bool
    ) -> torch.Tensor:
        """``[heads, T, head_dim]`` attention of ``q`` over ``k``/``v`` ``[kv_heads, L, head_dim]`` (GQA)."""
        groups = self.config.num_groups
        if q.shape[1] == 1 and q.dtype != torch.float32 and q.device.type == "cpu":
            # One 16-bit query on CPU (decode): torch's CPU flash kernel takes ~1.1 ms per call at 2k keys, two
            # small matmuls ~0.14 ms (docs/engine.md). Softmax in float32, as transformers' eager attention.
            kv_heads, _, head_dim = k.shape
            scores = torch.matmul(q.reshape(kv_heads, groups, head_dim), k.transpose(1, 2)) * self.scale
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(probs, v).reshape(q.shape)
        if groups > 1 and not _SDPA_GQA:
            k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        extra = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=causal, scale=self.scale, **extra
        )
        return out[0]

    def forward(
        self,
        ids: torch.Tensor,
        start: int,
        cache: PagedKVCache,
        seq: Sequence,
        *,
        all_logits: bool = False,
        depth: int | None = None,
    ) -> torch.Tensor:
        """Run tokens ``ids`` ``[T]`` at positions ``start .. start + T`` of ``seq`` (whose first ``start`` tokens
        are in ``cache``); return float32 logits of the last position ``[vocab]`` (every position ``[T, vocab]``
        with ``all_logits``). Writes the tokens' K/V into the cache and advances ``seq.length``. ``depth``: run
        only the first ``depth`` layers (``Engine.warmup``: every kernel once, at a fraction of the cost; the
        sequence's K/V of the other layers are then garbage, so it must be released after)."""
        n = int(ids.shape[0])
        end = start + n
        if start > seq.length or end > self.max_len:
            raise KVError(
                f"cannot run positions {start}..{end} of sequence {seq.seq_id}: it holds {seq.length} tokens and the "
                f"model was built for {self.max_len}"
            )
        cache.reserve(seq, end)
        slots = cache.slots(seq, start, n)
        cos, sin = self.rope_table[0, start:end], self.rope_table[1, start:end]
        mask = None
        if 1 < n < end:
            # New tokens attend to the whole cached prefix and causally among themselves (bottom-right aligned).
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        x = F.embedding(ids.to(self.device), self.embed)
        c = self.config
        for index, layer in enumerate(self.layers[:depth]):
            hidden = self._rms_norm(x, layer.input_norm)
            q = F.linear(hidden, layer.q, layer.q_bias).view(n, c.num_heads, c.head_dim).transpose(0, 1)
            k = F.linear(hidden, layer.k, layer.k_bias).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = F.linear(hidden, layer.v, layer.v_bias).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            cache.write(index, slots, k, v)
            if start == 0:
                keys, values = k, v  # nothing cached before: attend to the fresh K/V without reading them back
            else:
                keys, values = cache.read(seq, index, end)
            attended = self._attention(q, keys, values, mask, causal=mask is None and n > 1)
            x = x + F.linear(attended.transpose(0, 1).reshape(n, -1), layer.o, layer.o_bias)
            hidden = self._rms_norm(x, layer.post_norm)
            gated = F.silu(F.linear(hidden, layer.gate, layer.gate_bias)) * F.linear(hidden, layer.up, layer.up_bias)
            x = x + F.linear(gated, layer.down, layer.down_bias)
        seq.length = end
        if not all_logits:
            x = x[-1:]
        logits = F.linear(self._rms_norm(x, self.norm), self.lm_head).float()
        return logits if all_logits else logits[0]
