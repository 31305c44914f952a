"""The chunk decoder takes bytes anyone who can write the shared L2 controls: arbitrary and mutated chunks either
decode to exactly the chunk that was written or raise ``CorruptChunkError`` (a ``KVError``, which tiers turn into a
miss); never another exception, never wrong K/V, and never more than ``BOUND`` bytes of memory beyond the input
(the JSON objects of a header of at most 64 KiB)."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strategies
from kvchunks import FP, chunk, expect, key, same
from preheat.core.errors import CorruptChunkError, KVError
from preheat.kv import chunkfile, mac
from preheat.kv.chunk import decode_chunk, encode_chunk

BOUND = 2 << 20
MAC_KEY = mac.derive_key(b"fuzzing secret, 16+ bytes")
ORIGINALS = {
    (kv_dtype, keyed): bytes(b"".join(encode_chunk(key(0), FP, chunk(0, kv_dtype), MAC_KEY if keyed else None)))
    for kv_dtype in ("auto", "int8")
    for keyed in (False, True)
}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = strategies.json_values(25, allow_nonfinite=True)


def reader(kv_dtype: str, keyed: bool) -> chunkfile.Expect:
    plain = expect(kv_dtype)
    return chunkfile.Expect(plain.fingerprint, plain.dtype, plain.shape, mac_key=MAC_KEY if keyed else None)


def decodes_safely(blob: bytes, kv_dtype: str, keyed: bool) -> None:
    """The property: the original chunk or ``CorruptChunkError``, within ``BOUND`` bytes of extra memory."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            decoded = decode_chunk(blob, key(0), reader(kv_dtype, keyed))
        except CorruptChunkError:
            decoded = None
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak <= BOUND
    if decoded is not None:
        assert same(decoded, chunk(0, kv_dtype)), "a changed chunk decoded to other K/V"


kinds = st.sampled_from(sorted(ORIGINALS))


def mutation(data: st.DataObject, blob: bytes) -> bytes:
    size = len(blob)
    how = data.draw(st.sampled_from(["flip", "truncate", "splice", "overwrite", "length"]))
    out = bytearray(blob)
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            out[data.draw(st.integers(0, size - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del out[data.draw(st.integers(0, size - 1)) :]
    elif how == "splice":
        at = data.draw(st.integers(0, size))
        out[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    elif how == "overwrite":
        at = data.draw(st.integers(0, size - 1))
        junk = data.draw(st.binary(min_size=1, max_size=64))
        out[at : at + len(junk)] = junk
    else:
        out[12:16] = struct.pack("<I", data.draw(st.integers(0, 2**32 - 1)))
    return bytes(out)


@FUZZ
@given(kinds, st.data())
def test_mutated_chunks_decode_to_the_original_or_are_refused(kind: tuple[str, bool], data: st.DataObject) -> None:
    blob = mutation(data, ORIGINALS[kind])
    decodes_safely(blob, *kind)


@FUZZ
@given(kinds, st.binary(max_size=4096), st.integers(0, 3), st.integers(0, 70_000))
def test_arbitrary_bytes_after_a_valid_prefix_are_refused(
    kind: tuple[str, bool], tail: bytes, version: int, header_len: int
) -> None:
    decodes_safely(struct.pack("<8sII", chunkfile.MAGIC, version, header_len) + tail, *kind)
    decodes_safely(tail, *kind)


@FUZZ
@given(
    kinds,
    st.sampled_from(
        ["key", "fingerprint", "kind", "dtype", "shape", "scale_shape", "payload_bytes", "checksum", "extra"]
    ),
    json_values,
)
def test_a_header_field_of_any_json_value_is_refused_or_harmless(
    kind: tuple[str, bool], field: str, value: object
) -> None:
    decodes_safely(with_header(ORIGINALS[kind], lambda header: {**header, field: value}), *kind)


@FUZZ
@given(kinds, json_values)
def test_a_header_of_any_json_value_is_refused(kind: tuple[str, bool], value: object) -> None:
    decodes_safely(with_header(ORIGINALS[kind], lambda _header: value), *kind)


def with_header(blob: bytes, change: Callable[[dict[str, object]], object]) -> bytes:
    """``blob`` with its JSON header replaced by ``change(header)`` (length field fixed; an existing tag kept)."""
    header_len = struct.unpack_from("<I", blob, 12)[0]
    header = json.loads(blob[16 : 16 + header_len])
    raw = json.dumps(change(header)).encode()
    return blob[:12] + struct.pack("<I", len(raw)) + raw + blob[16 + header_len :]


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_a_deeply_nested_header_is_refused_not_a_recursion_error(opener: bytes) -> None:
    raw = opener * (60_000 // len(opener))
    blob = struct.pack("<8sII", chunkfile.MAGIC, chunkfile.VERSION, len(raw)) + raw
    with pytest.raises(KVError, match="not JSON"):
        decode_chunk(blob, key(0), expect())


def test_the_largest_header_of_the_most_objects_stays_within_the_bound() -> None:
    raw = b"[" + b"{}," * 21_800 + b"{}]"  # about 64 KiB of empty objects: the most Python objects per header byte
    assert len(raw) <= 64 * 1024
    decodes_safely(struct.pack("<8sII", chunkfile.MAGIC, chunkfile.VERSION, len(raw)) + raw, "auto", False)
