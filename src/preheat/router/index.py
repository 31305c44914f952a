"""What the router knows about each replica's KV cache. Pure data structures, thread-safe, no I/O.

``PrefixIndex`` (policy ``prefix``): the chunk keys this router *sent* to each replica, bounded per replica (least
recently routed keys go first) and aged out after ``ttl`` seconds, since a replica's cache forgets too.

``KVIndex`` (policy ``kv``): the chunk keys each replica *says* its tiers hold, rebuilt from the replicas' KV events
(docs/kv-events.md): a snapshot replaces what was known, events after it are applied in order.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from preheat.errors import RouterError

Clock = Callable[[], float]
TIERS = ("l1", "l2")


class PrefixIndex:
    """Per replica, the chunk keys of the prompts routed there, at most ``max_keys`` each, forgotten after ``ttl`` s.

    >>> index = PrefixIndex(max_keys=2)
    >>> index.record("a", ["k0", "k1", "k2"])  # the oldest key falls out of a full replica
    >>> index.match("a", ["k0", "k1"]), index.match("a", ["k1", "k2"])
    (0, 2)
    """

    def __init__(self, *, max_keys: int = 100_000, ttl: float = 600.0, clock: Clock = time.monotonic) -> None:
        if max_keys < 1 or ttl <= 0:
            raise RouterError(f"prefix index: max_keys ({max_keys}) and ttl ({ttl}) must be positive")
        self.max_keys, self.ttl, self._clock = max_keys, ttl, clock
        self._lock = threading.Lock()
        # key -> when it was last routed; insertion order = age, so the oldest entries are always at the front.
        self._keys: dict[str, OrderedDict[str, float]] = {}

    def record(self, replica: str, keys: Iterable[str]) -> None:
        """Remember that ``keys`` were just computed (so now cached) on ``replica``."""
        now = self._clock()
        with self._lock:
            held = self._keys.setdefault(replica, OrderedDict())
            for key in keys:
                held[key] = now
                held.move_to_end(key)
            self._trim(held, now)

    def match(self, replica: str, keys: Sequence[str]) -> int:
        """How many leading ``keys`` were routed to ``replica`` within ``ttl``."""
        horizon = self._clock() - self.ttl
        with self._lock:
            held = self._keys.get(replica)
            if not held:
                return 0
            count = 0
            for key in keys:
                seen = held.get(key)
                if seen is None or seen < horizon:
                    break
                count += 1
            return count

    def contains(self, replica: str, key: str) -> bool:
        """Whether ``key`` was routed to ``replica`` within ``ttl``."""
        return self.match(replica, [key]) == 1

    def size(self, replica: str) -> int:
        with self._lock:
            return len(self._keys.get(replica, ()))

    def forget(self, replica: str) -> None:
        """Drop everything known about ``replica`` (it restarted, or left)."""
        with self._lock:
            self._keys.pop(replica, None)

    def _trim(self, held: OrderedDict[str, float], now: float) -> None:
        while len(held) > self.max_keys:
            held.popitem(last=False)
        horizon = now - self.ttl
        while held:
            oldest = next(iter(held.values()))
            if oldest >= horizon:
                break
            held.popitem(last=False)


@dataclass(frozen=True)
class KVEvent:
    seq: int
    op: str  # "store" or "evict"
    tier: str  # "l1" or "l2"
    key: str


@dataclass(frozen=True)
class KVUpdate:
    """One answer of ``GET /v1/kv/events``, validated (docs/kv-events.md)."""

    epoch: str
    fingerprint: str
    chunk_tokens: int
    seq: int
    reset: bool
    l2_id: str | None
    l1: tuple[str, ...] = ()
    l2: tuple[str, ...] = ()
    events: tuple[KVEvent, ...] = ()
    costs: tuple[float | None, float | None, float | None] = (None, None, None)
    load: tuple[int, int] = (0, 0)  # (running, waiting)


def parse_update(payload: object, where: str) -> KVUpdate:
    """Validate a KV-events answer from the replica at ``where``; ``RouterError`` naming the bad field."""
    if not isinstance(payload, Mapping):
        raise RouterError(f"{where}/v1/kv/events: the answer is not a JSON object")

    def need(name: str, kind: type | tuple[type, ...]) -> object:
        value = payload.get(name)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise RouterError(f"{where}/v1/kv/events: field {name!r} is missing or not a {kind}")
        return value

    reset = bool(payload.get("reset", False))
    events: list[KVEvent] = []
    for raw in (payload.get("events") or ()) if not reset else ():
        if not isinstance(raw, Mapping) or raw.get("op") not in ("store", "evict") or raw.get("tier") not in TIERS:
            raise RouterError(f"{where}/v1/kv/events: malformed event {raw!r}")
        events.append(KVEvent(int(raw["seq"]), str(raw["op"]), str(raw["tier"]), str(raw["key"])))
    costs = payload.get("costs") or {}
    load = payload.get("load") or {}
    if not isinstance(costs, Mapping) or not isinstance(load, Mapping):
        raise RouterError(f"{where}/v1/kv/events: 'costs' and 'load' must be objects")
    l2_id = payload.get("l2_id")
    return KVUpdate(
        epoch=str(need("epoch", str)),
        fingerprint=str(need("fingerprint", str)),
        chunk_tokens=int(need("chunk_tokens", int)),  # type: ignore[call-overload]  # checked by need()
        seq=int(need("seq", int)),  # type: ignore[call-overload]  # checked by need()
        reset=reset,
        l2_id=str(l2_id) if l2_id else None,
        l1=tuple(str(k) for k in payload.get("l1") or ()) if reset else (),
        l2=tuple(str(k) for k in payload.get("l2") or ()) if reset else (),
        events=tuple(events),
        costs=(
            _seconds(costs.get("prefill_s_per_token")),
            _seconds(costs.get("l1_s_per_token")),
            _seconds(costs.get("l2_s_per_token")),
        ),
        load=(int(load.get("running") or 0), int(load.get("waiting") or 0)),
    )


def _seconds(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


@dataclass
class ReplicaCache:
    """What one replica's tiers hold, as of its last answer."""

    epoch: str
    fingerprint: str
    chunk_tokens: int
    seq: int
    l2_id: str | None
    l1: set[str] = field(default_factory=set)
    l2: set[str] = field(default_factory=set)
    costs: tuple[float | None, float | None, float | None] = (None, None, None)
    load: tuple[int, int] = (0, 0)


