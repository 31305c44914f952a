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

The replica is chosen when a request comes, on estimates; the hold corrects them when a replica is idle. A replica
whose own line is empty and has a sequence free takes the held request elsewhere that gains most by moving: the one
that would wait longest at its own (the work held ahead of it there, and queued there beyond its slots) if that and
its own cost there come to more than its cost on the idle one (a spike's hits at one replica go on to recompute on
the other once the line is longer than the recompute). It looks when it falls idle (one of its requests is over),
and a replica idle already looks when a request is held elsewhere (``enter``'s ``idle``): a spike that comes while
the other replica has nothing to do is not left in one line until something else ends there. Work stealing, as a
thread pool's idle workers do; the router then counts the request at its new replica (``Pass.replica``). ``steal``
False: a held request stays where it was routed.

Event loop only (the data path, aioproxy.py): nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger("preheat.router")

MIN_COST = 1e-3  # seconds: a request priced at nothing (a whole hit) still has a finite ratio


@dataclass(eq=False)
class _Held:
    price: Callable[[], float]  # its cost now: what it would hit may have changed since it came
    price_at: Callable[[str], float | None] | None  # its cost at another replica; None: it cannot go there
    since: float
    admitted: asyncio.Future[str]  # the replica it is let through to

    def cost(self) -> float:
        return max(self.price(), MIN_COST)

    def ratio(self, now: float, cost: float | None = None) -> float:
        cost = self.cost() if cost is None else cost
        return (now - self.since + cost) / cost


@dataclass(eq=False)
class _Line:
    """One replica's: its requests sent through the line and not over, and those held."""

    slots: int = 1
    sent: int = 0
    held: list[_Held] = field(default_factory=list)


class Pass:
    """A request let through to ``replica`` (the one it was held for, or an idle one that took it); ``leave`` once
    it is over there (idempotent)."""

    def __init__(self, holds: Holds | None, replica: str, held_seconds: float) -> None:
        self._holds, self.replica, self.held_seconds = holds, replica, held_seconds
        self._over = holds is None

    def leave(self) -> None:
        if not self._over and self._holds is not None:
            self._over = True
            self._holds.leave(self.replica)


NOT_HELD = Pass(None, "", 0.0)  # a request no line counts (not a generation, or a policy that holds nothing)


class Holds:
    """Per replica, the requests this router holds for it (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, steal: bool = True) -> None:
        self._lines: dict[str, _Line] = {}
        self._clock = clock
        self.steal = steal

    async def enter(
        self,
        replica: str,
        slots: int,
        price: Callable[[], float],
        *,
        price_at: Callable[[str], float | None] | None = None,
        idle: Callable[[], Iterable[tuple[str, int]]] | None = None,
        gone: asyncio.Future[None] | None = None,
    ) -> Pass:
        """Wait until ``replica`` has room for one more of this router's requests (at most ``slots + 1`` there),
        then count this one there; or until another replica falls idle and takes it (``Pass.replica``). ``price``:
        its seconds of service there, which order the waiting; asked only while it waits, each time the next one is
        chosen (a prefix computed meanwhile makes it cheaper), so a request let through at once is never priced.
        ``price_at``: the same at another replica (None: it cannot go there); without it, it is never moved.
        ``idle``: the other replicas it could go to, with their slots, asked when it is held: one with nothing of
        this router's there takes a held request at once if one gains by it (``_take``). ``gone``: done when the
        client goes away, which ends the wait (``ConnectionResetError``) and frees its place."""
        line = self._lines.setdefault(replica, _Line())
        line.slots = slots
        if not line.held and line.sent < slots + 1:
            line.sent += 1
            return Pass(self, replica, 0.0)
        entry = _Held(price, price_at, self._clock(), asyncio.get_running_loop().create_future())
        line.held.append(entry)
        if self.steal and idle is not None and price_at is not None:
            self._wake_idle(replica, idle)
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
                self.leave(entry.admitted.result())
            raise
        return Pass(self, entry.admitted.result(), self._clock() - entry.since)

    def leave(self, replica: str) -> None:
        """One of this router's requests at ``replica`` is over: let the held ones through while there is room,
        and when none is held for it and it has a sequence free, take one held elsewhere that gains by moving."""
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
            best.admitted.set_result(replica)
        if self.steal:
            self._fill(replica, line, now)
        if not line.sent and not line.held:
            del self._lines[replica]

    def _fill(self, idle: str, line: _Line, now: float) -> None:
        """While ``idle`` has nothing held for it and a sequence free, it takes the held request elsewhere that
        gains most by moving (``_take``)."""
        try:
            while not line.held and line.sent < line.slots and self._take(idle, line, now):
                pass
        except Exception:  # a price that failed: nothing more moves, and what called this goes on
            log.exception("work stealing for %s failed; nothing moved", idle)

    def _wake_idle(self, busy: str, idle: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """A request was just held for ``busy``: each other replica with nothing of this router's there (no line)
        takes the held requests that gain by moving, as one that falls idle would (``leave``)."""
        now = self._clock()
        try:
            others = list(idle())
        except Exception:  # nothing moves, and the request stays held where it was
            log.exception("listing the idle replicas failed; nothing moved")
            return
        for name, slots in others:
            if name == busy or name in self._lines:
                continue
            line = self._lines[name] = _Line(slots=slots)  # counted there as soon as one is let through
            self._fill(name, line, now)
            if not line.sent:
                del self._lines[name]

    def _take(self, idle: str, line: _Line, now: float) -> bool:
        """Move to ``idle`` (a sequence free there, nothing held for it) the held request that gains most by it:
        per other line, the one that would go last there, whose wait is the work held ahead of it and queued there
        beyond the replica's slots (the held ones' mean each). False when none would gain."""
        best: tuple[float, str, _Held] | None = None
        for name, home in self._lines.items():
            waiting = [h for h in home.held if not h.admitted.done() and h.price_at is not None]
            if name == idle or not waiting:
                continue
            costs = {h: h.cost() for h in home.held}
            # The last of equal ratios: leave() lets the first of them through first.
            last = min(reversed(waiting), key=lambda h: h.ratio(now, costs[h]))
            there = last.price_at(idle) if last.price_at is not None else None
            if there is None:
                continue
            mean = sum(costs.values()) / len(costs)
            stay = sum(costs.values()) + max(home.sent - home.slots, 0) * mean
            gain = stay - max(there, MIN_COST)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, name, last)
        if best is None:
            return False
        _, source, chosen = best
        home = self._lines[source]
        home.held.remove(chosen)
        if not home.sent and not home.held:
            del self._lines[source]
        line.sent += 1
        chosen.admitted.set_result(idle)
        return True

    def held(self) -> dict[str, int]:
        """Per replica, the requests held now (``/metrics``)."""
        # A copy first: /metrics may be read on another thread while the loop changes the lines.
        return {name: len(line.held) for name, line in list(self._lines.items()) if line.held}
