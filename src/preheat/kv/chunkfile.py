"""The self-checking byte format of one KV chunk, shared by every L2 tier (files and Redis values alike).

::

    offset 0   magic      8 bytes  b"PHKVCHNK"
    offset 8   version    u32 LE   1
    offset 12  header_len u32 LE   length of the JSON header
    offset 16  header     JSON     {"key", "fingerprint", "kind", "dtype", "shape", "scale_shape",
                                    "payload_bytes", "checksum"}, padded with spaces to a multiple of 64 bytes
    then       payload             data bytes, then (quantized kinds) float32 scale bytes

``checksum`` is XXH3-128 (hex) of the payload. ``decode`` checks everything against what the reader expects (the
key it asked for, its own fingerprint, dtype, shape) and the checksum, and raises ``CorruptChunkError`` on any
difference, so a torn write, a flipped bit or a chunk of another model is a miss, never wrong K/V. Pure: bytes in,
bytes out.
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass

import torch
import xxhash

from preheat.checkpoint import dtypes
from preheat.errors import KVError
from preheat.kv.chunk import StoredChunk

MAGIC = b"PHKVCHNK"
VERSION = 1
_PREFIX = struct.Struct("<8sII")
_ALIGN = 64
_MAX_HEADER = 64 * 1024
# Chunks read from Redis arrive as immutable bytes; their tensors are only ever read (copied into the engine's pool),
# so torch's warning about non-writable buffers is noise here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class CorruptChunkError(KVError):
    """A stored chunk failed a check (torn, flipped, foreign): the tier treats it as a miss and removes it."""


@dataclass(frozen=True)
class Expect:
    """What a reader requires of a chunk: its fingerprint, the stored dtype and the exported shape."""

    fingerprint: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def encode(key: str, fingerprint: str, chunk: StoredChunk) -> list[bytes | memoryview]:
    """The file/value for ``chunk`` as pieces to write in order (header, data, scales: no joined copy)."""
    data = _bytes_of(chunk.data)
    pieces: list[bytes | memoryview] = [data]
    digest = xxhash.xxh3_128(data)
    scale_shape = None
    if chunk.scales is not None:
        scales = _bytes_of(chunk.scales)
        digest.update(scales)
        pieces.append(scales)
        scale_shape = list(chunk.scales.shape)
    header = {
        "key": key,
        "fingerprint": fingerprint,
        "kind": chunk.kind,
        "dtype": dtypes.from_torch(chunk.data.dtype),
        "shape": list(chunk.data.shape),
        "scale_shape": scale_shape,
        "payload_bytes": sum(len(p) for p in pieces),
        "checksum": digest.hexdigest(),
    }
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("ascii")
    raw += b" " * (-(_PREFIX.size + len(raw)) % _ALIGN)
    return [_PREFIX.pack(MAGIC, VERSION, len(raw)) + raw, *pieces]


def decode(blob: bytes | bytearray | memoryview, key: str, expect: Expect) -> StoredChunk:
    """The chunk in ``blob`` (tensors are views of it), or ``CorruptChunkError`` saying what is wrong."""
    view = memoryview(blob).cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptChunkError(f"chunk {key}: {len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptChunkError(f"chunk {key}: bad magic {bytes(magic)!r} (not a preheat KV chunk)")
    if version != VERSION:
        raise CorruptChunkError(f"chunk {key}: format version {version}, this preheat reads {VERSION}")
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > len(view):
        raise CorruptChunkError(f"chunk {key}: header length {header_len} does not fit in {len(view)} bytes")
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + header_len]))
    except ValueError as exc:
        raise CorruptChunkError(f"chunk {key}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptChunkError(f"chunk {key}: header is not a JSON object")
    _check(header, key, expect)
    payload = view[_PREFIX.size + header_len :]
    if len(payload) != header["payload_bytes"]:
        raise CorruptChunkError(f"chunk {key}: {len(payload)} payload bytes, header says {header['payload_bytes']}")
    if xxhash.xxh3_128_hexdigest(payload) != header["checksum"]:
        raise CorruptChunkError(f"chunk {key}: checksum mismatch (corrupt or torn)")
    data_bytes = _numel(expect.shape) * torch.empty((), dtype=expect.dtype).element_size()
    data = torch.frombuffer(payload[:data_bytes], dtype=expect.dtype).view(expect.shape)
    if header["scale_shape"] is None:
        return StoredChunk(data)
    scales = torch.frombuffer(payload[data_bytes:], dtype=torch.float32).view(expect.shape[:-1])
    return StoredChunk(data, scales)


def _check(header: dict[str, object], key: str, expect: Expect) -> None:
    def wrong(field: str, got: object, want: object) -> CorruptChunkError:
        return CorruptChunkError(f"chunk {key}: {field} is {got!r}, expected {want!r}")

    if header.get("key") != key:
        raise wrong("key", header.get("key"), key)
    if header.get("fingerprint") != expect.fingerprint:
        raise wrong("fingerprint", header.get("fingerprint"), expect.fingerprint)
    dtype_name = dtypes.from_torch(expect.dtype)
    if header.get("dtype") != dtype_name:
        raise wrong("dtype", header.get("dtype"), dtype_name)
    if header.get("shape") != list(expect.shape):
        raise wrong("shape", header.get("shape"), list(expect.shape))
    quantized = expect.dtype in (torch.int8, torch.float8_e4m3fn)
    want_scales = list(expect.shape[:-1]) if quantized else None
    if header.get("scale_shape") != want_scales:
        raise wrong("scale_shape", header.get("scale_shape"), want_scales)
    data_bytes = _numel(expect.shape) * torch.empty((), dtype=expect.dtype).element_size()
    want_payload = data_bytes + (_numel(expect.shape[:-1]) * 4 if quantized else 0)
    if header.get("payload_bytes") != want_payload:
        raise wrong("payload_bytes", header.get("payload_bytes"), want_payload)
    if not isinstance(header.get("checksum"), str):
        raise wrong("checksum", header.get("checksum"), "a hex string")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    # Raw bytes of a contiguous CPU tensor without a copy (uint8 view: works for bf16/fp8, which numpy lacks).
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")
