"""What the engine runs on: the native Llama-family model with its KV cache, or a transformers model; and the
choices made when building one (compute dtype, context length)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from preheat.core.errors import ConfigError
from preheat.engine.config import ModelConfig
from preheat.engine.kv import PagedKVCache, Sequence
from preheat.engine.model import LlamaModel

if TYPE_CHECKING:  # at run time the fallback module, and transformers with it, is only imported when needed
    from preheat.engine.fallback import TransformersModel

DEFAULT_MAX_MODEL_LEN = 8192  # when the model allows more: bounds KV memory (on CUDA it is allocated up front)
BLOCK_SIZE = 16  # tokens per KV block; the KV tier's chunks (256 tokens) are 16 consecutive blocks
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class Backend(Protocol):
    """What the engine needs from a model: per-sequence state, forward to the last position's logits, release."""

    def begin(self) -> object: ...

    def step(self, state: object, ids: list[int], start: int) -> torch.Tensor: ...

    def end(self, state: object) -> None: ...


class NativeBackend:
    """The built-in model over the paged KV cache: a sequence's state is its ``Sequence`` (block table)."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache

    def begin(self) -> object:
        return self.cache.new_sequence()

    def step(self, state: object, ids: list[int], start: int) -> torch.Tensor:
        assert isinstance(state, Sequence)
        return self.model.forward(torch.tensor(ids, dtype=torch.int64), start, self.cache, state)

    def end(self, state: object) -> None:
        assert isinstance(state, Sequence)
        self.cache.release(state)


class FallbackBackend:
    """A transformers model: a sequence's state is its cache object (positions are implied by its length)."""

    def __init__(self, model: TransformersModel) -> None:
        self.model = model

    def begin(self) -> object:
        return self.model.new_state()

    def step(self, state: object, ids: list[int], start: int) -> torch.Tensor:
        from preheat.engine.fallback import FallbackState

        assert isinstance(state, FallbackState)
        return self.model.forward(state, ids)

    def end(self, state: object) -> None:
        return None  # transformers' cache object is dropped with the state


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX) and torch dispatches its AVX-512
    kernels; elsewhere torch emulates it, slower than float32. Asks torch's private probes, and says False if a
    torch version lacks them.

    The probes read the hardware (cpuinfo) only, while ``ATEN_CPU_CAPABILITY=avx2`` makes torch run its AVX2
    kernels, bf16 emulated, on the same CPU: so the capability torch actually dispatches is asked too. That keeps
    the choice right under the cap, and is how an AVX-512 machine runs an AVX2 machine's path (bf16 converted to
    float32 at every start) in tests and benchmarks (docs/engine.md)."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def resolve_dtype(dtype: str | None, device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    """The compute dtype: ``dtype`` when given, else the fastest correct first token (docs/engine.md):

    - CPU: the weights' own dtype when it is float32, or bfloat16 on a CPU with native bf16 (no conversion, so the
      weights stay zero-copy views of the page cache; bf16 is also ~1.7x faster than float32 there); otherwise
      (float16, or bfloat16 emulated in software) float32, converted once at load;
    - CUDA: the weights' dtype when it is 16-bit, else bfloat16.
    """
    if dtype is not None and dtype != "auto":
        try:
            return _DTYPES[dtype.lower()]
        except KeyError:
            raise ConfigError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}") from None
    if device.type == "cpu":
        if weight_dtype == torch.bfloat16 and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return weight_dtype if weight_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def resolve_max_len(config: ModelConfig, asked: int | None, root: str) -> int:
    """The context length to serve: ``asked``, or the model's capped at ``DEFAULT_MAX_MODEL_LEN`` (and at a sliding
    window, which is not implemented); ``ConfigError`` when ``asked`` is beyond what the model supports."""
    limit = config.max_position_embeddings
    if asked is None:
        chosen = min(limit, DEFAULT_MAX_MODEL_LEN)
        # Sliding-window attention is not implemented: within the window it equals full attention.
        return min(chosen, config.sliding_window) if config.sliding_window else chosen
    if asked < 2:
        raise ConfigError(f"max_model_len must be at least 2 (got {asked})")
    if config.sliding_window and asked > config.sliding_window:
        raise ConfigError(
            f"{root}: max_model_len {asked} exceeds the model's sliding window ({config.sliding_window} tokens), "
            "which this engine does not implement; use at most the window"
        )
    if asked > limit and config.rope.rope_type != "dynamic":  # dynamic NTK RoPE exists to stretch the context
        raise ConfigError(f"{root}: max_model_len {asked} exceeds the model's max_position_embeddings ({limit})")
    return asked


def build_backend(
    config: ModelConfig,
    *,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    root: str,
) -> tuple[Backend, PagedKVCache | None, int, int]:
    """(backend, KV cache or None, bytes converted at bind time, max_model_len the backend can serve)."""
    if config.unsupported_reason() is None:
        model = LlamaModel(config, weights, dtype=dtype, device=device, max_len=max_len, where=root)
        # Room for two full-length sequences: one generating, one being filled from a KV tier. Untouched blocks
        # cost no memory on CPU (torch.empty pages are only faulted in when written).
        blocks = 2 * -(-max_len // BLOCK_SIZE)
        cache = PagedKVCache(model.kv_layout(BLOCK_SIZE), blocks, device)
        return NativeBackend(model, cache), cache, model.converted_bytes, max_len
    from preheat.engine.fallback import TransformersModel

    fallback = TransformersModel(config.raw, weights, dtype=dtype, device=device, where=root)
    # The generic config fields may not name the context (GPT-2 calls it n_positions); transformers' config does.
    limit = fallback.max_position_embeddings
    return FallbackBackend(fallback), None, 0, min(max_len, limit) if limit > 1 else max_len
