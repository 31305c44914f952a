"""Weights converted to the compute dtype at load: on CPU, all of a model's converted tensors in one mapping.

A checkpoint stored in another dtype than the engine computes in (bf16 on a CPU without native bf16, fp16 on any
CPU: docs/engine.md, *Weights and dtype*) is converted once per load. The copies are views of one private anonymous
mapping (``preheat.io.buffers.mapped_buffer``) rather than a tensor each from the allocator, so that dropping the
model gives their memory back to the OS at once, as a sleep promises (docs/server.md, *Sleep and wake*). Measured
with one tensor each (SmolLM2 in bf16 computed in float32, 538 MB of copies): the first sleep released 515 MB, but
every later one ~120 MB, the embedding alone: freeing the first copies raised glibc's mmap threshold to the largest
of them (3.5 MB), so the next wake's copies came from its heap, which keeps freed blocks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from preheat.io.buffers import mapped_buffer, round_up

ALIGN = 64  # bytes: each tensor's offset in the shared mapping, as the loader aligns tensors in its buffers


def to_compute_dtype(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """``tensors`` converted to ``dtype`` on ``device``, the same values as ``tensor.to(device, dtype)``: on CPU
    views of one fresh mapping that holds them all (freed with the last of them); on other devices a tensor each
    (their caching allocators keep freed blocks for reuse and ``empty_cache`` returns them)."""
    if device.type != "cpu":
        return {name: tensor.to(device=device, dtype=dtype) for name, tensor in tensors.items()}
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {name: tensor.numel() * itemsize for name, tensor in tensors.items()}
    buffer = mapped_buffer(sum(round_up(size, ALIGN) for size in sizes.values()))
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, tensor in tensors.items():
        view = buffer[offset : offset + sizes[name]].view(dtype).view(tensor.shape)
        view.copy_(tensor)  # torch converts on its intra-op threads, and the copy faults the pages in
        out[name] = view
        offset += round_up(sizes[name], ALIGN)
    return out


def needs_conversion(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether binding ``tensor`` for computing in ``dtype`` on ``device`` takes a copy."""
    return tensor.dtype != dtype or tensor.device != device
