"""Safetensors headers from anyone: ``parse_header`` returns a header whose every tensor lies inside the file, or
raises ``CheckpointError`` naming the file; never another exception, whatever the bytes."""

from __future__ import annotations

import itertools
import json
import math
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.checkpoint import dtypes
from preheat.checkpoint.safetensors import (
    MAX_DIMS,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    SafetensorsHeader,
    header_length,
    parse_header,
)
from preheat.core.errors import CheckpointError
from strategies import FUZZ, huge_ints, json_values, tricky_text

WHERE = "fuzz.safetensors"
dims = st.lists(st.integers(0, 8) | huge_ints() | st.booleans() | st.floats(), max_size=4)
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from([*dtypes.known_names(), "F4", "f32"]) | json_values(3),
        "shape": dims | st.lists(st.just(1), min_size=MAX_DIMS, max_size=MAX_DIMS + 2) | json_values(3),
        "data_offsets": st.lists(st.integers(0, 64) | huge_ints(), min_size=0, max_size=3) | json_values(3),
    },
)
headers = st.dictionaries(
    tricky_text, entries | json_values(5), max_size=6
) | st.dictionaries(st.just("__metadata__"), json_values(5), max_size=1)  # fmt: skip


def parsed(raw: bytes, file_size: int) -> SafetensorsHeader | CheckpointError:
    try:
        return parse_header(raw, path=WHERE, file_size=file_size)
    except CheckpointError as exc:
        return exc


def check(raw: bytes, file_size: int) -> None:
    header = parsed(raw, file_size)
    if isinstance(header, CheckpointError):
        assert header.path == WHERE
        assert WHERE in str(header)
        return
    busy = sorted((t.start, t.end) for t in header.tensors if t.nbytes)
    for tensor in header.tensors:
        assert header.data_start <= tensor.start <= tensor.end <= file_size
        assert tensor.nbytes == math.prod(tensor.shape) * dtypes.itemsize(tensor.dtype)
        assert len(tensor.shape) <= MAX_DIMS
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(busy))


@FUZZ
@given(headers, st.integers(0, 256))
def test_any_header_json_is_a_checked_header_or_a_checkpoint_error(doc: dict[str, Any], data: int) -> None:
    raw = json.dumps(doc).encode()  # Any above: JSON values
    check(raw, PREFIX_BYTES + len(raw) + data)


@st.composite
def near_valid_headers(draw: st.DrawFn) -> dict[str, Any]:  # Any: JSON values
    """A valid header (tensors laid end to end), then maybe one field of one tensor replaced by anything."""
    doc: dict[str, Any] = {}
    offset = 0
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(dtypes.known_names()))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        end = offset + math.prod(shape) * dtypes.itemsize(dtype)
        doc[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
        offset = end
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(doc)))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        doc[name][field] = draw(json_values(4) | dims | st.lists(huge_ints(), min_size=2, max_size=2))
    return doc


@FUZZ
@given(near_valid_headers(), st.integers(-8, 64))
def test_near_valid_headers_are_checked_headers_or_checkpoint_errors(doc: dict[str, Any], slack: int) -> None:
    raw = json.dumps(doc).encode()  # Any above: JSON values
    data = max((e["data_offsets"][1] for e in doc.values() if _offsets_ok(e)), default=0)
    check(raw, max(0, PREFIX_BYTES + len(raw) + data + slack))


def _offsets_ok(entry: dict[str, Any]) -> bool:  # Any: JSON values
    offsets = entry.get("data_offsets")
    return isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 1000))
def test_any_header_bytes_are_a_header_or_a_checkpoint_error(raw: bytes, data: int) -> None:
    check(raw, PREFIX_BYTES + len(raw) + data)


@FUZZ
@given(st.binary(min_size=0, max_size=12), st.integers(0, 2**64))
def test_any_length_prefix_is_a_length_inside_the_file_or_an_error(prefix: bytes, size: int) -> None:
    try:
        length = header_length(prefix, path=WHERE, file_size=size)
    except CheckpointError:
        return
    assert PREFIX_BYTES + length <= size
    assert length <= MAX_HEADER_BYTES
    assert struct.unpack("<Q", prefix[:PREFIX_BYTES])[0] == length


HOSTILE = {
    "nesting": b"[" * 100_000,
    "nested metadata": b'{"__metadata__": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    "5000-digit offset": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, ' + b"9" * 5_000 + b"]}}",
    "huge dims": json.dumps({"a": {"dtype": "U8", "shape": [10**4000] * 3, "data_offsets": [0, 1]}}).encode(),
    "too many dims": json.dumps({"a": {"dtype": "U8", "shape": [1] * 100, "data_offsets": [0, 1]}}).encode(),
    "bool dims": json.dumps({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}).encode(),
    "NaN offset": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, NaN]}}',
    "UTF-16": json.dumps({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode("utf-16"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused_not_crashed_on(case: str) -> None:
    raw = HOSTILE[case]
    with pytest.raises(CheckpointError, match=WHERE):
        parse_header(raw, path=WHERE, file_size=len(raw) + 100)
