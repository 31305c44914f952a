"""The self-checking byte format of one KV chunk, shared by every L2 tier (files and Redis values alike).

::

    offset 0   magic      8 bytes  b"PHKVCHNK"
    offset 8   version    u32 LE   1 (unkeyed) or 2 (keyed: a tag follows the payload)
    offset 12  header_len u32 LE   length of the JSON header (at most 64 KiB)
    offset 16  header     JSON     {"key", "fingerprint", "kind", "dtype", "shape", "scale_shape",
                                    "payload_bytes", "checksum"}, padded with spaces to a multiple of 64 bytes
    then       payload             data bytes, then (quantized kinds) float32 scale bytes
    then       tag        32 bytes version 2 only: keyed BLAKE2b-256 of every byte before it (``kv/mac.py``)

An opaque value of the engine-neutral blob store (``kv/store.py``: LMCache, SGLang, vLLM offloading) is the same
format with ``kind`` ``bytes``, ``dtype`` ``U8``, ``shape`` ``[payload_bytes]`` and no scales; its ``key`` is the
engine's own key (any string) and ``fingerprint`` the store namespace's id. ``BlobExpect`` reads those.

``checksum`` is XXH3-128 (hex) of the payload. ``decode`` checks everything against what the reader expects (the
key it asked for, its own fingerprint, dtype, shape, its MAC key or none) and the checksum, and raises
``CorruptChunkError`` (``MacError`` for the tag) on any difference, so a torn write, a flipped bit, a chunk of
another model or a forged one is a miss, never wrong K/V. Pure and torch-free: bytes in, bytes out (dtypes by
their safetensors names). ``kv/chunk.py`` turns a ``StoredChunk``'s tensors into these bytes and back. A reader with
a MAC key checks the tag before it parses anything else; one without refuses keyed chunks, and one with refuses
unkeyed chunks.
"""

from __future__ import annotations

import functools
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from preheat.checkpoint import dtypes
from preheat.core.errors import CorruptChunkError, JSONInputError, MacError
from preheat.core.jsonsafe import loads_bounded
from preheat.kv import mac

MAGIC = b"PHKVCHNK"
VERSION = 1  # unkeyed
VERSION_KEYED = 2  # version 1 followed by a keyed BLAKE2b tag of everything before it
_PREFIX = struct.Struct("<8sII")
_ALIGN = 64
_MAX_HEADER = 64 * 1024
_MAX_HEADER_DEPTH = 8  # a header nests two levels (its shapes); deeper is damage, refused before json.loads recurses
QUANTIZED = ("I8", "F8_E4M3")  # stored dtypes that carry float32 scales, one per head vector
BLOB_KIND, BLOB_DTYPE = "bytes", "U8"  # an opaque value of the blob store: a flat run of bytes
MAX_KEY_CHARS = 4096  # an engine key longer than this is refused before it reaches a header (64 KiB at most)


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
class BlobExpect:
    """What a reader of opaque values (``kind`` ``bytes``) requires: the namespace's id as ``fingerprint``, a payload
    of at most ``max_payload_bytes`` (any length up to it: an engine's last chunk is often shorter), and the MAC key
    or none, as ``Expect``."""

    fingerprint: str
    max_payload_bytes: int
    mac_key: bytes | None = field(default=None, repr=False)

    @property
    def max_size(self) -> int:
        """The most bytes a value this reader accepts can take: tiers refuse larger files and values unread."""
        return _PREFIX.size + _MAX_HEADER + self.max_payload_bytes + mac.TAG_BYTES


AnyExpect = Expect | BlobExpect  # what a tier hands its reads to check: chunk layout or opaque values


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
    parts = [memoryview(contents.data).cast("B")]
    if contents.scales is not None:
        parts.append(memoryview(contents.scales).cast("B"))
    fields: dict[str, object] = {
        "kind": contents.kind,
        "dtype": contents.dtype,
        "shape": list(contents.shape),
        "scale_shape": None if contents.scale_shape is None else list(contents.scale_shape),
    }
    return _frame(key, fingerprint, fields, parts, mac_key)


