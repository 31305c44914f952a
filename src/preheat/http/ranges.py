"""HTTP byte ranges as pure functions (RFC 9110 section 14), shared by the client and ``FileServer``.

Client side: ``range_header`` builds ``Range: bytes=a-b`` and ``parse_content_range`` reads the answer's
``Content-Range``. Server side: ``parse_range`` turns a request's ``Range`` header into the one span to serve.
Positions are inclusive, as on the wire.

Numbers are ASCII digits only (``int`` would also take ``_``, signs and other scripts' digits) and are read only up to
``MAX_DIGITS`` significant digits, so a header of thousands of digits costs nothing and raises nothing unexpected: a
request position past that is past the end of any file (416, or "to the end"); a response that claims one is
malformed (None, which the client refuses with ``SourceError``). ``parse_length`` reads ``Content-Length`` likewise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from preheat.core.errors import UnsatisfiableRangeError

MAX_DIGITS = 19  # 10**19 > 2**63: no file, range or body is larger; more significant digits than this are refused
_BEYOND = 10**MAX_DIGITS  # a request position with more digits: past the end of any file
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:([0-9]+)-([0-9]+)|\*)/(?:([0-9]+)|\*)\s*$", re.IGNORECASE | re.ASCII)
_RANGE_SPEC = re.compile(r"^\s*([0-9]*)\s*-\s*([0-9]*)\s*$", re.ASCII)


@dataclass(frozen=True)
class ContentRange:
    """A parsed ``Content-Range``: ``first``/``last`` are None for ``bytes */size``; ``total`` is None for ``/*``."""

    first: int | None
    last: int | None
    total: int | None


def range_header(first: int, last: int) -> str:
    """The ``Range`` value asking for bytes ``first..last`` inclusive."""
    if not 0 <= first <= last:
        raise ValueError(f"bad byte range {first}-{last}")
    return f"bytes={first}-{last}"


def content_range(first: int, last: int, total: int) -> str:
    """The ``Content-Range`` value for a 206 answer."""
    return f"bytes {first}-{last}/{total}"


def parse_content_range(value: str | None) -> ContentRange | None:
    """Parse ``bytes a-b/N``, ``bytes a-b/*`` or ``bytes */N``; None when absent or malformed."""
    if value is None:
        return None
    match = _CONTENT_RANGE.match(value)
    if not match:
        return None
    texts = match.groups()  # None for '*'
    values = [None if text is None else _decimal(text) for text in texts]
    if any(value is None and text is not None for text, value in zip(texts, values, strict=True)):
        return None  # more than MAX_DIGITS digits: no server serves such a file
    parsed = ContentRange(*values)
    if parsed.first is not None and parsed.last is not None and parsed.first > parsed.last:
        return None
    return parsed


def parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive span a server should send for request header ``Range: value`` on a file of ``size`` bytes.

    None means "send the whole file with 200": no header, a unit other than bytes, a malformed spec, or several
    ranges (RFC 9110 lets a server ignore any Range it does not want to honour). Raises
    ``UnsatisfiableRangeError`` for a range that starts at or past the end of the file (or a zero-length suffix).
    """
    unit, sep, spec = (value or "").partition("=")
    match = _RANGE_SPEC.match(spec)
    if not sep or unit.strip().lower() != "bytes" or match is None:
        return None  # also several ranges: the comma makes the spec fail to match
    first_text, last_text = match.groups()
    if not first_text:
        if not last_text:
            return None
        suffix = _position(last_text)
        if suffix == 0 or size == 0:
            raise UnsatisfiableRangeError(f"suffix range -{_short(last_text)} of a {size}-byte file")
        return max(0, size - suffix), size - 1
    first = _position(first_text)
    last = _position(last_text) if last_text else _BEYOND
    if last < first:
        return None
    if first >= size:
        raise UnsatisfiableRangeError(f"range {_short(first_text)}- starts past the end of a {size}-byte file")
    return first, min(last, size - 1)


def parse_length(value: str | None) -> int | None:
    """A ``Content-Length`` value: 1 to ``MAX_DIGITS`` significant ASCII digits; None when absent or malformed."""
    return None if value is None else _decimal(value.strip())


def _decimal(text: str) -> int | None:
    """``text`` if it is only ASCII digits, with at most ``MAX_DIGITS`` of them after any leading zeros."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    significant = text.lstrip("0")
    return int(significant or "0") if len(significant) <= MAX_DIGITS else None


def _position(text: str) -> int:
    """A byte position from a request (ASCII digits, already matched): its value, or ``_BEYOND`` when it has more
    significant digits than any file size (so it compares as past the end without converting thousands of digits)."""
    value = _decimal(text)
    return _BEYOND if value is None else value


def _short(text: str) -> str:
    """A number from a header, cut for an error message."""
    return text if len(text) <= 24 else f"{text[:20]}...({len(text)} digits)"
