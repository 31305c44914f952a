"""HTTP/1.1 message heads, parsed and written: pure (bytes in, values out), for the event-loop servers and clients
(``preheat.http.aio``). Bounded as the standard library's ``http.server`` and ``http.client`` bound them: a head of at
most ``MAX_HEAD_BYTES``, at most ``MAX_HEADERS`` header lines, ASCII request lines; a body's length is
``ranges.parse_length``'s strict ``Content-Length``.

    >>> head = parse_request_head(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 2\\r\\n\\r\\n")
    >>> head.method, head.target, head.headers.get("content-length"), head.keep_alive
    ('POST', '/v1/completions', '2', True)
    >>> answer = parse_response_head(b"HTTP/1.1 200 OK\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n")
    >>> answer.status, answer.chunked, answer.length
    (200, True, None)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from email.utils import formatdate
from functools import cached_property, lru_cache
from http import HTTPStatus

from preheat.http.ranges import parse_length

MAX_HEAD_BYTES = 64 * 1024  # http.server's _MAXLINE per line; here for the whole head, which is stricter
MAX_HEADERS = 100  # http.client's and http.server's _MAXHEADERS
HEAD_END = b"\r\n\r\n"
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_REASONS = {status.value: status.phrase for status in HTTPStatus}


class Headers:
    """Header lines in their order, names as sent, looked up without regard to case (the first of repeated ones)."""

    __slots__ = ("_by_name", "lines")

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        self.lines = lines
        self._by_name = {name.lower(): value for name, value in reversed(lines)}  # the first of repeated ones wins

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._by_name.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name

    def items(self) -> list[tuple[str, str]]:
        return self.lines


@dataclass(frozen=True)
class WireRefusal:
    """Why a request head was refused: the status to answer (400, 431, 505) and what to say. The connection cannot
    carry another request after it."""

    status: int
    message: str


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    headers: Headers

    @property
    def keep_alive(self) -> bool:
        """Whether the client keeps its connection for another request (HTTP/1.1's default, 1.0's opt-in)."""
        connection = (self.headers.get("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass(frozen=True)
class ResponseHead:
    status: int
    reason: str
    version: str
    headers: Headers

    @cached_property
    def chunked(self) -> bool:
        return "chunked" in (self.headers.get("transfer-encoding") or "").lower()

    @cached_property
    def length(self) -> int | None:
        """The body's ``Content-Length`` (None: chunked, or read to the close)."""
        if self.chunked:
            return None
        raw = self.headers.get("content-length")
        return parse_length(raw) if raw is not None else None

    @property
    def keep_alive(self) -> bool:
        connection = (self.headers.get("connection") or "").lower()
        return "close" not in connection and self.version != "HTTP/1.0"


def _header_lines(lines: Iterable[bytes]) -> list[tuple[str, str]] | str:
    """``name: value`` pairs, or why not (a name with spaces or no colon: request smuggling's favourite tools)."""
    pairs: list[tuple[str, str]] = []
    for line in lines:
        if not line:
            continue
        name, colon, value = line.partition(b":")
        if not colon or not name or not _TOKEN.issuperset(name):
            return f"malformed header line {line[:80]!r}"
        pairs.append((name.decode("ascii"), value.strip(b" \t").decode("latin-1")))
        if len(pairs) > MAX_HEADERS:
            return f"more than {MAX_HEADERS} headers"
    return pairs


def parse_request_head(data: bytes) -> RequestHead | WireRefusal:
    """A request's line and headers (``data`` up to and including the blank line)."""
    if len(data) > MAX_HEAD_BYTES:
        return WireRefusal(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
    lines = data.rstrip(b"\r\n").split(b"\r\n")
    words = lines[0].split(b" ")
    if len(words) != 3 or not words[0] or not words[1] or not _TOKEN.issuperset(words[0]):
        return WireRefusal(400, f"bad request line {lines[0][:80]!r}")
    version = words[2].decode("latin-1")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        return WireRefusal(505, f"HTTP version {version[:20]!r} is not supported")
    pairs = _header_lines(lines[1:])
    if isinstance(pairs, str):
        return WireRefusal(431 if pairs.startswith("more") else 400, pairs)
    try:
        target = words[1].decode("ascii")
    except UnicodeDecodeError:
        return WireRefusal(400, "the request target is not ASCII")
    return RequestHead(words[0].decode("ascii"), target, version, Headers(pairs))


def parse_response_head(data: bytes) -> ResponseHead | str:
    """An answer's status line and headers, or why they are not valid HTTP/1.x."""
    lines = data.rstrip(b"\r\n").split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        return f"bad status line {lines[0][:80]!r}"
    pairs = _header_lines(lines[1:])
    if isinstance(pairs, str):
        return pairs
    return ResponseHead(int(code), reason.decode("latin-1"), version.decode("ascii"), Headers(pairs))


def request_head(method: str, target: str, host: str, headers: Iterable[tuple[str, str]], length: int | None) -> bytes:
    """A request's line and headers to send (``length``: its ``Content-Length``, None for none)."""
    out = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    out += [f"{name}: {value}\r\n" for name, value in headers]
    if length is not None:
        out.append(f"Content-Length: {length}\r\n")
    out.append("\r\n")
    return "".join(out).encode("latin-1")


def response_head(status: int, headers: Iterable[tuple[str, str]], server: str) -> bytes:
    """An answer's status line and headers, with ``Server`` and ``Date`` first as ``http.server`` writes them."""
    reason = _REASONS.get(status, "")
    out = [f"HTTP/1.1 {status} {reason}\r\nServer: {server}\r\nDate: {http_date()}\r\n"]
    out += [f"{name}: {value}\r\n" for name, value in headers]
    out.append("\r\n")
    return "".join(out).encode("latin-1")


def http_date() -> str:
    """Now as an HTTP ``Date``: one formatted per second, the header's resolution, not one per answer."""
    return _date_of(int(time.time()))


@lru_cache(maxsize=1)
def _date_of(second: int) -> str:
    return formatdate(second, usegmt=True)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body; empty ``data``: the last chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b"0\r\n\r\n"


def parse_chunk_size(line: bytes) -> int | None:
    """A chunk-size line's size (extensions ignored), None when it is not one."""
    size = line.split(b";", 1)[0].strip()
    if not size or len(size) > 16 or not all(c in b"0123456789abcdefABCDEF" for c in size):
        return None
    return int(size, 16)
