"""``--shared-state redis://...``: the routers of one fleet exchange ``Update``s (router/shared.py) through one Redis
stream, ``preheat:router:<fleet>:updates``, off the request path.

Two threads per router: the writer adds one entry per tick (``TICK`` seconds) when there is news (keys learnt,
load changed, a replica ejected) and a heartbeat every ``HEARTBEAT`` seconds; the reader blocks on the stream and
folds what the others wrote into this router's view. A request never waits on Redis: ``Policy.answered`` only
queues its keys (bounded; past the bound they are dropped and counted).

A router that starts (or restarts) reads the stream from its start: at most ``MAXLEN`` entries, the newest, whose
keys are still younger than the index's ttl, so it catches up with what the others learnt lately. Stream IDs are
Redis's clock: an entry's age is measured on that clock, not on whichever host wrote it.

An unreachable Redis degrades to this router's private view: the others' load expires after ``PEER_TTL`` seconds,
what was learnt stays learnt, a warning is logged once per outage, ``preheat_router_shared_up`` reads 0 and the
staleness grows; nothing reaches clients. Both threads retry with backoff and carry on from where they were.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from preheat.core.backoff import Backoff
from preheat.dashboard.state import FleetRouter, FleetView
from preheat.http.metrics import Counter, Gauge, Samples, Series
from preheat.router.shared import (
    MAX_ENTRY_KEYS,
    SharedPolicy,
    SharedView,
    Update,
    decode,
    hit_ratio,
)
from preheat.router.upstream import Replica

log = logging.getLogger("preheat.router")
TICK = 0.1  # seconds between the writer's looks at what to publish
HEARTBEAT = 1.0  # an entry at least this often, so that the others know this router is there (and its load)
BLOCK_MS = 250  # the reader's blocking read; each return (with entries or none) is a sync
PAGE = 200  # entries per read: a backlog (a late start) is read in pages, never at once
MAXLEN = 10_000  # entries the stream keeps (approximately: Redis trims whole nodes)
MAX_PENDING_KEYS = 200_000  # learnt keys waiting to be published; more are dropped (and counted) while Redis is away
TIMEOUT = 2.0  # seconds a Redis command may take
STALENESS_BOUND = 2.0  # what the docs promise while Redis answers: a reader that returns at least this often
RETRY = Backoff(first=0.25, cap=5.0)


def default_router_id() -> str:
    """``host-pid``: unique among the routers of a fleet, and readable in ``/metrics`` labels."""
    return f"{socket.gethostname()[:64]}-{os.getpid()}"


def stream_key(fleet: str) -> str:
    return f"preheat:router:{fleet}:updates"


class SharedState:
    """This router's side of the fleet's shared view: ``start()`` the two threads, ``stop()`` them.

    ``replicas()``: the router's replicas now (their in-flight counts and health are published); ``decisions()``:
    this router's decision counts by reason; ``hint_down(replica)``: another router took ``replica`` out: check it
    now (``HealthChecker.check_now``); ``learn_ttl``: learnt keys older than this (the index's ttl) are not replayed.
    """

    def __init__(
        self,
        url: str,
        fleet: str,
        *,
        policy: SharedPolicy | None,
        replicas: Callable[[], Sequence[Replica]],
        decisions: Callable[[], Mapping[str, float]],
        hint_down: Callable[[Replica], None],
        fingerprint: str | None,
        learn_ttl: float,
        router_id: str | None = None,
    ) -> None:
        import redis  # a dependency of preheat, imported when a router shares state

        self.url, self.fleet, self.key = url, fleet, stream_key(fleet)
        self.router = router_id or default_router_id()
        self.policy, self._replicas, self._decisions, self._hint_down = policy, replicas, decisions, hint_down
        self.fingerprint, self.learn_ttl = fingerprint, learn_ttl
        self.view = SharedView(self.router)
        self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        self._errors = redis.RedisError
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: deque[tuple[str, list[str]]] = deque()
        self._pending_keys = 0
        self._healthy: dict[str, bool] = {}
        self._last_load: dict[str, int] | None = None
        self._last_sent = 0.0
        self._hinted: dict[str, float] = {}
        self._down_since: dict[str, float] = {}  # per thread ("reader", "writer"): when its outage began
        # Redis's clock as of our monotonic one (set at each connect): entry IDs are milliseconds on it.
        self._clock_base: tuple[float, float] | None = None
        self._threads: list[threading.Thread] = []
        self.metrics = _Metrics(self)

    # -- the request path: queue only ------------------------------------------------------------------------------
    def learnt(self, replica: str, keys: list[str]) -> None:
        """``replica`` answered a prompt with ``keys`` (``SharedPolicy.answered``): publish them on the next tick."""
        with self._lock:
            if self._pending_keys + len(keys) > MAX_PENDING_KEYS:
                self.metrics.dropped.inc(len(keys))
                return
            self._pending.append((replica, keys))
            self._pending_keys += len(keys)
        self.metrics.learnt.inc(len(keys))

    # -- life ------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        for name, target in (("writer", self._write_loop), ("reader", self._read_loop)):
            thread = threading.Thread(target=target, name=f"shared-state {name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """End both threads, then publish what is still queued (the keys of the last answers): the others, and this
        router's next start, learn them all the same."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=TIMEOUT + 1)
        try:
            while self._pending and self.write_once():
                pass
        except self._errors as exc:
            log.warning("--shared-state %s: %d learnt keys not shared: %s", self.shown, self._pending_keys, exc)
        self.client.close()

    def shared_now(self) -> float:
        """Seconds on Redis's clock now (this host's wall clock until the first connect)."""
        base = self._clock_base
        if base is None:
            return time.time()
        return base[0] + time.monotonic() - base[1]

    # -- writer ----------------------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        failures = 0
        while not self._stop.wait(TICK if failures == 0 else RETRY.delay(failures)):
            try:
                self.write_once()
                failures = 0
                self._up("writer")
            except self._errors as exc:
                failures += 1
                self._down("writer", exc)

    def write_once(self) -> bool:
        """Publish what changed since the last entry (or a heartbeat); False when there was nothing to say."""
        replicas = list(self._replicas())
        load = {r.url: r.in_flight for r in replicas if r.in_flight > 0}
        down = []
        for replica in replicas:
            was = self._healthy.get(replica.url)
            if was and not replica.healthy and not replica.retired:
                down.append(replica.url)
        with self._lock:
            batch, count = [], 0
            while self._pending and count + len(self._pending[0][1]) <= MAX_ENTRY_KEYS:
                replica_url, keys = self._pending.popleft()
                batch.append((replica_url, tuple(keys)))
                count += len(keys)
            if not batch and self._pending:  # one answer with more keys than an entry takes: its first ones
                replica_url, keys = self._pending.popleft()
                batch.append((replica_url, tuple(keys[:MAX_ENTRY_KEYS])))
                count = len(keys)
            self._pending_keys -= count
        now = time.monotonic()
        news = bool(batch or down or load != self._last_load)
        if not news and now - self._last_sent < HEARTBEAT:
            return False
        update = Update(self.router, self.fingerprint, tuple(batch), load, tuple(down), dict(self._decisions()))
        try:
            self.client.xadd(self.key, update.encode(), maxlen=MAXLEN, approximate=True)  # type: ignore[arg-type]
        except self._errors:
            with self._lock:  # the batch waits for the next try (within the bound: it was counted there)
                self._pending.extendleft(reversed([(r, list(k)) for r, k in batch]))
                self._pending_keys += sum(len(k) for _, k in batch)
            raise
        self._healthy = {r.url: r.healthy for r in replicas}
        self._last_load, self._last_sent = load, now
        self.metrics.published.inc()
        return True

    # -- reader ----------------------------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        last = b"0-0"  # from the stream's start: a late router catches up on what the others learnt
        failures = 0
        while not self._stop.is_set():
            try:
                if self._clock_base is None:
                    seconds, micros = self.client.time()
                    self._clock_base = (seconds + micros / 1e6, time.monotonic())
                entries = _entries(self.client.xread({self.key: last}, count=PAGE, block=BLOCK_MS))
                for entry_id, fields in entries:
                    last = entry_id
                    self.apply(entry_id, fields)
                if len(entries) < PAGE:  # at the stream's end: every update published until now is in
                    self.view.synced()
                failures = 0
                self._up("reader")
            except self._errors as exc:
                failures += 1
                self._clock_base = None  # Redis may come back another server, on another clock
                self._down("reader", exc)
                self._stop.wait(RETRY.delay(failures))

    def apply(self, entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> None:
        """Fold one stream entry in (this router's own entries are skipped: it knows what it did)."""
        known = {r.url: r for r in self._replicas()}
        update, skipped = decode(fields, known)
        if update is None:
            self.metrics.ignored.inc(why=skipped[0])
            return
        if update.router == self.router:
            return
        for why in skipped:
            self.metrics.ignored.inc(why=why)
        age = max(self.shared_now() - _entry_seconds(entry_id), 0.0)
        if not self.view.heard(update, age=age, now_shared=self.shared_now()):
            self.metrics.ignored.inc(why="too_many_routers")
            return
        self.metrics.applied.inc(router=update.router)
        if update.learn and self.policy is not None and age < self.learn_ttl:
            if update.fingerprint != self.fingerprint:
                self.metrics.ignored.inc(why="fingerprint")
            else:
                for replica, keys in update.learn:
                    self.policy.learn_remote(replica, list(keys))
                    self.metrics.applied_keys.inc(len(keys), router=update.router)
        if age < HEARTBEAT * 10:  # an old ejection says nothing of now
            for url in update.down:
                self._hint(known[url])

    def _hint(self, replica: Replica) -> None:
        """Another router took ``replica`` out: check it now (once per second at most, and only if it is in)."""
        now = time.monotonic()
        if not replica.healthy or now - self._hinted.get(replica.url, -HEARTBEAT) < HEARTBEAT:
            return
        self._hinted[replica.url] = now
        self.metrics.hints.inc()
        threading.Thread(target=self._hint_down, args=(replica,), name="shared-state hint", daemon=True).start()

    # -- Redis's reachability ----------------------------------------------------------------------------------------
    def _down(self, thread: str, exc: Exception) -> None:
        self.metrics.errors.inc(op=thread)
        with self._lock:
            first = not self._down_since
            self._down_since.setdefault(thread, time.monotonic())
        self.view.up = False
        if first:
            log.warning("--shared-state %s: %s; routing on this router's own view until it answers", self.shown, exc)

    def _up(self, thread: str) -> None:
        with self._lock:
            was_down = bool(self._down_since)
            self._down_since.pop(thread, None)
            up = not self._down_since
        if up:
            self.view.up = True
            if was_down:
                log.warning("--shared-state %s: answering again; sharing the fleet's view", self.shown)

    @property
    def shown(self) -> str:
        """The URL without its password."""
        return self.url.split("://", 1)[0] + "://" + self.url.rsplit("@", 1)[-1].split("://")[-1]

    # -- what operators see ----------------------------------------------------------------------------------------
    def state(self) -> FleetView:
        """For the dashboard: who this router is, the others it hears, their decisions and how stale its view is."""
        ages: dict[str, float | None] = {**self.view.peers(self.shared_now()), self.router: None}
        every = self.metrics.all_decisions()
        fleet: dict[str, float] = {}
        for counts in every.values():
            for reason, n in counts.items():
                fleet[reason] = fleet.get(reason, 0.0) + n
        routers: list[FleetRouter] = [
            {
                "router": name,
                "age_seconds": ages[name],
                "decisions": int(sum(every.get(name, {}).values())),
                "hit_ratio": hit_ratio(every.get(name, {})),
            }
            for name in sorted(ages, key=lambda n: (n != self.router, n))
        ]
        return {
            "router": self.router,
            "fleet": self.fleet,
            "up": self.view.up,
            "staleness_seconds": self.view.staleness(),
            "hit_ratio": hit_ratio(fleet),
            "routers": routers,
        }


def _entries(answer: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """XREAD's answer for one stream (RESP2: ``[[stream, [(id, {field: value})...]]]``) as (id, fields) pairs."""
    if not isinstance(answer, list) or not answer:
        return []
    stream = answer[0]
    pairs = stream[1] if isinstance(stream, (list, tuple)) and len(stream) == 2 else []
    return [
        (entry_id, fields) for entry_id, fields in pairs if isinstance(entry_id, bytes) and isinstance(fields, dict)
    ]


def _entry_seconds(entry_id: bytes | str) -> float:
    """An entry ID's time (``<ms>-<seq>``, Redis's clock), in seconds; 0 for anything else (it is then old)."""
    text = entry_id.decode("ascii", "replace") if isinstance(entry_id, bytes) else entry_id
    ms, _, _ = text.partition("-")
    return int(ms) / 1000 if ms.isdigit() and len(ms) < 16 else 0.0


class _Metrics:
    """The ``preheat_router_shared_*`` and ``preheat_router_fleet_*`` series (docs/router.md, *Several routers*)."""

    def __init__(self, shared: SharedState) -> None:
        self.shared = shared
        self.published = Counter(
            "preheat_router_shared_published_total", "Updates this router wrote to --shared-state."
        )
        self.applied = Counter(
            "preheat_router_shared_applied_total", "Updates from other routers folded into this one's view, by router."
        )
        self.learnt = Counter(
            "preheat_router_shared_learnt_keys_total", "Chunk keys this router learnt from its answers and shares."
        )
        self.applied_keys = Counter(
            "preheat_router_shared_applied_keys_total", "Chunk keys learnt from other routers' answers, by router."
        )
        self.dropped = Counter(
            "preheat_router_shared_dropped_keys_total",
            "Learnt chunk keys not shared: too many waited while --shared-state did not answer.",
        )
        self.ignored = Counter(
            "preheat_router_shared_ignored_total",
            "Entries (or parts of them) read from --shared-state and ignored, by why (malformed, unknown_replica, "
            "bad_key, fingerprint...).",
        )
        self.errors = Counter(
            "preheat_router_shared_errors_total", "Failed --shared-state commands, by thread (reader, writer)."
        )
        self.hints = Counter(
            "preheat_router_shared_down_hints_total",
            "Health checks run at once because another router ejected the replica.",
        )

    def series(self) -> list[Series]:
        shared = self.shared
        return [
            self.published, self.applied, self.learnt, self.applied_keys, self.dropped, self.ignored, self.errors,
            self.hints,
            Gauge("preheat_router_shared_up", "1 while --shared-state answers, 0 while this router routes on its "
                  "own view.", lambda: [({}, 1.0 if shared.view.up else 0.0)]),
            Gauge("preheat_router_shared_staleness_seconds", "Seconds since this router's view last held every "
                  "update the others published (grows while --shared-state does not answer).", self._staleness),
            Gauge("preheat_router_shared_peer_age_seconds", "Per other router heard from lately, seconds since its "
                  "last update.", self._peers),
            Gauge("preheat_router_remote_in_flight", "Requests in flight through the other routers, per replica "
                  "(added to this router's own by the policies).", self._remote),
            Gauge("preheat_router_fleet_decisions", "Routing decisions per router (this one and those heard from "
                  "lately) and reason: each router's preheat_router_decisions_total as it last said it.",
                  self._decisions),
            Gauge("preheat_router_fleet_hit_ratio", "Share of routing decisions that followed a cache (prefix_match, "
                  "kv_hit), per router and for the whole fleet (router=\"fleet\").", self._hits),
        ]  # fmt: skip

    def _staleness(self) -> Samples:
        staleness = self.shared.view.staleness()
        return [] if staleness is None else [({}, staleness)]

    def _peers(self) -> Samples:
        return [({"router": name}, age) for name, age in self.shared.view.peers(self.shared.shared_now()).items()]

    def _remote(self) -> Samples:
        return [({"replica": url}, float(n)) for url, n in self.shared.view.remote_in_flight().items()]

    def all_decisions(self) -> dict[str, Mapping[str, float]]:
        """Per router (this one and those heard from lately), its decision counts by reason."""
        return {**self.shared.view.decisions(), self.shared.router: self.shared._decisions()}

    def _decisions(self) -> Samples:
        return [
            ({"router": router, "reason": reason}, n)
            for router, counts in self.all_decisions().items()
            for reason, n in counts.items()
        ]

    def _hits(self) -> Samples:
        every = self.all_decisions()
        fleet: dict[str, float] = {}
        samples: list[tuple[Mapping[str, str], float]] = []
        for router, counts in every.items():
            for reason, n in counts.items():
                fleet[reason] = fleet.get(reason, 0.0) + n
            ratio = hit_ratio(counts)
            if ratio is not None:
                samples.append(({"router": router}, ratio))
        ratio = hit_ratio(fleet)
        if ratio is not None:
            samples.append(({"router": "fleet"}, ratio))
        return samples
