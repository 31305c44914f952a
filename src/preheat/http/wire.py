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
from functools import lru_cache
from http import HTTPStatus

from preheat.http.ranges import parse_length

MAX_HEAD_BYTES = 64 * 1024  # http.server's _MAXLINE per line; here for the whole head, which is stricter
MAX_HEADERS = 100  # http.client's and http.server's _MAXHEADERS
HEAD_END = b"\r\n\r\n"
_TCHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # RFC 9110's tchar
_TOKEN = frozenset(_TCHARS.encode("ascii"))  # a request line's method, as bytes
_TOKEN_CHARS = frozenset(_TCHARS)  # a header's name, as text
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


class ResponseHead:
    """An answer's status line and headers; ``chunked`` and ``length`` (the body's ``Content-Length``; None: chunked,
    or read to the close) are read once, here."""

    __slots__ = ("chunked", "headers", "length", "reason", "status", "version")

    def __init__(self, status: int, reason: str, version: str, headers: Headers) -> None:
        self.status, self.reason, self.version, self.headers = status, reason, version, headers
        self.chunked = "chunked" in (headers.get("transfer-encoding") or "").lower()
        raw = None if self.chunked else headers.get("content-length")
        self.length = parse_length(raw) if raw is not None else None

    @property
    def keep_alive(self) -> bool:
        connection = (self.headers.get("connection") or "").lower()
        return "close" not in connection and self.version != "HTTP/1.0"


def _headers(block: bytes) -> list[tuple[str, str]] | str:
    """The ``name: value`` pairs of ``block`` (header lines, each ending in CRLF), or why not: a name with spaces or
    no colon, or a bare CR or LF in a line (request smuggling's favourite tools). Decoded once, split as text: twice
    as fast as per-line bytes (the router parses two heads per request)."""
    if not block:
        return []
    pairs: list[tuple[str, str]] = []
    for line in block.decode("latin-1")[:-2].split("\r\n"):
        name, colon, value = line.partition(":")
        if not colon or not name or not _TOKEN_CHARS.issuperset(name) or "\r" in line or "\n" in line:
            return f"malformed header line {line[:80]!r}"
        pairs.append((name, value.strip(" \t")))
        if len(pairs) > MAX_HEADERS:
            return f"more than {MAX_HEADERS} headers"
    return pairs


def _split_head(data: bytes) -> tuple[bytes, bytes]:
    """The first line of a head and its header lines (each with its CRLF; the blank line left off)."""
    first, _, rest = data.partition(b"\r\n")
    return first, rest[:-2] if rest.endswith(b"\r\n") else rest


def parse_request_head(data: bytes) -> RequestHead | WireRefusal:
    """A request's line and headers (``data`` up to and including the blank line)."""
    if len(data) > MAX_HEAD_BYTES:
        return WireRefusal(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
    first, block = _split_head(data)
    words = first.split(b" ")
    if len(words) != 3 or not words[0] or not words[1] or not _TOKEN.issuperset(words[0]):
        return WireRefusal(400, f"bad request line {first[:80]!r}")
    version = words[2].decode("latin-1")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        return WireRefusal(505, f"HTTP version {version[:20]!r} is not supported")
    pairs = _headers(block)
    if isinstance(pairs, str):
        return WireRefusal(431 if pairs.startswith("more") else 400, pairs)
    try:
        target = words[1].decode("ascii")
    except UnicodeDecodeError:
        return WireRefusal(400, "the request target is not ASCII")
    return RequestHead(words[0].decode("ascii"), target, version, Headers(pairs))


def parse_response_head(data: bytes) -> ResponseHead | str:
    """An answer's status line and headers, or why they are not valid HTTP/1.x."""
    first, block = _split_head(data)
    version, _, rest = first.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        return f"bad status line {first[:80]!r}"
    pairs = _headers(block)
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
