"""HTTP byte ranges as pure functions (RFC 9110 section 14), shared by the client and ``FileServer``.

Client side: ``range_header`` builds ``Range: bytes=a-b`` and ``parse_content_range`` reads the answer's
``Content-Range``. Server side: ``parse_range`` turns a request's ``Range`` header into the one span to serve.
Positions are inclusive, as on the wire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", re.IGNORECASE)
_RANGE_SPEC = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")


class UnsatisfiableRangeError(ValueError):
    """The requested range starts at or past the end of the file (answer 416 with ``Content-Range: bytes */size``)."""


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
    first, last, total = match.groups()
    parsed = ContentRange(
        int(first) if first is not None else None,
        int(last) if last is not None else None,
        None if total == "*" else int(total),
    )
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
        suffix = int(last_text)
        if suffix == 0 or size == 0:
            raise UnsatisfiableRangeError(f"suffix range -{suffix} of a {size}-byte file")
        return max(0, size - suffix), size - 1
    first = int(first_text)
    if last_text and int(last_text) < first:
        return None
    last = int(last_text) if last_text else size - 1
    if first >= size:
        raise UnsatisfiableRangeError(f"range {first}-{last_text} starts past the end of a {size}-byte file")
    return first, min(last, size - 1)
