"""Server-sent events and HTTP/1.1 chunked framing, as pure functions over bytes (no sockets here).

An OpenAI stream is a sequence of ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``. Each event is
sent as one HTTP chunk, so the connection stays reusable (keep-alive) and clients see every token as soon as it is
written: no buffering proxy can hold back a complete chunk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

DONE = b"data: [DONE]\n\n"
LAST_CHUNK = b"0\r\n\r\n"


def event(payload: Mapping[str, object]) -> bytes:
    """One ``data:`` event carrying ``payload`` as compact JSON (JSON never contains a raw newline)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    """``data`` framed as one HTTP/1.1 chunk (``Transfer-Encoding: chunked``); empty data is not a chunk."""
    if not data:
        return b""
    return f"{len(data):x}\r\n".encode("ascii") + data + b"\r\n"


def parse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an event stream, in order (for clients and tests; ``[DONE]`` included)."""
    out = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines).decode())
    return out
