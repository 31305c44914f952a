"""``StoredChunk``: one chunk's K/V as a tier keeps it, exact or quantized (``--kv-dtype int8|fp8``).

An exported chunk is ``[blocks, layers, 2, kv_heads, block_size, head_dim]`` in the engine's compute dtype
(docs/engine.md). Stored exactly, it is one copy of those bytes. Quantized, every head vector (the ``head_dim``
values of one token, one head, one layer, K or V) gets its own scale, so an outlier token or head cannot flatten its
neighbours:

- int8: ``scale = max|x| / 127``, ``q = round(x / scale)`` clamped to [-127, 127];
- fp8:  ``scale = max|x| / 448``, ``q = (x / scale)`` cast to ``float8_e4m3fn``.

Scales are float32 ``[blocks, layers, 2, kv_heads, block_size]``: 4 bytes per ``head_dim`` values, so a bf16 chunk
with head_dim 64 shrinks to (64 + 4) / 128 = 53% of its bytes, a float32 one to 27%. Accuracy: docs/kv-cache.md.

``encode_chunk``/``decode_chunk`` are the tensor side of the byte format in ``kv/chunkfile.py`` (which is torch-free):
a chunk's tensors as bytes for it, and the bytes it verified as tensors (views, no copy).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from preheat.checkpoint import torch_dtypes
from preheat.core.errors import KVError
from preheat.kv import chunkfile
from preheat.kv.keys import KV_DTYPES  # keys, not settings: tier -> chunk -> settings -> backends -> tier is a loop

_LIMIT = {"int8": 127.0, "fp8": float(torch.finfo(torch.float8_e4m3fn).max)}
_STORED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Chunks read from Redis arrive as immutable bytes; their tensors are only ever read (copied into the engine's pool),
# so torch's warning about non-writable buffers is noise here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True)
class StoredChunk:
    """A chunk's bytes in one tier: ``data`` (the exported shape, compute dtype or int8/fp8) and, when quantized,
    float32 ``scales`` (``data.shape[:-1]``). Immutable once made: L1 and the L2 writer share it without copies."""

    data: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        """``exact``, ``int8`` or ``fp8``."""
        if self.scales is None:
            return "exact"
        return "int8" if self.data.dtype == torch.int8 else "fp8"

    @property
    def nbytes(self) -> int:
        scale_bytes = self.scales.numel() * 4 if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + scale_bytes

    def load_into(self, destination: torch.Tensor) -> None:
        """Write this chunk's K/V into ``destination`` (a chunk view of the engine's pool), dequantizing if needed."""
        if tuple(destination.shape) != tuple(self.data.shape):
            raise KVError(f"chunk of shape {list(self.data.shape)} does not fit a view of {list(destination.shape)}")
        if self.scales is None:
            destination.copy_(self.data, non_blocking=destination.device.type == "cuda")
            return
        data = self.data.to(destination.device, non_blocking=True)
        scales = self.scales.to(destination.device, non_blocking=True)
        destination.copy_(data.to(torch.float32) * scales.unsqueeze(-1))


def store_form(view: torch.Tensor, kv_dtype: str = "auto", *, pin: bool = False) -> StoredChunk:
    """A tier's own copy of an exported chunk ``view`` (which the engine will overwrite), on the host.

    ``pin``: page-locked host memory (CUDA engines), so the copy back into device memory runs at full speed.
    """
    if kv_dtype not in KV_DTYPES:
        raise KVError(f"--kv-dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        host = torch.empty(view.shape, dtype=view.dtype, pin_memory=pin)
        host.copy_(view)
        return StoredChunk(host)
    x = view.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / _LIMIT[kv_dtype], torch.ones_like(amax))
    scaled = x / scales.unsqueeze(-1)
    # int8 rounds to the nearest step; the fp8 cast rounds by itself.
    q = scaled.round_().clamp_(-127, 127).to(torch.int8) if kv_dtype == "int8" else scaled.to(torch.float8_e4m3fn)
    data = torch.empty(q.shape, dtype=q.dtype, pin_memory=pin)
    data.copy_(q)
    host_scales = torch.empty(scales.shape, dtype=torch.float32, pin_memory=pin)
    host_scales.copy_(scales)
    return StoredChunk(data, host_scales)


def stored_dtype(kv_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype of ``StoredChunk.data`` for ``kv_dtype`` on an engine computing in ``compute``."""
    return compute if kv_dtype == "auto" else _STORED[kv_dtype]


def expect_for(
    fingerprint: str, dtype: torch.dtype, shape: tuple[int, ...], mac_key: bytes | None = None
) -> chunkfile.Expect:
    """What a reader of chunks stored as ``dtype`` (``stored_dtype``) in ``shape`` requires (``chunkfile.Expect``)."""
    return chunkfile.Expect(fingerprint, torch_dtypes.from_torch(dtype), shape, mac_key=mac_key)


def encode_chunk(
    key: str, fingerprint: str, chunk: StoredChunk, mac_key: bytes | None = None
) -> list[bytes | memoryview]:
    """``chunkfile.encode`` of ``chunk``'s tensors (their bytes, not copied)."""
    contents = chunkfile.Contents(
        kind=chunk.kind,
        dtype=torch_dtypes.from_torch(chunk.data.dtype),
        shape=tuple(chunk.data.shape),
        data=_bytes_of(chunk.data),
        scales=None if chunk.scales is None else _bytes_of(chunk.scales),
        scale_shape=None if chunk.scales is None else tuple(chunk.scales.shape),
    )
    return chunkfile.encode(key, fingerprint, contents, mac_key)


def decode_chunk(blob: bytes | bytearray | memoryview, key: str, expect: chunkfile.Expect) -> StoredChunk:
    """The chunk in ``blob`` (tensors are views of it) once ``chunkfile.decode`` has verified it; raises
    ``CorruptChunkError`` as that does."""
    payload = chunkfile.decode(blob, key, expect)
    data = torch.frombuffer(payload.data, dtype=torch_dtypes.to_torch(expect.dtype)).view(expect.shape)
    if payload.scales is None:
        return StoredChunk(data)
    return StoredChunk(data, torch.frombuffer(payload.scales, dtype=torch.float32).view(expect.shape[:-1]))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    # Raw bytes of a contiguous CPU tensor without a copy (uint8 view: works for bf16/fp8, which numpy lacks).
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")
