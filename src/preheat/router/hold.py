"""Requests held at the router for a replica that generates few sequences at once, sent the cheapest first.

A preheat replica generates one sequence at a time (its KV events' ``load.slots``): a request sent while it is busy
waits in its queue, first come first served, however short it is. ``kv`` knows what each request will cost there
(its estimate's service: restores and recompute, and the answer), so it sends a replica at most ``slots + 1`` of
its requests (the one more keeps the replica from idling between two) and keeps the rest here. When one there is
over, the held one with the highest response ratio goes next: ``(waited + cost) / cost``. Short requests (a
follow-up whose context the replica holds) pass long ones (a new user's whole recompute), which lowers the mean wait
as shortest-job-first does, and a long one's ratio grows as it waits, so none is passed forever (HRRN, Brinch
Hansen 1971). A follow-up sent soon after its context was computed also finds it still in L1, instead of behind new
users whose recomputes evict it.

The cost is priced without the keys of requests still in flight: a request that would hit only once an earlier one
computed its prefix must not pass that one (it would recompute the prefix itself). It is priced again each time the
next one is chosen: once that earlier one has answered, its prefix is held there and the waiting ones are hits.

Event loop only (the data path, aioproxy.py): nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MIN_COST = 1e-3  # seconds: a request priced at nothing (a whole hit) still has a finite ratio


@dataclass(eq=False)
class _Held:
    price: Callable[[], float]  # its cost now: what it would hit may have changed since it came
    since: float
    admitted: asyncio.Future[None]

    def ratio(self, now: float) -> float:
        cost = max(self.price(), MIN_COST)
        return (now - self.since + cost) / cost


@dataclass(eq=False)
class _Line:
    """One replica's: its requests sent through the line and not over, and those held."""

    slots: int = 1
    sent: int = 0
    held: list[_Held] = field(default_factory=list)


class Pass:
    """A request let through to its replica; ``leave`` once it is over there (idempotent)."""

    def __init__(self, holds: Holds | None, replica: str, held_seconds: float) -> None:
        self._holds, self._replica, self.held_seconds = holds, replica, held_seconds
        self._over = holds is None

    def leave(self) -> None:
        if not self._over and self._holds is not None:
            self._over = True
            self._holds.leave(self._replica)


NOT_HELD = Pass(None, "", 0.0)  # a request no line counts (not a generation, or a policy that holds nothing)


class Holds:
    """Per replica, the requests this router holds for it (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lines: dict[str, _Line] = {}
        self._clock = clock

    async def enter(
        self, replica: str, slots: int, price: Callable[[], float], *, gone: asyncio.Future[None] | None = None
    ) -> Pass:
        """Wait until ``replica`` has room for one more of this router's requests (at most ``slots + 1`` there),
        then count this one there. ``price``: its seconds of service there, which order the waiting; asked only
        while it waits, each time the next one is chosen (a prefix computed meanwhile makes it cheaper), so a
        request let through at once is never priced. ``gone``: done when the client goes away, which ends the wait
        (``ConnectionResetError``) and frees its place."""
        line = self._lines.setdefault(replica, _Line())
        line.slots = slots
        if not line.held and line.sent < slots + 1:
            line.sent += 1
            return Pass(self, replica, 0.0)
        entry = _Held(price, self._clock(), asyncio.get_running_loop().create_future())
        line.held.append(entry)
        try:
            if gone is None:
                await entry.admitted
            else:
                await asyncio.wait((entry.admitted, gone), return_when=asyncio.FIRST_COMPLETED)
                if not entry.admitted.done():
                    raise ConnectionResetError("the client went away while its request was held")
        except BaseException:  # gone or cancelled while held, or just as it was let through: its place is freed
            if entry in line.held:
                line.held.remove(entry)
            elif entry.admitted.done() and not entry.admitted.cancelled():
                self.leave(replica)
            raise
        return Pass(self, replica, self._clock() - entry.since)

    def leave(self, replica: str) -> None:
        """One of this router's requests at ``replica`` is over: let the held ones through while there is room."""
        line = self._lines.get(replica)
        if line is None:
            return
        line.sent = max(line.sent - 1, 0)
        now = self._clock()
        while line.held and line.sent < line.slots + 1:
            best = max(line.held, key=lambda h: h.ratio(now))
            line.held.remove(best)
            if best.admitted.done():  # cancelled: its task removes nothing more
                continue
            line.sent += 1
            best.admitted.set_result(None)
        if not line.sent and not line.held:
            del self._lines[replica]

    def held(self) -> dict[str, int]:
        """Per replica, the requests held now (``/metrics``)."""
        # A copy first: /metrics may be read on another thread while the loop changes the lines.
        return {name: len(line.held) for name, line in list(self._lines.items()) if line.held}
