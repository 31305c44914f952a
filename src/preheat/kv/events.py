"""The replica side of docs/kv-events.md: a numbered log of chunk stores and evictions, and measured costs.

The router polls ``GET /v1/kv/events?epoch=E&since=N``; ``EventLog.since`` answers with the events after N, or
``None`` when the caller must take a full snapshot instead (first poll, another epoch, or N older than the log).
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from dataclasses import dataclass

MAX_EVENTS = 10_000
_ALPHA = 0.3  # weight of the newest measurement in the moving averages


@dataclass(frozen=True)
class Event:
    seq: int
    op: str  # "store" or "evict"
    tier: str  # "l1" or "l2"
    key: str

    def to_dict(self) -> dict[str, object]:
        return {"seq": self.seq, "op": self.op, "tier": self.tier, "key": self.key}


class EventLog:
    """Thread-safe, bounded, numbered from 1; ``epoch`` changes with every process."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self._events: deque[Event] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def emit(self, op: str, tier: str, key: str) -> None:
        with self._lock:
            self.seq += 1
            self._events.append(Event(self.seq, op, tier, key))

    def since(self, epoch: str | None, seq: int | None) -> tuple[int, list[Event] | None]:
        """(the latest seq, the events after ``seq``) or (latest, None) when a snapshot is needed."""
        with self._lock:
            latest = self.seq
            if epoch != self.epoch or seq is None or seq > latest:
                return latest, None
            oldest = self._events[0].seq if self._events else latest + 1
            if seq + 1 < oldest:
                return latest, None
            return latest, [e for e in self._events if e.seq > seq]


class Costs:
    """Measured seconds per token: prefill (computing K/V) and reading each tier. Moving averages, None until
    measured; what the router's ``kv`` policy multiplies token counts by."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, name: str, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds < 0:
            return
        per_token = seconds / tokens
        with self._lock:
            old = self._values.get(name)
            self._values[name] = per_token if old is None else (1 - _ALPHA) * old + _ALPHA * per_token

    def get(self, name: str) -> float | None:
        with self._lock:
            return self._values.get(name)

    def to_dict(self) -> dict[str, float | None]:
        with self._lock:
            return {f"{name}_s_per_token": self._values.get(name) for name in ("prefill", "l1", "l2")}
