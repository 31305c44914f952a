"""``preheat.core.jsonsafe``: JSON from outside is parsed exactly as ``json.loads`` would, or refused with
``JSONInputError``: never ``RecursionError``, never a guessed encoding, never a scan slower than linear."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.core.errors import JSONInputError
from preheat.core.jsonsafe import MAX_DEPTH, brackets, containers_exceed, depth_exceeds, loads_bounded, nesting_depth
from strategies import FUZZ, TRICKY, containers, depth, json_values

LIMIT = 1 << 20


def dumps(value: Any, style: int) -> bytes:  # Any: any JSON value
    """``value`` as JSON in one of several spellings (compact, spaced, indented, escaped or raw UTF-8)."""
    if style == 0:
        return json.dumps(value, separators=(",", ":")).encode()
    if style == 1:
        return json.dumps(value, ensure_ascii=False).encode()
    return json.dumps(value, indent=style).encode()


@FUZZ
@given(json_values(), st.integers(0, 3))
def test_valid_json_parses_as_json_loads_does(value: Any, style: int) -> None:  # Any: any JSON value
    raw = dumps(value, style)
    assert loads_bounded(raw, max_bytes=len(raw), max_depth=max(depth(value), 1)) == json.loads(raw)
    assert loads_bounded(raw.decode(), max_bytes=len(raw), max_depth=max(depth(value), 1)) == json.loads(raw)


@FUZZ
@given(json_values(), st.integers(0, 3))
def test_depth_is_counted_outside_strings_only(value: Any, style: int) -> None:  # Any: any JSON value
    raw = dumps(value, style)
    assert nesting_depth(brackets(raw)) == depth(value)
    for limit in {0, 1, depth(value) - 1, depth(value)} - {-1}:
        assert depth_exceeds(raw, limit) == (depth(value) > limit)
    for limit in {0, containers(value) - 1, containers(value)} - {-1}:
        assert containers_exceed(raw, limit) == (containers(value) > limit)


@FUZZ
@given(st.binary(max_size=200) | st.text(TRICKY, max_size=200).map(str.encode))
def test_any_bytes_parse_or_are_refused(raw: bytes) -> None:
    try:
        got = loads_bounded(raw, max_bytes=LIMIT)
    except JSONInputError:
        return
    assert got == json.loads(raw.decode("utf-8"))


@FUZZ
@given(st.lists(st.sampled_from(["[", "]", "{", "}", '"', "\\", ",", "1"]), max_size=300).map("".join))
def test_bracket_soup_parses_or_is_refused(text: str) -> None:
    with contextlib.suppress(JSONInputError):
        loads_bounded(text, max_bytes=LIMIT, max_depth=8)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,  # json.loads: RecursionError
        "[" * 100_000 + "]" * 100_000,
        '{"a":' * 50_000 + "1" + "}" * 50_000,
        "[[]" * 100_000,  # no long run of openers, still 100,000 deep
        "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
    ],
    ids=["open", "closed", "objects", "interleaved", "one-too-deep"],
)
def test_deep_nesting_is_refused_before_parsing(text: str) -> None:
    with pytest.raises(JSONInputError, match=f"nested deeper than {MAX_DEPTH} levels"):
        loads_bounded(text, max_bytes=LIMIT)


def test_nesting_at_the_limit_is_fine() -> None:
    # Long enough for the vectorised measure (over 64 KiB of brackets); every run is exactly MAX_DEPTH deep.
    text = ("[" * MAX_DEPTH + "]" * MAX_DEPTH + ",") * 2_000
    runs = loads_bounded(f"[{text[:-1]}]", max_bytes=LIMIT, max_depth=MAX_DEPTH + 1)
    assert isinstance(runs, list)
    assert len(runs) == 2_000
    skeleton = brackets(text.encode())
    assert len(skeleton) > 64 * 1024
    assert nesting_depth(skeleton) == MAX_DEPTH
    assert nesting_depth(skeleton + b"[" * 70) == 70  # the deepest point is the very end, after many chunks


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps(["[" * 10_000, "{" * 10_000, '\\"[[[[', "\\"])
    assert loads_bounded(text, max_bytes=LIMIT) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    ['"' + '\\"' * 500_000, '"' + "\\" * 1_000_001, '["' + "[" * 500_000, '"' * 500_001],
    ids=["escaped-quotes", "backslashes", "unterminated", "quotes"],
)
def test_pathological_strings_are_refused_promptly(text: str) -> None:
    # The string scan is linear (no backtracking): a hang here is caught by the per-test timeout.
    with pytest.raises(JSONInputError):
        loads_bounded(text, max_bytes=4 * LIMIT)


def test_size_is_checked_first() -> None:
    with pytest.raises(JSONInputError, match="over the limit of 10"):
        loads_bounded(b"[" * 11, max_bytes=10)


def test_only_utf8_is_json_here() -> None:
    utf16 = '["a"]'.encode("utf-16-le")
    assert json.loads(utf16) == ["a"]  # the standard library guesses the encoding...
    with pytest.raises(JSONInputError, match="not valid JSON"):  # ...this does not (its NUL bytes are not JSON)
        loads_bounded(utf16, max_bytes=LIMIT)
    with pytest.raises(JSONInputError, match="not UTF-8"):
        loads_bounded(b'["\xff"]', max_bytes=LIMIT)


def test_constants_and_huge_integers_are_refused() -> None:
    for text in ("NaN", "[Infinity]", '{"a": -Infinity}'):
        with pytest.raises(JSONInputError, match="is not JSON"):
            loads_bounded(text, max_bytes=LIMIT)
    assert str(loads_bounded("[NaN]", max_bytes=LIMIT, allow_constants=True)) == "[nan]"
    with pytest.raises(JSONInputError, match="digits"):
        loads_bounded("1" * 5_000, max_bytes=LIMIT)


def test_many_containers_are_refused_when_bounded() -> None:
    text = "[" + "[]," * 200_000 + "[]]"
    many = loads_bounded(text, max_bytes=LIMIT)
    assert isinstance(many, list)
    assert len(many) == 200_001
    with pytest.raises(JSONInputError, match="more than 100000 arrays and objects"):
        loads_bounded(text, max_bytes=LIMIT, max_containers=100_000)
    assert loads_bounded(json.dumps(["[]" * 200_000]), max_bytes=LIMIT, max_containers=1) == ["[]" * 200_000]


def test_it_is_a_value_error_for_existing_handlers() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        loads_bounded("[", max_bytes=LIMIT)