def _frame(
    key: str, fingerprint: str, fields: dict[str, object], parts: list[memoryview], mac_key: bytes | None
) -> list[bytes | memoryview]:
    """Prefix and header (``fields`` plus key, fingerprint, payload length and checksum) before ``parts``, and the
    tag after them when keyed."""
    digest = xxhash.xxh3_128()
    for part in parts:
        digest.update(part)
    header = {
        "key": key,
        "fingerprint": fingerprint,
        **fields,
        "payload_bytes": sum(len(p) for p in parts),
        "checksum": digest.hexdigest(),
    }
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("ascii")
    raw += b" " * (-(_PREFIX.size + len(raw)) % _ALIGN)
    head = _PREFIX.pack(MAGIC, VERSION if mac_key is None else VERSION_KEYED, len(raw)) + raw
    if mac_key is None:
        return [head, *parts]
    tag = mac.tagger(mac_key)
    tag.update(head)
    for part in parts:
        tag.update(part)
    return [head, *parts, tag.digest()]


def encode_blob(
    key: str,
    fingerprint: str,
    value: bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview],
    mac_key: bytes | None = None,
) -> list[bytes | memoryview]:
    """The file/value holding the opaque ``value`` (one buffer, or a list or tuple of parts stored one after the
    other) under the engine key ``key`` in namespace ``fingerprint`` (kind ``bytes``), as pieces to write in order,
    no joined copy; keyed (version 2) when ``mac_key`` is given.

    >>> pieces = encode_blob("k", "ns", [b"ab", b"c"])
    >>> bytes(decode_blob(b"".join(pieces), "k", BlobExpect("ns", 16)))
    b'abc'
    """
    pieces = [value] if isinstance(value, bytes | bytearray | memoryview) else list(value)
    parts = [memoryview(p).cast("B") for p in pieces]
    size = sum(len(p) for p in parts)
    fields: dict[str, object] = {"kind": BLOB_KIND, "dtype": BLOB_DTYPE, "shape": [size], "scale_shape": None}
    return _frame(key, fingerprint, fields, parts, mac_key)


def decode_blob(blob: bytes | bytearray | memoryview, key: str, expect: BlobExpect) -> memoryview:
    """The opaque value in ``blob`` (a view of it), or ``CorruptChunkError`` saying what is wrong."""
    return decode(blob, key, expect).data


@dataclass(frozen=True)
class BlobHead:
    """Where an opaque value's payload lies in its file, from the file's first bytes (``blob_head``): the payload
    starts at ``offset`` and has ``payload_bytes`` bytes; a ``keyed`` file has a tag after it."""

    offset: int
    payload_bytes: int
    checksum: str
    keyed: bool

    @property
    def size(self) -> int:
        """The whole file's size."""
        return self.offset + self.payload_bytes + (mac.TAG_BYTES if self.keyed else 0)


HEAD_HINT = 4096  # read this much first: the prefix and header of any value whose key is not huge


@dataclass(frozen=True)
class BlobFrame:
    """Where a value's header and payload lie in a file of a given size, *if* the file was written by this
    ``encode_blob`` (``blob_frame`` predicts it from the key and the file's size alone, so a reader can read header and
    payload in one call), and the exact header bytes such a file holds around its checksum (``checksum_in`` compares
    them: a byte-wise check instead of a JSON parse)."""

    offset: int  # prefix and header
    payload_bytes: int
    keyed: bool
    before: bytes  # the header's bytes up to the checksum's 32 hex digits
    after: bytes  # and after them, padding included

    def checksum_in(self, head: bytes | bytearray | memoryview) -> str | None:
        """The checksum of ``head`` when it is exactly the header this frame predicts (any other checksum digits
        allowed), else None: then parse it (``blob_head``), which says what is wrong, or where the payload is."""
        cut = len(self.before)
        if len(head) != self.offset or head[:cut] != self.before or head[cut + 32 :] != self.after:
            return None
        return bytes(head[cut : cut + 32]).decode("ascii", "replace")


