"""The self-checking byte format of one KV chunk, shared by every L2 tier (files and Redis values alike).

::

    offset 0   magic      8 bytes  b"PHKVCHNK"
    offset 8   version    u32 LE   1 (unkeyed) or 2 (keyed: a tag follows the payload)
    offset 12  header_len u32 LE   length of the JSON header (at most 64 KiB)
    offset 16  header     JSON     {"key", "fingerprint", "kind", "dtype", "shape", "scale_shape",
                                    "payload_bytes", "checksum"}, padded with spaces to a multiple of 64 bytes
    then       payload             data bytes, then (quantized kinds) float32 scale bytes
    then       tag        32 bytes version 2 only: keyed BLAKE2b-256 of every byte before it (``kv/mac.py``)

``checksum`` is XXH3-128 (hex) of the payload. ``decode`` checks everything against what the reader expects (the
key it asked for, its own fingerprint, dtype, shape, its MAC key or none) and the checksum, and raises
``CorruptChunkError`` (``MacError`` for the tag) on any difference, so a torn write, a flipped bit, a chunk of
another model or a forged one is a miss, never wrong K/V. Pure and torch-free: bytes in, bytes out (dtypes by
their safetensors names). ``kv/chunk.py`` turns a ``StoredChunk``'s tensors into these bytes and back. A reader with
a MAC key checks the tag before it parses anything else; one without refuses keyed chunks, and one with refuses
unkeyed chunks.
"""

from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass, field

import xxhash

from preheat.checkpoint import dtypes
from preheat.errors import KVError
from preheat.kv import mac

MAGIC = b"PHKVCHNK"
VERSION = 1  # unkeyed
VERSION_KEYED = 2  # version 1 followed by a keyed BLAKE2b tag of everything before it
_PREFIX = struct.Struct("<8sII")
_ALIGN = 64
_MAX_HEADER = 64 * 1024
QUANTIZED = ("I8", "F8_E4M3")  # stored dtypes that carry float32 scales, one per head vector


class CorruptChunkError(KVError):
    """A stored chunk failed a check (torn, flipped, foreign, too large): the tier treats it as a miss and removes
    it."""


class MacError(CorruptChunkError):
    """A chunk's keyed tag is wrong or missing (forged, written under another secret, or unkeyed while this replica
    requires a MAC), or the chunk is keyed and this replica has no secret."""


@dataclass(frozen=True)
class Expect:
    """What a reader requires of a chunk: its fingerprint, the stored dtype (a safetensors name: ``BF16``, ``I8``,
    ``F8_E4M3``...) and the exported shape, and, with a fleet secret (``--kv-secret-file``), the MAC key its tag must
    verify under (``mac.derive_key``)."""

    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    mac_key: bytes | None = field(default=None, repr=False)

    @property
    def quantized(self) -> bool:
        """Whether chunks of this dtype carry scales (``[*shape[:-1]]`` float32) after their data."""
        return self.dtype in QUANTIZED

    @property
    def data_bytes(self) -> int:
        """Bytes of the data part of the payload."""
        return _numel(self.shape) * dtypes.itemsize(self.dtype)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the payload of every chunk this reader accepts (data, then scales when quantized)."""
        return self.data_bytes + (_numel(self.shape[:-1]) * 4 if self.quantized else 0)

    @property
    def max_size(self) -> int:
        """The most bytes a chunk this reader accepts can take: tiers refuse larger files and values unread."""
        return _PREFIX.size + _MAX_HEADER + self.payload_bytes + mac.TAG_BYTES


@dataclass(frozen=True)
class Payload:
    """A decoded chunk's bytes, views of the blob: ``data`` (``Expect.dtype``, ``Expect.shape``) and, when
    quantized, float32 ``scales`` (``Expect.shape[:-1]``)."""

    data: memoryview
    scales: memoryview | None = None


@dataclass(frozen=True)
class Contents:
    """What ``encode`` writes: the data's bytes, dtype name and shape, and for a quantized chunk its float32 scales'
    bytes and shape. ``kind`` is ``exact``, ``int8`` or ``fp8``."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview
    scales: bytes | bytearray | memoryview | None = None
    scale_shape: tuple[int, ...] | None = None


