"""Swap new weights into a live built-in Llama model, all or nothing, between two generation requests.

Two ways, chosen per swap:

- **double buffer** (the default): the new tensors are built in full beside the old ones (converted to the engine's
  dtype and device), then every reference is rebound at once. Peak memory: the model plus the changed tensors. On
  CPU this is the only way: the loaded weights are read-only views of the checkpoint's page cache.
- **in place, with a rollback copy** (``inplace=True``, or automatically when the double buffer runs out of device
  memory): tensor by tensor, a host copy of the old bytes is taken, then the new bytes are copied over the old
  ones; if any copy fails, every tensor already written is restored from its copy. Peak extra memory on the device:
  none. Only tensors the model owns can be written (on CUDA, or ones a previous refit put there on CPU).

The converted tensors equal what a fresh load of a checkpoint holding the same bytes would bind
(``WeightBinder``'s ``tensor.to(device, dtype)``), so a refitted replica computes bitwise what a fresh one would.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from preheat.core.errors import RefitError

if TYPE_CHECKING:
    from preheat.engine.model import LlamaModel

log = logging.getLogger("preheat.refit")

# Hugging Face tensor names of a layer -> the built-in model's _Layer fields (preheat.engine.model).
_LAYER_FIELDS = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "mlp.gate_proj.bias": "gate_bias",
    "mlp.up_proj.bias": "up_bias",
    "mlp.down_proj.bias": "down_bias",
}
_LAYER_NAME = re.compile(r"^model\.layers\.([0-9]+)\.(.+)$")


@dataclass
class SwapReport:
    """What a swap did: tensors replaced, bytes written, and how (``double_buffer`` or ``inplace``)."""

    tensors: int
    nbytes: int
    mode: str


class ModelSlots:
    """Get and set a built-in model's tensors by their checkpoint names (``model.layers.3.mlp.up_proj.weight``).

    Tied embeddings: setting ``model.embed_tokens.weight`` rebinds the output layer too.
    """

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.tied = model.lm_head is model.embed

    def get(self, name: str) -> torch.Tensor | None:
        m = self.model
        if name == "model.embed_tokens.weight":
            return m.embed
        if name == "model.norm.weight":
            return m.norm
        if name == "lm_head.weight":
            return None if self.tied else m.lm_head
        slot = self._layer_slot(name)
        if slot is None:
            return None
        index, field = slot
        found: torch.Tensor | None = getattr(m.layers[index], field)
        return found

    def set(self, name: str, tensor: torch.Tensor) -> None:
        m = self.model
        if name == "model.embed_tokens.weight":
            m.embed = tensor
            if self.tied:
                m.lm_head = tensor
        elif name == "model.norm.weight":
            m.norm = tensor
        elif name == "lm_head.weight" and not self.tied:
            m.lm_head = tensor
        else:
            slot = self._layer_slot(name)
            if slot is None:
                raise RefitError(f"tensor {name!r} is not one the model uses")
            index, field = slot
            m.layers[index] = replace(m.layers[index], **{field: tensor})

    def _layer_slot(self, name: str) -> tuple[int, str] | None:
        match = _LAYER_NAME.match(name)
        if match is None:
            return None
        index, field = int(match.group(1)), _LAYER_FIELDS.get(match.group(2))
        if field is None or index >= len(self.model.layers):
            return None
        return index, field


def check_fits(slots: ModelSlots, new: Mapping[str, torch.Tensor]) -> None:
    """``RefitError`` unless every tensor of ``new`` is one the model uses, with the shape it has now."""
    check_shapes(slots, {name: tuple(tensor.shape) for name, tensor in new.items()})


def check_shapes(slots: ModelSlots, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """``check_fits`` on names and shapes alone (a manifest's, before any of its bytes are pulled)."""
    for name, shape in shapes.items():
        current = slots.get(name)
        if current is None:
            if name == "lm_head.weight" and slots.tied:
                continue  # a tied model computes with the embedding; a stored lm_head is unused, as at load
            raise RefitError(f"tensor {name!r} is not one the model uses: a refit cannot change the architecture")
        if tuple(current.shape) != tuple(shape):
            raise RefitError(
                f"tensor {name!r} has shape {list(shape)}, the model's has {list(current.shape)}: a refit "
                "cannot change the architecture"
            )


def swap(
    model: LlamaModel,
    new: Mapping[str, torch.Tensor],
    *,
    inplace: bool = False,
    owned: set[str] | None = None,
    fail_after: Callable[[int], None] | None = None,
) -> SwapReport:
    """Replace the tensors ``new`` (checkpoint name -> tensor as published, on CPU) in ``model``, all or nothing.

    ``owned``: names whose current tensors this process may write (updated: every tensor swapped in is owned).
    ``fail_after(k)``: called before the k-th in-place write; a test's way to make the k-th write fail.
    """
    slots = ModelSlots(model)
    check_fits(slots, new)
    wanted = {n: t for n, t in new.items() if slots.get(n) is not None}
    owned = owned if owned is not None else set()
    dtype, device = model.dtype, model.device
    if not inplace:
        try:
            converted = {n: _converted(t, dtype, device) for n, t in wanted.items()}
        except torch.OutOfMemoryError:
            log.warning("refit: no device memory for a double buffer; swapping in place with a rollback copy")
            inplace = True
        else:
            for name, tensor in converted.items():
                slots.set(name, tensor)
            owned.update(converted)
            return SwapReport(len(converted), sum(t.nbytes for t in converted.values()), "double_buffer")
    return _inplace(slots, wanted, dtype=dtype, device=device, owned=owned, fail_after=fail_after)


def _converted(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if tensor.dtype == dtype and tensor.device == device:
        return tensor  # already fresh memory of the pull's own
    return tensor.to(device=device, dtype=dtype)


def _inplace(
    slots: ModelSlots,
    wanted: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    owned: set[str],
    fail_after: Callable[[int], None] | None,
) -> SwapReport:
    writable = device.type == "cuda"
    refused = [n for n in wanted if not writable and n not in owned]
    if refused:
        raise RefitError(
            f"cannot swap {refused[0]!r} in place: on CPU the loaded weights are read-only views of the checkpoint "
            "file (swap with a double buffer instead)"
        )
    rollback: list[tuple[torch.Tensor, torch.Tensor]] = []
    written = 0
    try:
        for k, (name, tensor) in enumerate(wanted.items()):
            target = slots.get(name)
            assert target is not None  # check_fits
            if fail_after is not None:
                fail_after(k)
            rollback.append((target, target.to("cpu", copy=True)))
            target.copy_(tensor.to(dtype=dtype))
            written += target.nbytes
    except BaseException:
        for target, saved in reversed(rollback):
            target.copy_(saved)
        log.warning("refit: in-place swap failed; %d tensors rolled back", len(rollback))
        raise
    return SwapReport(len(wanted), written, "inplace")