_OPEN_CHECKSUM, _CLOSE_SHAPE = len('{"checksum":"'), len(',"scale_shape":null,"shape":[]}')


@functools.lru_cache(maxsize=4096)  # a value read again (a hot prefix) has the same frame
def blob_frame(key: str, fingerprint: str, size: int, keyed: bool) -> BlobFrame | None:
    """The frame of a ``size``-byte file holding ``key``'s value of namespace ``fingerprint`` as ``encode_blob`` lays
    it out (``_frame``: sorted compact JSON, ``checksum`` first, padded to 64 bytes), or None when no payload length
    fits ``size``.

    >>> pieces = encode_blob("k", "ns", b"abc")
    >>> frame = blob_frame("k", "ns", sum(len(p) for p in pieces), keyed=False)
    >>> frame.offset == len(pieces[0]), frame.payload_bytes, frame.checksum_in(pieces[0]) is not None
    (True, 3, True)
    """
    tag = mac.TAG_BYTES if keyed else 0
    body = _frame_body(key, fingerprint)
    for digits in range(len(str(size)), 0, -1):  # the payload is shorter than the file: as many digits or fewer
        raw_len = _OPEN_CHECKSUM + 32 + len(body) + _CLOSE_SHAPE + 2 * digits
        n = size - (_PREFIX.size + raw_len + (-(_PREFIX.size + raw_len) % _ALIGN)) - tag
        if n >= 0 and len(str(n)) == digits:
            return _blob_frame_of(body, n, keyed)
    return None


def blob_frame_for(key: str, fingerprint: str, payload_bytes: int, keyed: bool) -> BlobFrame:
    """The frame ``encode_blob`` gives ``key``'s value of ``payload_bytes`` bytes in namespace ``fingerprint``: what a
    writer needs to write the payload before its checksum is known (``encode_blob_unsummed``).

    >>> pieces = encode_blob("k", "ns", b"abc")
    >>> blob_frame_for("k", "ns", 3, keyed=False) == blob_frame("k", "ns", len(pieces[0]) + 3, keyed=False)
    True
    """
    return _blob_frame_of(_frame_body(key, fingerprint), payload_bytes, keyed)


def _frame_body(key: str, fingerprint: str) -> str:
    """The header's JSON from the checksum's closing quote to ``payload_bytes``' value, as ``_frame`` writes it:
    sorted compact ASCII JSON, the checksum's 32 hex digits first."""
    return (f'","dtype":"{BLOB_DTYPE}","fingerprint":{json.dumps(fingerprint)},"key":{json.dumps(key)},'
            f'"kind":"{BLOB_KIND}","payload_bytes":')


def _blob_frame_of(body: str, n: int, keyed: bool) -> BlobFrame:
    raw_end = f'{body}{n},"scale_shape":null,"shape":[{n}]}}'
    raw_len = _OPEN_CHECKSUM + 32 + len(raw_end)
    offset = _PREFIX.size + raw_len + (-(_PREFIX.size + raw_len) % _ALIGN)
    before = _PREFIX.pack(MAGIC, VERSION_KEYED if keyed else VERSION, offset - _PREFIX.size) + b'{"checksum":"'
    after = raw_end.encode("ascii") + b" " * (offset - len(before) - 32 - len(raw_end))
    return BlobFrame(offset, n, keyed, before, after)