class KVIndex:
    """Per replica, the keys in each tier, from KV events; an L2 key counts for every replica with the same
    ``l2_id`` (they share the store).

    >>> index = KVIndex()
    >>> snap = dict(epoch="e1", fingerprint="f" * 32, chunk_tokens=4, seq=2, reset=True, l2_id="fs:///kv",
    ...             l1=["a"], l2=["b"])
    >>> index.apply("r1", parse_update(snap, "r1"))
    >>> index.apply("r2", parse_update({**snap, "l1": [], "l2": []}, "r2"))
    >>> sorted(index.l2_view("r2"))
    ['b']
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaCache] = {}

    def cursor(self, replica: str) -> tuple[str, int] | None:
        """``(epoch, seq)`` to send on the next poll, or None for a first poll (ask for a snapshot)."""
        with self._lock:
            state = self._replicas.get(replica)
            return None if state is None else (state.epoch, state.seq)

    def apply(self, replica: str, update: KVUpdate) -> None:
        """Fold one answer in: a snapshot replaces the replica's sets; events are applied in order, skipping any at
        or before the last ``seq`` applied. Events from another epoch without a snapshot drop the replica's state,
        so that the next poll asks for a snapshot."""
        with self._lock:
            state = self._replicas.get(replica)
            if update.reset or state is None:
                if not update.reset:
                    return  # events without a base: wait for the snapshot the next (cursor-less) poll gets
                state = ReplicaCache(
                    update.epoch, update.fingerprint, update.chunk_tokens, update.seq, update.l2_id,
                    set(update.l1), set(update.l2),
                )  # fmt: skip
                self._replicas[replica] = state
            elif update.epoch != state.epoch:
                del self._replicas[replica]
                return
            else:
                for event in update.events:
                    if event.seq <= state.seq:
                        continue
                    tier = state.l1 if event.tier == "l1" else state.l2
                    if event.op == "store":
                        tier.add(event.key)
                    else:
                        tier.discard(event.key)
                    state.seq = event.seq
                state.seq = max(state.seq, update.seq)
                if gone := [e.key for e in update.events if e.op == "evict" and e.tier == "l2"]:
                    self._evict_shared(replica, state.l2_id, gone)
            state.fingerprint, state.chunk_tokens, state.l2_id = update.fingerprint, update.chunk_tokens, update.l2_id
            state.costs, state.load = update.costs, update.load

    def _evict_shared(self, replica: str, l2_id: str | None, keys: list[str]) -> None:
        # An L2 key evicted from a shared store is gone for everyone, even if the others have not said so yet.
        if l2_id is None:
            return
        for name, other in self._replicas.items():
            if name != replica and other.l2_id == l2_id:
                other.l2.difference_update(keys)

    def state(self, replica: str) -> ReplicaCache | None:
        """The replica's cache as last reported (shared, do not modify), or None before its first snapshot."""
        with self._lock:
            return self._replicas.get(replica)

    def l2_view(self, replica: str) -> _Union:
        """The L2 keys ``replica`` can restore: its own, plus those of every replica sharing its L2."""
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return _Union(())
            if state.l2_id is None:
                return _Union((state.l2,))
            return _Union(tuple(s.l2 for s in self._replicas.values() if s.l2_id == state.l2_id))

    def all_costs(self) -> list[tuple[float | None, float | None, float | None]]:
        with self._lock:
            return [s.costs for s in self._replicas.values()]

    def forget(self, replica: str) -> None:
        with self._lock:
            self._replicas.pop(replica, None)

    def sizes(self) -> dict[str, tuple[int, int]]:
        """Per replica, how many keys its L1 and L2 hold (for ``/metrics``)."""
        with self._lock:
            return {name: (len(s.l1), len(s.l2)) for name, s in self._replicas.items()}


class _Union:
    """Membership in any of several sets, without copying them."""

    def __init__(self, sets: Sequence[set[str]]) -> None:
        self._sets = sets

    def __contains__(self, key: object) -> bool:
        return any(key in s for s in self._sets)

    def __iter__(self) -> Iterator[str]:  # for tests and doctests
        seen: set[str] = set()
        for s in self._sets:
            seen |= s
        return iter(seen)
