"""Architectures the built-in Llama family does not cover: a transformers model with the loaded tensors bound in.

The model is built with its parameters on the meta device (no memory, no random initialisation), then
``load_state_dict(..., assign=True)`` makes the loaded tensors themselves its parameters: views of the page cache
on CPU with mode ``mmap``, as on the native path. Only parameters go to meta: a plain ``with torch.device("meta")``
would also put non-persistent buffers there (RoPE ``inv_freq`` and the like), which no state dict restores.

Costs and limits (docs/engine.md): importing transformers' model code adds ~2 s to a cold start, and its cache object
hides the memory layout, so this backend has no KV chunk export/import. transformers is imported only here.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from preheat.core.errors import CheckpointError, ConfigError
from preheat.engine.weights import needs_conversion, to_compute_dtype


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` registered inside the block lives on the meta device; buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]  # restored in finally
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


class FallbackState:
    """One sequence: transformers' cache object and how many tokens it holds."""

    def __init__(self) -> None:
        self.past: Any = None  # Any: a transformers Cache, whose class depends on the architecture
        self.length = 0


class TransformersModel:
    """A transformers causal LM over bound weights, behind the engine's backend interface."""

    def __init__(
        self,
        config: dict[str, Any],  # Any: the JSON config.json
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        where: str,
    ) -> None:
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ConfigError(
                f"{where}: architecture {config.get('architectures')} is not built in; serving it needs "
                "transformers (pip install transformers)"
            ) from None
        model_type = config.get("model_type")
        if not isinstance(model_type, str):
            raise CheckpointError(f"{where}: config.json has no model_type", path=where)
        fields = {k: v for k, v in config.items() if k != "model_type"}
        try:
            hf_config = AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{where}: transformers does not know this config: {exc}", path=where) from None
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)  # type: ignore[no-untyped-call]
        pending = {n: t for n, t in weights.items() if t.is_floating_point() and needs_conversion(t, dtype, device)}
        converted = {**weights, **to_compute_dtype(pending, dtype, device)}  # one mapping on CPU: a sleep frees it
        # strict=False: tied heads are absent from the state dict; anything else left on meta is reported below.
        model.load_state_dict(converted, strict=False, assign=True)
        model.tie_weights()
        model.to(device)
        missing = [name for name, p in model.named_parameters() if p.is_meta]
        if missing:
            raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing", path=where, tensor=missing[0])
        model.train(False)  # inference: no dropout
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_position_embeddings = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        # transformers 5.x renamed past_key_values to cache (in arguments and outputs); 4.x only knows the old name.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def new_state(self) -> FallbackState:
        return FallbackState()

    def forward(self, state: FallbackState, ids: list[int]) -> torch.Tensor:
        """float32 logits ``[vocab]`` after ``ids``, continuing ``state``."""
        tokens = torch.tensor([ids], dtype=torch.int64, device=self.device)
        out = self.model(input_ids=tokens, use_cache=True, **{self._cache_arg: state.past})
        state.past = getattr(out, self._cache_arg)
        state.length += len(ids)
        logits: torch.Tensor = out.logits[0, -1].float()
        return logits