@dataclass(frozen=True)
class Unsummed:
    """An unkeyed opaque value laid out before its checksum is known (``encode_blob_unsummed``): ``parts`` go at
    ``offset``, and ``head(checksum)`` before them. The bytes are exactly ``encode_blob``'s; a file writer writes the
    payload first, hashing each piece just before the kernel copies it (which then reads it from the CPU's cache),
    and the header last (``fileio.write_unsummed``)."""

    frame: BlobFrame
    parts: list[memoryview]

    @property
    def offset(self) -> int:
        return self.frame.offset

    @property
    def size(self) -> int:
        """The whole file's size."""
        return self.frame.offset + self.frame.payload_bytes

    def head(self, checksum: str) -> bytes:
        """Prefix and header holding ``checksum`` (the payload's XXH3-128 in hex, as ``payload_hasher`` gives it)."""
        if len(checksum) != 32:
            raise ValueError(f"an XXH3-128 hex digest has 32 characters, not {len(checksum)}")
        return self.frame.before + checksum.encode("ascii") + self.frame.after


def encode_blob_unsummed(
    key: str, fingerprint: str, value: bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]
) -> Unsummed:
    """``encode_blob`` (unkeyed) with the checksum left for the writer to compute as it writes the payload.

    >>> later = encode_blob_unsummed("k", "ns", [b"ab", b"c"])
    >>> later.head(payload_checksum(b"abc")) == encode_blob("k", "ns", b"abc")[0]
    True
    """
    pieces = [value] if isinstance(value, bytes | bytearray | memoryview) else list(value)
    parts = [memoryview(p).cast("B") for p in pieces]
    return Unsummed(blob_frame_for(key, fingerprint, sum(len(p) for p in parts), keyed=False), parts)


def head_length(prefix: bytes | bytearray | memoryview) -> int:
    """How many bytes the prefix and header take, from the first 16 (``CorruptChunkError`` if they are not a
    chunk's): read that much, then call ``blob_head``."""
    view = memoryview(prefix).cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptChunkError(f"{len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, _version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {bytes(magic)!r} (not a preheat KV chunk)")
    if header_len > _MAX_HEADER:
        raise CorruptChunkError(f"header length {header_len} is more than {_MAX_HEADER}")
    return int(_PREFIX.size + header_len)