def encode(key: str, fingerprint: str, contents: Contents, mac_key: bytes | None = None) -> list[bytes | memoryview]:
    """The file/value for ``contents`` as pieces to write in order (header, data, scales, tag: no joined copy); keyed
    (version 2) when ``mac_key`` is given."""
    data = memoryview(contents.data).cast("B")
    pieces: list[bytes | memoryview] = [data]
    digest = xxhash.xxh3_128(data)
    if contents.scales is not None:
        scales = memoryview(contents.scales).cast("B")
        digest.update(scales)
        pieces.append(scales)
    header = {
        "key": key,
        "fingerprint": fingerprint,
        "kind": contents.kind,
        "dtype": contents.dtype,
        "shape": list(contents.shape),
        "scale_shape": None if contents.scale_shape is None else list(contents.scale_shape),
        "payload_bytes": sum(len(p) for p in pieces),
        "checksum": digest.hexdigest(),
    }
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("ascii")
    raw += b" " * (-(_PREFIX.size + len(raw)) % _ALIGN)
    head = _PREFIX.pack(MAGIC, VERSION if mac_key is None else VERSION_KEYED, len(raw)) + raw
    if mac_key is None:
        return [head, *pieces]
    tag = mac.tagger(mac_key)
    for piece in (head, *pieces):
        tag.update(piece)
    return [head, *pieces, tag.digest()]


def decode(blob: bytes | bytearray | memoryview, key: str, expect: Expect) -> Payload:
    """The chunk's bytes in ``blob`` (views of it), or ``CorruptChunkError`` saying what is wrong."""
    view = memoryview(blob).cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptChunkError(f"chunk {key}: {len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    if len(view) > expect.max_size:
        raise CorruptChunkError(f"chunk {key}: {len(view)} bytes, more than any chunk of this layout can take")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptChunkError(f"chunk {key}: bad magic {bytes(magic)!r} (not a preheat KV chunk)")
    if version not in (VERSION, VERSION_KEYED):
        raise CorruptChunkError(f"chunk {key}: format version {version}, this preheat reads 1 and 2")
    view = _verified(view, key, version, expect.mac_key)
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > len(view):
        raise CorruptChunkError(f"chunk {key}: header length {header_len} does not fit in {len(view)} bytes")
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + header_len]))
    except (ValueError, RecursionError) as exc:  # ValueError covers bad UTF-8; RecursionError deep nesting
        raise CorruptChunkError(f"chunk {key}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptChunkError(f"chunk {key}: header is not a JSON object")
    _check(header, key, expect)
    payload = view[_PREFIX.size + header_len :]
    if len(payload) != header["payload_bytes"]:
        raise CorruptChunkError(f"chunk {key}: {len(payload)} payload bytes, header says {header['payload_bytes']}")
    if xxhash.xxh3_128_hexdigest(payload) != header["checksum"]:
        raise CorruptChunkError(f"chunk {key}: checksum mismatch (corrupt or torn)")
    data_bytes = expect.data_bytes
    if header["scale_shape"] is None:
        return Payload(payload[:data_bytes])
    return Payload(payload[:data_bytes], payload[data_bytes:])


def _verified(view: memoryview, key: str, version: int, mac_key: bytes | None) -> memoryview:
    """``view`` without its tag once the tag verifies (keyed readers), or ``view`` itself (unkeyed ones)."""
    if mac_key is None:
        if version == VERSION_KEYED:
            raise MacError(f"chunk {key}: keyed (written with --kv-secret-file), and this replica has no secret")
        return view
    if version != VERSION_KEYED:
        raise MacError(f"chunk {key}: unkeyed, and this replica requires a MAC (--kv-secret-file)")
    if len(view) < _PREFIX.size + mac.TAG_BYTES:
        raise MacError(f"chunk {key}: {len(view)} bytes, too short to hold a tag")
    body = view[: -mac.TAG_BYTES]
    tag = mac.tagger(mac_key)
    tag.update(body)
    if not hmac.compare_digest(tag.digest(), view[-mac.TAG_BYTES :].tobytes()):
        raise MacError(f"chunk {key}: MAC mismatch (forged, or written under another secret)")
    return body


def _check(header: dict[str, object], key: str, expect: Expect) -> None:
    def wrong(field: str, got: object, want: object) -> CorruptChunkError:
        return CorruptChunkError(f"chunk {key}: {field} is {got!r}, expected {want!r}")

    if header.get("key") != key:
        raise wrong("key", header.get("key"), key)
    if header.get("fingerprint") != expect.fingerprint:
        raise wrong("fingerprint", header.get("fingerprint"), expect.fingerprint)
    if header.get("dtype") != expect.dtype:
        raise wrong("dtype", header.get("dtype"), expect.dtype)
    if header.get("shape") != list(expect.shape):
        raise wrong("shape", header.get("shape"), list(expect.shape))
    want_scales = list(expect.shape[:-1]) if expect.quantized else None
    if header.get("scale_shape") != want_scales:
        raise wrong("scale_shape", header.get("scale_shape"), want_scales)
    want_payload = expect.payload_bytes
    if header.get("payload_bytes") != want_payload:
        raise wrong("payload_bytes", header.get("payload_bytes"), want_payload)
    if not isinstance(header.get("checksum"), str):
        raise wrong("checksum", header.get("checksum"), "a hex string")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
