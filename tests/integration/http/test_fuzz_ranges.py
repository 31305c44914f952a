"""Range and Content-Range from anyone: the server answers 206, 200 or 416 and the client accepts the exact range or
raises ``SourceError``, whatever the header holds (thousands of digits included); never a ``ValueError``."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostile import ScriptedServer
from preheat.core.errors import SourceError, UnsatisfiableRangeError
from preheat.http.ranges import MAX_DIGITS, parse_content_range, parse_length, parse_range
from preheat.sources.http import HTTPOrigin
from preheat.sources.net import NetSettings
from preheat.testing.fileserver import FileServer
from strategies import FUZZ

SIZE = 1000
digits = st.integers(0, 6000).map(lambda n: "9" * n) | st.integers(0, 10**25).map(str) | st.just("")
zeros = st.integers(0, 30).map(lambda n: "0" * n)
spaces = st.sampled_from(["", " ", "\t"])
range_values = st.builds(
    lambda unit, a, b, z, s: f"{unit}={s}{z}{a}{s}-{s}{b}{s}", st.sampled_from(["bytes", "BYTES", "items"]),
    digits, digits, zeros, spaces,
) | st.text(max_size=60)  # fmt: skip
content_ranges = st.builds(
    lambda a, b, total: f"bytes {a}-{b}/{total}", digits, digits, digits | st.just("*")
) | st.text(max_size=60)  # fmt: skip


@FUZZ
@given(range_values, st.integers(0, 2 * SIZE))
def test_any_range_header_is_a_span_inside_the_file_a_416_or_the_whole_file(value: str, size: int) -> None:
    try:
        span = parse_range(value, size)
    except UnsatisfiableRangeError:
        return
    if span is not None:
        first, last = span
        assert 0 <= first <= last < size


@FUZZ
@given(content_ranges)
def test_any_content_range_parses_to_sane_numbers_or_none(value: str) -> None:
    parsed = parse_content_range(value)
    if parsed is not None:
        numbers = [n for n in (parsed.first, parsed.last, parsed.total) if n is not None]
        assert all(0 <= n < 10**MAX_DIGITS for n in numbers)
        assert parsed.first is None or parsed.last is None or parsed.first <= parsed.last


@FUZZ
@given(st.text(max_size=40) | digits)
def test_content_length_is_ascii_digits_only(value: str) -> None:
    got = parse_length(value)
    text = value.strip()
    if text.isascii() and text.isdigit() and len(text.lstrip("0")) <= MAX_DIGITS:
        assert got == int(text)
    else:
        assert got is None


def test_huge_positions_mean_past_the_end_not_an_error() -> None:
    huge = "9" * 5_000  # int() refuses more than 4,300 digits
    with pytest.raises(UnsatisfiableRangeError, match="5000 digits"):
        parse_range(f"bytes={huge}-", SIZE)
    assert parse_range(f"bytes=0-{huge}", SIZE) == (0, SIZE - 1)
    assert parse_range(f"bytes=-{huge}", SIZE) == (0, SIZE - 1)
    assert parse_range(f"bytes={'0' * 5_000}7-9", SIZE) == (7, 9)
    assert parse_range("bytes=\u0663-", SIZE) is None  # Arabic-Indic digit three: int() would take it
    assert parse_content_range(f"bytes 0-{huge}/{huge}") is None


# -- over the wire ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileServer]:
    root = tmp_path_factory.mktemp("ranges")
    (root / "blob").write_bytes(bytes(range(250)) * 4)
    with FileServer(str(root)) as server:
        yield server


def get(server: FileServer, range_value: str) -> tuple[int, str | None, int]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/blob", headers={"Range": range_value})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Range"), len(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("value", "status", "content_range", "length"),
    [
        ("bytes=" + "9" * 5_000 + "-", 416, "bytes */1000", 0),
        ("bytes=0-" + "9" * 5_000, 206, "bytes 0-999/1000", SIZE),
        ("bytes=-" + "9" * 5_000, 206, "bytes 0-999/1000", SIZE),
        ("bytes=" + "0" * 5_000 + "10-19", 206, "bytes 10-19/1000", 10),
        ("bytes=5-" + "0" * 5_000 + "1", 200, None, SIZE),  # last < first: malformed, the whole file
    ],
    ids=["huge-first", "huge-last", "huge-suffix", "leading-zeros", "reversed"],
)
def test_file_server_answers_ranges_of_thousands_of_digits(
    served: FileServer, value: str, status: int, content_range: str | None, length: int
) -> None:
    assert get(served, value) == (status, content_range, length)
    assert get(served, "bytes=0-9") == (206, "bytes 0-9/1000", 10)  # and it still serves


@pytest.mark.parametrize(
    "content_range",
    ["bytes 0-" + "9" * 5_000 + "/1000", "bytes 0-99/" + "1" * 5_000],
    ids=["huge-last", "huge-total"],
)
def test_client_refuses_a_content_range_of_thousands_of_digits(tmp_path: Path, content_range: str) -> None:
    def script(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], list[bytes]]:
        if method == "HEAD":
            return 200, {"Content-Length": "1000", "Accept-Ranges": "bytes"}, []
        return 206, {"Content-Range": content_range, "Content-Length": "100"}, [b"\0" * 100]

    with ScriptedServer(script) as server:
        origin = HTTPOrigin(server.url, settings=NetSettings(attempts=1))
        source = origin.open("blob")
        assert source.size() == 1000
        with pytest.raises(SourceError, match="Content-Range"):
            source.readv(0, [memoryview(bytearray(100))])
        source.close()
        origin.close()


@pytest.mark.parametrize("length", ["\u00b2", "9" * 5_000], ids=["superscript", "5000-digits"])
def test_client_treats_a_content_length_it_cannot_read_as_absent(length: str) -> None:
    def script(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], list[bytes]]:
        if method == "HEAD":
            return 200, {"Content-Length": length}, []
        return 206, {"Content-Range": "bytes 0-0/1000", "Content-Length": "1"}, [b"\0"]

    with ScriptedServer(script) as server, HTTPOrigin(server.url, settings=NetSettings(attempts=1)) as origin:
        source = origin.open("blob")
        assert source.size() == 1000  # from the ranged GET's Content-Range instead
        source.close()
