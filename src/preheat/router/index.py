"""What the router knows about each replica's KV cache. Pure data structures, thread-safe, no I/O.

``PrefixIndex`` (policy ``prefix``): the chunk keys this router *sent* to each replica, bounded per replica (least
recently routed keys go first) and aged out after ``ttl`` seconds, since a replica's cache forgets too.

``KVIndex`` (policy ``kv``): the chunk keys each replica *says* its tiers hold, rebuilt from the replicas' KV events
(docs/kv-events.md): a snapshot replaces what was known, events after it are applied in order. An L2 can lose keys
without any event (Redis expiry and eviction, files removed by hand), so a replica with an L2 is asked for a fresh
snapshot every ``snapshot_interval`` seconds; every tier is bounded to ``max_keys`` keys, the oldest stored first.

``InFlight`` (both): the keys of requests sent to a replica and not answered yet. A policy learns a request's keys
only once a replica answered it with a 2xx: a refused, failing or unauthenticated request teaches it nothing.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from preheat.core.errors import RouterError

Clock = Callable[[], float]
TIERS = ("l1", "l2")
# A chunk key is 32 hex digits (docs/kv-events.md); the index keeps up to --index-keys of them per replica and tier,
# so an answer with a longer one (or a longer epoch or l2_id) is refused whole rather than held.
MAX_KEY_CHARS = 64
MAX_NAME_CHARS = 1024
MAX_SLOTS = 1 << 16  # a replica's load.slots: sequences generated at once


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

    def match(self, replica: str, keys: Sequence[str], also: Callable[[str], bool] | None = None) -> int:
        """How many leading ``keys`` were routed to ``replica`` within ``ttl`` (or, with ``also``, pass it)."""
        horizon = self._clock() - self.ttl
        with self._lock:
            held: Mapping[str, float] = self._keys.get(replica) or {}
            count = 0
            for key in keys:
                seen = held.get(key)
                if (seen is None or seen < horizon) and not (also is not None and also(key)):
                    break
                count += 1
            return count

    def contains(self, replica: str, key: str) -> bool:
        """Whether ``key`` was routed to ``replica`` within ``ttl``."""
        return self.match(replica, [key]) == 1

    def size(self, replica: str) -> int:
        with self._lock:
            return len(self._keys.get(replica, ()))

    def sizes(self) -> dict[str, int]:
        """Per replica, how many keys are remembered (for ``/metrics``)."""
        with self._lock:
            return {name: len(held) for name, held in self._keys.items()}

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


class InFlight:
    """Per replica, the chunk keys of the requests sent there and not answered yet. A multiset (two requests in
    flight may share keys), bounded by the requests in flight: each takes its keys out when it is answered.

    >>> pending = InFlight()
    >>> pending.add("a", ["k0", "k1"]); pending.add("a", ["k0"]); pending.remove("a", ["k0", "k1"])
    >>> pending.contains("a", "k0"), pending.contains("a", "k1")
    (True, False)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, Counter[str]] = {}

    def add(self, replica: str, keys: Iterable[str]) -> None:
        with self._lock:
            self._keys.setdefault(replica, Counter()).update(keys)

    def remove(self, replica: str, keys: Iterable[str]) -> None:
        with self._lock:
            held = self._keys.get(replica)
            if held is None:
                return
            held.subtract(keys)
            for key in [k for k, n in held.items() if n <= 0]:
                del held[key]
            if not held:
                del self._keys[replica]

    def contains(self, replica: str, key: str) -> bool:
        with self._lock:
            held = self._keys.get(replica)
            return held is not None and key in held

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {name: len(held) for name, held in self._keys.items()}


class KeySet:
    """A set of at most ``limit`` keys that remembers the order they were stored in: storing a key again makes it
    the newest, and past the limit the oldest go first (the ones the replica's tier is likeliest to have dropped).

    >>> keys = KeySet(2, ["a", "b"]); keys.add("c")
    >>> sorted(keys)
    ['b', 'c']
    """

    __slots__ = ("_keys", "limit")

    def __init__(self, limit: int, oldest_first: Iterable[str] = ()) -> None:
        self.limit = limit
        self._keys: dict[str, None] = {}  # insertion-ordered: the oldest first
        for key in oldest_first:
            self.add(key)

    def add(self, key: str) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        if len(self._keys) > self.limit:
            del self._keys[next(iter(self._keys))]

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)


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
    slots: int | None = None  # sequences the replica generates at once, when it says


