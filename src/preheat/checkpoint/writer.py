"""Write safetensors files that any reader accepts, atomically (``core.durable``: temp name, fsync, rename)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from preheat.checkpoint import torch_dtypes
from preheat.checkpoint.safetensors import encode_header
from preheat.core import durable


def save_file(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (in mapping order) as a safetensors file at ``path``; a crash never leaves a partial file."""
    target = os.fspath(path)
    spec = {
        name: (torch_dtypes.from_torch(t.dtype), tuple(t.shape), t.numel() * t.element_size())
        for name, t in tensors.items()
    }
    with durable.replacing(target) as out:
        out.write(encode_header(spec, dict(metadata) if metadata else None))
        for tensor in tensors.values():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            out.write(
                flat.view(torch.uint8).numpy().tobytes() if flat.numel() < 4096 else flat.view(torch.uint8).numpy().data
            )
