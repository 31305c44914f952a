"""A free TCP port on 127.0.0.1, for the doubles that must name their port before their process starts (a Redis or
a vLLM child binds it itself, so the port cannot be taken with ``bind(0)`` in this process and handed over).

The port comes from below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), where nothing binds
unless it names the port: a port from ``bind(0)`` is an ephemeral one, and between this probe and the child's bind
any process binding port 0 (vLLM's engine binds several ZMQ and torch sockets so) may be handed the same one. That
race failed a pair of vLLM servers started together ("Address already in use" on a KV-events endpoint).
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOW = 10_000  # below this, well-known and registered services
_given: set[int] = set()  # handed out by this process: two doubles of one test never get the same port
_lock = threading.Lock()


def free_port() -> int:
    """A port no socket on 127.0.0.1 holds right now and no earlier call returned (another process naming it could
    still take it before the caller does; none binding port 0 will)."""
    high = _ephemeral_start()
    with _lock:
        for _ in range(200):
            port = random.randrange(_LOW, high) if high > _LOW else 0  # noqa: S311 - a port, not a secret
            if port in _given:
                continue
            try:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
                    port = int(sock.getsockname()[1])
            except OSError:
                continue
            _given.add(port)
            return port
    raise OSError(f"no free TCP port on 127.0.0.1 between {_LOW} and {high}")


def _ephemeral_start() -> int:
    """The first port the kernel hands out for ``bind(0)`` (Linux: 32768 by default; elsewhere assumed so)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768
