"""Server-sent events cut whole out of a stream that arrives in pieces. Pure: bytes in, bytes out.

The router relays a replica's stream event by event, so that a replica dying mid-event never leaves half an event in
front of the error event that ends the stream (proxy.py). ``EventFramer`` holds the start of an event until its
blank line arrives, and scans each byte once: only a new piece, and the byte before it (a blank line may span two
pieces). The caller bounds what is held (``held``), since the replica chooses how long an event is.

    >>> framer = EventFramer()
    >>> framer.push(b"data: 1\\n\\ndata: 2"), framer.held
    (b'data: 1\\n\\n', 7)
    >>> framer.push(b"\\n"), framer.push(b"\\n")
    (b'', b'data: 2\\n\\n')
    >>> framer.push(b"data: 3"), framer.end()
    (b'', b'data: 3')
"""

from __future__ import annotations

EVENT_END = b"\n\n"


class EventFramer:
    """``push(piece)``: the events the piece completes (b"" while one is still arriving); ``held``: the bytes waiting
    for their event's end; ``end()``: those bytes, when the stream is over."""

    def __init__(self) -> None:
        self._held = bytearray()

    @property
    def held(self) -> int:
        return len(self._held)

    def push(self, piece: bytes) -> bytes:
        if not self._held and piece.endswith(EVENT_END):
            return piece  # the usual piece: whole events (a replica writes one per chunk), nothing copied
        start = max(len(self._held) - 1, 0)  # what was held has no event end: only its last byte can begin one
        self._held += piece
        cut = self._held.rfind(EVENT_END, start) + len(EVENT_END)
        if cut < len(EVENT_END):
            return b""
        ready = bytes(self._held[:cut])
        del self._held[:cut]
        return ready

    def end(self) -> bytes:
        """What is held (an event the stream ended in the middle of), as it came; nothing is held after."""
        rest = bytes(self._held)
        self._held.clear()
        return rest
