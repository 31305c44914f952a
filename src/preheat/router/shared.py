"""Several routers, one view: what the routers of a fleet tell each other, and how one folds in what it hears.
Pure (values in, values out, thread-safe); the Redis transport is ``router/shared_redis.py``.

What a router learns from the replicas' own event streams (their KV events, docs/kv-events.md, and engines' ZMQ
events) stays its own: every router polls or subscribes independently, and the same events give the same index (a
router that starts late asks for a snapshot, or replays). What no replica says is shared here, one ``Update`` per
router and tick:

- ``learn``: the chunk keys of prompts a replica answered through this router (``Policy.answered``): ``prefix``'s
  index and ``kv``'s recent keys; the others ``learn`` them as if they had routed the request;
- ``load``: requests in flight through this router, per replica: the others add them to their own in-flight counts,
  so that least-load and the load guard see the fleet's queues, not one router's share;
- ``down``: replicas this router just took out of rotation: the others check them at once (a hint, never a verdict:
  a router only ejects a replica its own check finds down, so a wrong or hostile entry cannot empty a fleet);
- ``decisions``: this router's decision counts (``/metrics``: per router and fleet-wide).

Everything read back is outside input (docs/security.md): bounded in size and count, key and name formats checked,
replicas this router does not know ignored; a bad entry is skipped and counted (``ignored``), never an error.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from preheat.core.jsonsafe import loads_bounded
from preheat.router.policies import Candidate, Decision, Policy, RouteRequest

Clock = Callable[[], float]
FORMAT = "1"
MAX_ENTRY_BYTES = 1024 * 1024  # one update: at most MAX_ENTRY_KEYS keys of 32 hex digits, and small fields
MAX_ENTRY_KEYS = 10_000
MAX_PEERS = 64  # routers heard from at once; entries from more are ignored
MAX_LOAD = 1_000_000  # requests in flight through one router to one replica, at most
MAX_REASONS = 32
PEER_TTL = 10.0  # seconds after its last update that a router's load stops counting (it stopped, or lost Redis)
_KEY = re.compile(r"[0-9a-f]{32}")
_ROUTER_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
_REASON = re.compile(r"[a-z_]{1,32}")
HIT_REASONS = frozenset(("prefix_match", "kv_hit"))  # decisions that followed a cache


@dataclass(frozen=True)
class Update:
    """One router's news: see the module's docstring. ``fingerprint``: its prefix keys' seed (keys learnt under
    another seed name other chunks, so they are ignored)."""

    router: str
    fingerprint: str | None = None
    learn: tuple[tuple[str, tuple[str, ...]], ...] = ()
    load: Mapping[str, int] = field(default_factory=dict)
    down: tuple[str, ...] = ()
    decisions: Mapping[str, float] = field(default_factory=dict)

    def encode(self) -> dict[bytes, bytes]:
        """The fields of its Redis stream entry."""
        body = {
            "fp": self.fingerprint,
            "learn": [[replica, list(keys)] for replica, keys in self.learn],
            "load": dict(self.load),
            "down": list(self.down),
            "decisions": dict(self.decisions),
        }
        return {
            b"v": FORMAT.encode(),
            b"r": self.router.encode(),
            b"d": json.dumps(body, separators=(",", ":")).encode(),
        }


def decode(fields: Mapping[bytes, bytes], known: Collection[str]) -> tuple[Update | None, list[str]]:
    """The ``Update`` in a stream entry's ``fields``, and why any of its parts were left out (``unknown_replica``,
    ``bad_key``...); None, and why, when the entry as a whole is not one. ``known``: the replica URLs this router
    has (others are another fleet's, or made up).

    >>> u = Update("a", "0" * 32, learn=(("http://r:1", ("f" * 32,)),), load={"http://r:1": 2, "http://x:9": 1})
    >>> got, skipped = decode(u.encode(), {"http://r:1"})
    >>> got.learn, dict(got.load), skipped
    ((('http://r:1', ('ffffffffffffffffffffffffffffffff',)),), {'http://r:1': 2}, ['unknown_replica'])
    >>> decode({b"v": b"1", b"r": b"a b"}, ())
    (None, ['router_id'])
    """
    if fields.get(b"v") != FORMAT.encode():
        return None, ["format"]
    router = fields.get(b"r", b"").decode("utf-8", "replace")
    if not _ROUTER_ID.fullmatch(router):
        return None, ["router_id"]
    try:
        body = loads_bounded(fields.get(b"d", b""), max_bytes=MAX_ENTRY_BYTES, max_containers=4 * MAX_ENTRY_KEYS)
    except ValueError:  # a JSONInputError: not JSON, too long, too deep, too many containers
        return None, ["not_json"]
    if not isinstance(body, dict):
        return None, ["not_json"]
    fingerprint = body.get("fp")
    if fingerprint is not None and not (isinstance(fingerprint, str) and _KEY.fullmatch(fingerprint)):
        return None, ["fingerprint"]
    skipped: list[str] = []
    learn = _learn(body.get("learn"), known, skipped)
    load: dict[str, int] = {}
    for replica, n in _dict(body.get("load")).items():
        if replica not in known:
            skipped.append("unknown_replica")
        elif not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOAD:
            skipped.append("bad_load")
        else:
            load[replica] = n
    down = tuple(r for r in _list(body.get("down")) if isinstance(r, str) and r in known)
    decisions: dict[str, float] = {}
    for reason, n in list(_dict(body.get("decisions")).items())[:MAX_REASONS]:
        if _REASON.fullmatch(reason) and isinstance(n, (int, float)) and not isinstance(n, bool) and 0 <= n < 1e15:
            decisions[reason] = float(n)
        else:
            skipped.append("bad_decision")
    return Update(router, fingerprint, learn, load, down, decisions), sorted(set(skipped))


def _learn(value: object, known: Collection[str], skipped: list[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``[[replica, [key...]]...]``: well-formed keys of known replicas, at most ``MAX_ENTRY_KEYS`` in all."""
    learn: list[tuple[str, tuple[str, ...]]] = []
    count = 0
    for item in _list(value):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
            skipped.append("malformed")
            continue
        replica, keys = item
        if not isinstance(replica, str) or replica not in known:
            skipped.append("unknown_replica")
            continue
        good = tuple(k for k in keys if isinstance(k, str) and _KEY.fullmatch(k))
        if len(good) != len(keys):
            skipped.append("bad_key")
        count += len(good)
        if count > MAX_ENTRY_KEYS:
            skipped.append("too_many_keys")
            break
        learn.append((str(replica), good))
    return tuple(learn)


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _dict(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


@dataclass
class Peer:
    """What one other router said last: its load counts until ``expires`` (index clock)."""

    load: Mapping[str, int]
    decisions: Mapping[str, float]
    expires: float
    heard: float  # when its last update was published (seconds on the shared clock)


class SharedView:
    """The other routers as this one last heard them, and how fresh that is.

    ``synced(at)``: the transport read every update published before ``at`` (it reached the stream's end); the
    staleness is how long ago that was, so it grows while Redis is unreachable or the transport lags behind.

    >>> view = SharedView("me", clock=lambda: 100.0)
    >>> view.heard(Update("b", load={"r": 2}), age=0.0, now_shared=50.0)
    True
    >>> view.remote_in_flight(), view.staleness()
    ({'r': 2}, None)
    """

    def __init__(self, router: str, *, peer_ttl: float = PEER_TTL, clock: Clock = time.monotonic) -> None:
        self.router, self.peer_ttl, self._clock = router, peer_ttl, clock
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._synced: float | None = None
        self.up = False

    def heard(self, update: Update, *, age: float, now_shared: float) -> bool:
        """Fold ``update`` (published ``age`` seconds ago) in; False when it came from too many routers."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            if update.router not in self._peers and len(self._peers) >= MAX_PEERS:
                return False
            self._peers[update.router] = Peer(
                update.load, update.decisions, now + max(self.peer_ttl - age, 0.0), now_shared - age
            )
            return True

    def synced(self, at: float | None = None) -> None:
        with self._lock:
            self._synced = self._clock() if at is None else at

    def staleness(self) -> float | None:
        """Seconds since the view last held every update published (None: never synced)."""
        with self._lock:
            return None if self._synced is None else max(self._clock() - self._synced, 0.0)

    def remote_in_flight(self) -> dict[str, int]:
        """Per replica, the requests in flight through the other routers (those heard from lately)."""
        now = self._clock()
        total: dict[str, int] = {}
        with self._lock:
            for peer in self._peers.values():
                if peer.expires > now:
                    for replica, n in peer.load.items():
                        total[replica] = total.get(replica, 0) + n
        return total

    def peers(self, now_shared: float) -> dict[str, float]:
        """Per router heard from lately, seconds since its last update (shared clock)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            return {name: max(now_shared - p.heard, 0.0) for name, p in self._peers.items() if p.expires > now}

    def decisions(self) -> dict[str, Mapping[str, float]]:
        """Per router heard from lately, its decision counts (by reason) as it last said them."""
        now = self._clock()
        with self._lock:
            return {name: p.decisions for name, p in self._peers.items() if p.expires > now}

    def _expire(self, now: float) -> None:
        # A router gone for a while is forgotten whole (its series leave /metrics); its load stopped at ``expires``.
        for name in [n for n, p in self._peers.items() if p.expires + 6 * self.peer_ttl < now]:
            del self._peers[name]


def hit_ratio(decisions: Mapping[str, float]) -> float | None:
    """The share of decisions that followed a cache (``prefix_match``, ``kv_hit``); None before any decision.

    >>> hit_ratio({"prefix_match": 3, "no_match": 1, "load_guard": 0})
    0.75
    """
    total = sum(decisions.values())
    if total <= 0 or not math.isfinite(total):
        return None
    return sum(n for reason, n in decisions.items() if reason in HIT_REASONS) / total


class SharedPolicy(Policy):
    """``inner`` with the fleet's view: its candidates carry every router's requests in flight, and each prompt
    a replica answered is handed to ``learnt`` (to be published) besides being learnt here. Remote keys come in
    through ``learn_remote``, which never publishes them again.

    Everything else is ``inner``'s: it keeps its own indexes, and ``Router`` calls this as it calls any policy.
    """

    def __init__(
        self, inner: Policy, remote_in_flight: Callable[[], Mapping[str, int]], learnt: Callable[[str, list[str]], None]
    ) -> None:
        super().__init__()
        self.inner, self._remote, self._learnt = inner, remote_in_flight, learnt
        self.name, self.needs_tokens, self.needs_text = inner.name, inner.needs_tokens, inner.needs_text
        self.in_flight = inner.in_flight

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        remote = self._remote()
        if remote:
            candidates = [replace(c, in_flight=c.in_flight + remote.get(c.name, 0)) for c in candidates]
        return self.inner.choose(request, candidates)

    def keys_for(self, request: RouteRequest, replica: str) -> list[str]:
        return self.inner.keys_for(request, replica)

    def hold_slots(self, request: RouteRequest, replica: str) -> int | None:
        return self.inner.hold_slots(request, replica)

    def hold_cost(self, request: RouteRequest, candidate: Candidate) -> float:
        return self.inner.hold_cost(request, candidate)

    def sent(self, request: RouteRequest, replica: str) -> None:
        self.inner.sent(request, replica)

    def answered(self, request: RouteRequest, replica: str, ok: bool) -> None:
        keys = list(request.in_flight_keys)  # what inner.answered learns (and clears)
        self.inner.answered(request, replica, ok)
        if ok and keys:
            self._learnt(replica, keys)

    def learn(self, replica: str, keys: list[str]) -> None:
        self.inner.learn(replica, keys)

    def learn_remote(self, replica: str, keys: list[str]) -> None:
        """Keys another router's replica answered: learnt as if this router had routed the request."""
        self.inner.learn(replica, keys)

    def forget(self, replica: str) -> None:
        self.inner.forget(replica)

    def index_sizes(self) -> dict[tuple[str, str], int]:
        return self.inner.index_sizes()

    def reported_loads(self) -> dict[str, tuple[int, int]]:
        return self.inner.reported_loads()