def parse_update(payload: object, where: str) -> KVUpdate:
    """Validate a KV-events answer from the replica at ``where``; ``RouterError`` naming the bad field.

    Whatever a replica sends is either this or that error (tests/integration/router/test_fuzz_kv_events.py): keys are
    strings, sequence numbers and loads non-negative integers, ``chunk_tokens`` positive and the fingerprint 32 hex
    digits, since the router computes every request's chunk keys from those two and a bad one would fail requests,
    not this answer.
    """
    what = f"{where}/v1/kv/events"
    if not isinstance(payload, Mapping):
        raise RouterError(f"{what}: the answer is not a JSON object")

    def need(name: str, kind: type | tuple[type, ...]) -> object:
        value = payload.get(name)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise RouterError(f"{what}: field {name!r} is missing or not a {kind}")
        return value

    def number(value: object, name: str, low: int, high: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"from {low} to {high}"
            raise RouterError(f"{what}: {name} must be an integer {bounds}, got {_brief(value)}")
        return value

    def keys(name: str) -> tuple[str, ...]:
        value = payload.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(_is_key(k) for k in value):
            raise RouterError(
                f"{what}: {name!r} must be a list of keys (strings of {MAX_KEY_CHARS} characters at most)"
            )
        return tuple(value)

    fingerprint = str(need("fingerprint", str))
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise RouterError(f"{what}: fingerprint {_brief(fingerprint)} is not 32 hex digits")
    reset = bool(payload.get("reset", False))
    raw_events = payload.get("events") if not reset else None
    if raw_events is not None and not isinstance(raw_events, list):
        raise RouterError(f"{what}: 'events' must be a list")
    events: list[KVEvent] = []
    for raw in raw_events or ():
        if (
            not isinstance(raw, Mapping)
            or raw.get("op") not in ("store", "evict")
            or raw.get("tier") not in TIERS
            or not _is_key(raw.get("key"))
        ):
            raise RouterError(f"{what}: malformed event {_brief(raw)}")
        seq = number(raw.get("seq"), "an event's seq", 0)
        events.append(KVEvent(seq, str(raw["op"]), str(raw["tier"]), str(raw["key"])))
    costs = payload.get("costs") or {}
    load = payload.get("load") or {}
    if not isinstance(costs, Mapping) or not isinstance(load, Mapping):
        raise RouterError(f"{what}: 'costs' and 'load' must be objects")
    l2_id = payload.get("l2_id")
    if l2_id is not None and not isinstance(l2_id, str):
        raise RouterError(f"{what}: 'l2_id' must be a string or null")
    _check_lengths(what, payload)
    return KVUpdate(
        epoch=str(need("epoch", str)),
        fingerprint=fingerprint,
        chunk_tokens=number(payload.get("chunk_tokens"), "chunk_tokens", 1),
        seq=number(payload.get("seq"), "seq", 0),
        reset=reset,
        l2_id=l2_id or None,
        l1=keys("l1") if reset else (),
        l2=keys("l2") if reset else (),
        events=tuple(events),
        costs=(
            _seconds(costs.get("prefill_s_per_token")),
            _seconds(costs.get("l1_s_per_token")),
            _seconds(costs.get("l2_s_per_token")),
        ),
        load=(number(load.get("running") or 0, "load.running", 0), number(load.get("waiting") or 0, "load.waiting", 0)),
        slots=None if load.get("slots") is None else number(load.get("slots"), "load.slots", 1, MAX_SLOTS),
    )


_FINGERPRINT = re.compile(r"[0-9a-fA-F]{32}")


def _is_key(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_KEY_CHARS


def _check_lengths(what: str, payload: Mapping[str, object]) -> None:
    """``RouterError`` for an ``epoch`` or ``l2_id`` longer than any replica writes (the index keeps them)."""
    for name in ("epoch", "l2_id"):
        text = payload.get(name)
        if isinstance(text, str) and len(text) > MAX_NAME_CHARS:
            raise RouterError(f"{what}: {name!r} is over {MAX_NAME_CHARS} characters")


def _brief(value: object) -> str:
    """``repr(value)``, cut short for a log line (a replica's answer can be megabytes)."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return seconds if 0 < seconds < math.inf else None  # JSON's 1e999 is inf


@dataclass
class ReplicaCache:
    """What one replica's tiers hold, as of its last answer."""

    epoch: str
    fingerprint: str
    chunk_tokens: int
    seq: int
    l2_id: str | None
    l1: KeySet
    l2: KeySet
    snapshot_at: float  # when its last snapshot was applied (index clock)
    costs: tuple[float | None, float | None, float | None] = (None, None, None)
    load: tuple[int, int] = (0, 0)
    slots: int | None = None
    # How many of this router's requests had finished on the replica when the answer was asked for: the ones that
    # finish later are still in ``load``, though over (see ``KVAware.estimate``).
    finished: int = 0
    # Keys already in the accelerator's own cache: an engine replica's GPU medium (engine_index.py); preheat
    # replicas publish L1 and L2 only, so theirs stays empty.
    gpu: KeySet = field(default_factory=lambda: KeySet(1))


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

    def __init__(
        self, *, max_keys: int = 100_000, snapshot_interval: float = 60.0, clock: Clock = time.monotonic
    ) -> None:
        if max_keys < 1 or snapshot_interval <= 0:
            raise RouterError(
                f"KV index: max_keys ({max_keys}) and snapshot_interval ({snapshot_interval}) must be positive"
            )
        self.max_keys, self.snapshot_interval, self._clock = max_keys, snapshot_interval, clock
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaCache] = {}

    def cursor(self, replica: str) -> tuple[str, int] | None:
        """``(epoch, seq)`` to send on the next poll, or None to ask for a snapshot: on the first poll, and every
        ``snapshot_interval`` seconds for a replica with an L2, which can lose keys without saying so."""
        with self._lock:
            state = self._replicas.get(replica)
            if state is None:
                return None
            if state.l2_id is not None and self._clock() - state.snapshot_at >= self.snapshot_interval:
                return None
            return state.epoch, state.seq

    def apply(self, replica: str, update: KVUpdate, *, finished: int = 0) -> None:
        """Fold one answer in: a snapshot replaces the replica's sets; events are applied in order, skipping any at
        or before the last ``seq`` applied. Events from another epoch without a snapshot drop the replica's state,
        so that the next poll asks for a snapshot. ``finished``: how many of this router's requests had finished on
        the replica when the answer was asked for."""
        with self._lock:
            state = self._replicas.get(replica)
            if update.reset or state is None:
                if not update.reset:
                    return  # events without a base: wait for the snapshot the next (cursor-less) poll gets
                # A snapshot lists each tier newest first; past the bound, the oldest are the ones left out.
                state = ReplicaCache(
                    update.epoch, update.fingerprint, update.chunk_tokens, update.seq, update.l2_id,
                    KeySet(self.max_keys, reversed(update.l1[: self.max_keys])),
                    KeySet(self.max_keys, reversed(update.l2[: self.max_keys])),
                    snapshot_at=self._clock(),
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
            state.costs, state.load, state.finished = update.costs, update.load, finished
            state.slots = update.slots

    def _evict_shared(self, replica: str, l2_id: str | None, keys: list[str]) -> None:
        # An L2 key evicted from a shared store is gone for everyone, even if the others have not said so yet.
        if l2_id is None:
            return
        for name, other in self._replicas.items():
            if name != replica and other.l2_id == l2_id:
                for key in keys:
                    other.l2.discard(key)

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

    def edit(self, replica: str, change: Callable[[], ReplicaCache | None]) -> None:
        """Run ``change`` under the index's lock and make what it returns ``replica``'s cache (None: nothing known).

        For replicas whose state the router builds itself from an engine's event stream (zmq_events.py): the
        ``change`` mutates that state's key sets, which routing threads read under the same lock."""
        with self._lock:
            cache = change()
            if cache is None:
                self._replicas.pop(replica, None)
            else:
                self._replicas[replica] = cache

    def sizes(self) -> dict[str, tuple[int, int]]:
        """Per replica, how many keys its L1 and L2 hold (for ``/metrics``)."""
        with self._lock:
            return {name: (len(s.l1), len(s.l2)) for name, s in self._replicas.items()}

    def loads(self) -> dict[str, tuple[int, int]]:
        """Per replica, ``(running, waiting)`` as its last answer said (for ``/metrics``)."""
        with self._lock:
            return {name: s.load for name, s in self._replicas.items()}

    def gpu_sizes(self) -> dict[str, int]:
        """Per engine replica, how many keys its GPU medium holds (for ``/metrics``)."""
        with self._lock:
            return {name: len(s.gpu) for name, s in self._replicas.items() if len(s.gpu)}


class _Union:
    """Membership in any of several sets, without copying them."""

    def __init__(self, sets: Sequence[Collection[str]]) -> None:
        self._sets = sets

    def __contains__(self, key: object) -> bool:
        return any(key in s for s in self._sets)

    def __iter__(self) -> Iterator[str]:  # for tests and doctests
        seen: set[str] = set()
        for s in self._sets:
            seen.update(s)
        return iter(seen)