def blob_head(head: bytes | bytearray | memoryview, key: str, expect: BlobExpect) -> BlobHead:
    """Check the prefix and header of an opaque value (``head``: at least ``head_length`` bytes) against what the
    reader expects, before its payload is read straight into the caller's buffer; ``check_blob`` then verifies the
    payload. A keyed reader's tag is checked by ``check_blob`` over the header and the payload, so this parses a
    header (bounded, as ``decode`` does) before its tag is known good."""
    view = memoryview(head).cast("B")
    end = head_length(view)
    if len(view) < end:
        raise CorruptChunkError(f"value {key!r}: {len(view)} bytes, shorter than its header")
    _magic, version, _header_len = _PREFIX.unpack_from(view)
    keyed = version == VERSION_KEYED
    if version not in (VERSION, VERSION_KEYED):
        raise CorruptChunkError(f"value {key!r}: format version {version}, this preheat reads 1 and 2")
    if keyed != (expect.mac_key is not None):
        raise MacError(f"value {key!r}: {'keyed' if keyed else 'unkeyed'}, and this reader "
                       f"{'has no secret' if keyed else 'requires a MAC (--kv-secret-file)'}")
    try:
        header = _parse_header(view[_PREFIX.size : end])
    except JSONInputError as exc:
        raise CorruptChunkError(f"value {key!r}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptChunkError(f"value {key!r}: header is not a JSON object")
    _check_blob(header, key, expect)
    return BlobHead(end, header["payload_bytes"], header["checksum"], keyed)


def check_blob(
    head: bytes | bytearray | memoryview, payload: Sequence[memoryview], *, tag: bytes, parsed: BlobHead, key: str,
    expect: BlobExpect,
) -> None:
    """Verify a payload read apart from its header (``blob_head``), in one or more consecutive parts: the tag over
    header and payload first (keyed readers), then the checksum; ``CorruptChunkError``/``MacError`` on any
    difference."""
    if parsed.keyed:
        assert expect.mac_key is not None  # blob_head refused a keyed file for an unkeyed reader
        tagger = mac.tagger(expect.mac_key)
        tagger.update(memoryview(head).cast("B")[: parsed.offset])
        for part in payload:
            tagger.update(part)
        if not hmac.compare_digest(tagger.digest(), tag):
            raise MacError(f"value {key!r}: MAC mismatch (forged, or written under another secret)")
    got = sum(len(part) for part in payload)
    if got != parsed.payload_bytes:
        raise CorruptChunkError(f"value {key!r}: {got} payload bytes, header says {parsed.payload_bytes}")
    check_checksum(payload, parsed.checksum, key)


def check_checksum(payload: Sequence[memoryview], checksum: str, key: str) -> None:
    """``CorruptChunkError`` unless the XXH3-128 of ``payload`` (one or more consecutive parts) is ``checksum``
    (its hex, as the header holds it)."""
    if len(payload) == 1:
        got = xxhash.xxh3_128_hexdigest(payload[0])  # one call: ~2 us less than a hasher object on 1 MiB
    else:
        digest = xxhash.xxh3_128()
        for part in payload:
            digest.update(part)
        got = digest.hexdigest()
    check_digest(got, checksum, key)


def payload_checksum(payload: bytes | bytearray | memoryview) -> str:
    """The checksum of a payload in one buffer (XXH3-128, hex), as the header holds it."""
    return xxhash.xxh3_128_hexdigest(payload)


def payload_hasher() -> xxhash.xxh3_128:
    """A hasher of the payload checksum (XXH3-128), for a reader that hashes a payload piece by piece as it arrives
    (``check_digest`` then compares its ``hexdigest()``)."""
    return xxhash.xxh3_128()


def check_digest(got: str, checksum: str, key: str) -> None:
    """``CorruptChunkError`` unless the payload's XXH3-128 ``got`` (hex) is the header's ``checksum``."""
    if got != checksum:
        raise CorruptChunkError(f"value {key!r}: checksum mismatch (corrupt or torn)")


def verify_any(blob: bytes | bytearray | memoryview, fingerprint: str, mac_key: bytes | None) -> dict[str, object]:
    """The header of any chunk or value of namespace ``fingerprint`` once its bytes check out (prefix, header,
    payload length, checksum, and the tag when ``mac_key`` is given), whatever its kind, key, dtype or shape: for
    tools that handle stored bytes without serving them (``preheat kv warm``). Without ``mac_key`` a keyed chunk's
    tag is not checked (its checksum is), so a fleet's signed chunks are never taken for damaged ones."""
    view = memoryview(blob).cast("B")
    end = head_length(view)
    _magic, version, _header_len = _PREFIX.unpack_from(view)
    if version not in (VERSION, VERSION_KEYED):
        raise CorruptChunkError(f"format version {version}, this preheat reads 1 and 2")
    if version == VERSION_KEYED:
        view = _verified(view, "?", version, mac_key) if mac_key is not None else view[: -mac.TAG_BYTES]
    elif mac_key is not None:
        raise MacError("unkeyed, and this reader requires a MAC")
    if end > len(view):
        raise CorruptChunkError(f"{len(view)} bytes, shorter than its header")
    try:
        header = _parse_header(view[_PREFIX.size : end])
    except JSONInputError as exc:
        raise CorruptChunkError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("fingerprint") != fingerprint:
        raise CorruptChunkError(f"not a chunk of {fingerprint}")
    payload = view[end:]
    if len(payload) != header.get("payload_bytes"):
        raise CorruptChunkError(f"{len(payload)} payload bytes, header says {header.get('payload_bytes')}")
    if xxhash.xxh3_128_hexdigest(payload) != header.get("checksum"):
        raise CorruptChunkError("checksum mismatch (corrupt or torn)")
    return header


def peek_key(head: bytes | bytearray | memoryview) -> str | None:
    """The ``key`` a chunk's header claims, from its first bytes (prefix and header), unverified: for listing a
    store whose file names are hashes. None when ``head`` does not parse. Never trust it for anything but a name to
    ``get`` (which verifies everything)."""
    view = memoryview(head).cast("B")
    if len(view) < _PREFIX.size:
        return None
    magic, _version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC or header_len > _MAX_HEADER or _PREFIX.size + header_len > len(view):
        return None
    try:
        header = _parse_header(view[_PREFIX.size : _PREFIX.size + header_len])
    except JSONInputError:
        return None
    found = header.get("key") if isinstance(header, dict) else None
    return found if isinstance(found, str) else None


def decode(blob: bytes | bytearray | memoryview, key: str, expect: AnyExpect) -> Payload:
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
        header = _parse_header(view[_PREFIX.size : _PREFIX.size + header_len])
    except JSONInputError as exc:  # not UTF-8, not JSON, or nested too deep
        raise CorruptChunkError(f"chunk {key}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptChunkError(f"chunk {key}: header is not a JSON object")
    if isinstance(expect, BlobExpect):
        _check_blob(header, key, expect)
    else:
        _check(header, key, expect)
    payload = view[_PREFIX.size + header_len :]
    if len(payload) != header["payload_bytes"]:
        raise CorruptChunkError(f"chunk {key}: {len(payload)} payload bytes, header says {header['payload_bytes']}")
    if xxhash.xxh3_128_hexdigest(payload) != header["checksum"]:
        raise CorruptChunkError(f"chunk {key}: checksum mismatch (corrupt or torn)")
    data_bytes = expect.data_bytes if isinstance(expect, Expect) else len(payload)
    if header["scale_shape"] is None:
        return Payload(payload[:data_bytes])
    return Payload(payload[:data_bytes], payload[data_bytes:])


def _parse_header(raw: memoryview) -> object:
    """A header's JSON, bounded (``JSONInputError`` otherwise): chunks come from tiers others can write."""
    return loads_bounded(raw, max_bytes=_MAX_HEADER, max_depth=_MAX_HEADER_DEPTH)


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
    want_scales = list(expect.shape[:-1]) if expect.quantized else None
    _require(header, f"chunk {key}", {
        "key": key,
        "fingerprint": expect.fingerprint,
        "dtype": expect.dtype,
        "shape": list(expect.shape),
        "scale_shape": want_scales,
        "payload_bytes": expect.payload_bytes,
    })


def _check_blob(header: dict[str, object], key: str, expect: BlobExpect) -> None:
    size = header.get("payload_bytes")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= expect.max_payload_bytes:
        raise CorruptChunkError(f"value {key!r}: payload_bytes is {size!r}, expected at most "
                                f"{expect.max_payload_bytes}")
    _require(header, f"value {key!r}", {
        "key": key,
        "fingerprint": expect.fingerprint,  # the namespace's id
        "kind": BLOB_KIND,
        "dtype": BLOB_DTYPE,
        "shape": [size],
        "scale_shape": None,
    })


def _require(header: dict[str, object], what: str, wanted: dict[str, object]) -> None:
    """``CorruptChunkError`` naming the first header field that is not what the reader expects (or a checksum that
    is not a string)."""
    for name, want in wanted.items():
        if name not in header:  # an absent field is not a null one: the decoder reads every field it checked here
            raise CorruptChunkError(f"{what}: no {name} in the header, expected {want!r}")
        if header[name] != want:
            raise CorruptChunkError(f"{what}: {name} is {header[name]!r}, expected {want!r}")
    if not isinstance(header.get("checksum"), str):
        raise CorruptChunkError(f"{what}: checksum is {header.get('checksum')!r}, expected a hex string")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
