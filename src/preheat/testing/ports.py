"""A free TCP port on 127.0.0.1, for the doubles that must name their port before their process starts (a Redis or
a vLLM child binds it itself, so the port cannot be taken with ``bind(0)`` in this process and handed over)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no socket on 127.0.0.1 holds right now (another process may still take it before the caller does)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
