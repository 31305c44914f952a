"""Which replica gets a request, and why. Pure: a policy sees the request and the healthy replicas' load, never a
socket; ``Router`` (proxy.py) feeds it and counts its reasons in ``/metrics``.

- ``round-robin``: the next replica in turn (reason ``round_robin``);
- ``least-load``: the fewest requests in flight through this router, ties in turn (``least_load``);
- ``session``: the replica a session id hashes to, by rendezvous hashing, so that only a dead replica's sessions
  move (``session``; ``no_session``: least-load);
- ``prefix``: the longest run of leading chunks of the prompt's text this router already sent there
  (``prefix_match``; ``no_match``: least-load). Text, not tokens, as SGLang's and vLLM's ``cache_aware`` routers
  match: only this router compares the keys, so no tokenizer is needed and a request costs its JSON and a hash;
- ``kv``: the lowest expected time to first token from the replicas' own KV events and the work queued at each,
  score.py (``kv_hit``; ``kv_no_hit``: nobody holds any of the prompt, and ``kv_even``: every replica holds as much
  of it: the least priced load, least-load where the prices are equal).

``prefix`` then applies the load guard (``LoadGuard``): ``load_guard`` and ``hot_spread`` override it; ``kv`` prices
the queues itself and applies the guard only while it has measured nothing of a replica's requests yet.

``prefix`` and ``kv`` learn a request's chunk keys only once a replica answered it with a 2xx (``answered``); while
it is in flight (``sent``) its keys count as held there, so that a burst sharing a new prefix stays together, and
a request that fails or is refused leaves nothing behind.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass, field

import xxhash

from preheat.core.errors import ConfigError
from preheat.kv.keys import chained_keys, chunk_keys
from preheat.kv.keys import fingerprint as kv_fingerprint
from preheat.router.index import InFlight, KVIndex, PrefixIndex
from preheat.router.score import Estimate, Queue, expected_ttft, rank_cost, resolve_costs
from preheat.router.settings import POLICIES  # spelt once: the flag's choices
from preheat.router.upstream import moving_mean

log = logging.getLogger("preheat.router.kv")
# ``prefix`` keys text in chunks of C tokens' worth of bytes (--kv-chunk-tokens C): ~4 bytes a token in English.
TEXT_BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class Candidate:
    """A healthy replica as a policy sees it: its name (URL), requests in flight through this router, the mean
    seconds a request has taken there (None before the first one), and how many have finished there; ``load``:
    ``(running, waiting)`` from the engine's own ``/metrics`` (a vLLM or SGLang replica; None: not known), when
    ``load_finished`` of this router's requests had finished there."""

    name: str
    in_flight: int = 0
    service_seconds: float | None = None
    finished: int = 0
    load: tuple[int, int] | None = None
    load_finished: int = 0


@dataclass
class RouteRequest:
    """What a policy may know about a request: its session id, its prompt's token ids (``kv``) or its prompt as
    text (``prefix``: ``prompt_text``'s bytes); None when the policy needs none, or the body could not be read: such
    a request goes by load, and the replica answers its 400."""

    session: str | None = None
    token_ids: list[int] | None = None
    text: bytes | None = None
    # Keys computed once per seed and chunk size: (fingerprint, C) for ``keys``, (seed bytes, bytes) for ``text_keys``.
    _keys: dict[tuple[str | bytes, int], list[str]] = field(default_factory=dict)
    in_flight_keys: list[str] = field(default_factory=list)  # what ``Policy.sent`` marked, for ``answered``
    estimates: dict[str, Estimate] = field(default_factory=dict)  # ``kv``: per replica, as last chosen
    tickets: dict[str, int] = field(default_factory=dict)  # ``kv``: its place in each replica's queue
    held_seconds: float = 0.0  # how long the router held it before sending it (hold.py)

    def keys(self, fingerprint: str, chunk_tokens: int) -> list[str]:
        """The prompt's chunk keys under ``fingerprint`` (computed once per fingerprint and chunk size)."""
        if self.token_ids is None:
            return []
        memo = (fingerprint, chunk_tokens)
        if memo not in self._keys:
            self._keys[memo] = chunk_keys(fingerprint, self.token_ids, chunk_tokens)
        return self._keys[memo]

    def text_keys(self, seed: bytes, chunk_bytes: int) -> list[str]:
        """The keys of the text's full ``chunk_bytes`` chunks, chained from ``seed`` (computed once)."""
        if self.text is None:
            return []
        memo = (seed, chunk_bytes)  # a bytes seed: never equal to ``keys``' hex fingerprint
        if memo not in self._keys:
            self._keys[memo] = chained_keys(seed, self.text, chunk_bytes, len(self.text) // chunk_bytes)
        return self._keys[memo]


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str
    estimate: Estimate | None = None


@dataclass(frozen=True)
class LoadGuard:
    """Overrides a cache-aware choice when following the cache would queue requests behind each other.

    - ``load_guard``: the chosen replica has ``gap`` or more requests in flight beyond the least-loaded one: go to the
      least-loaded instead (queues imbalanced: waiting costs more than recomputing).
    - ``hot_spread``: the chosen replica already has ``hot`` or more in flight and the runner-up has at least two
      fewer: go to the runner-up, which then computes (and caches) the hot prefix too, so the prefix ends up served
      by two replicas instead of overloading one.
    """

    gap: int = 2
    hot: int = 3

    def apply(self, ranked: Sequence[Candidate], decision: Decision) -> Decision:
        best = next(c for c in ranked if c.name == decision.replica)
        least = min(ranked, key=lambda c: c.in_flight)
        if best.in_flight - least.in_flight >= self.gap:
            return Decision(least.name, "load_guard", decision.estimate)
        if best.in_flight >= self.hot:
            runner_up = next((c for c in ranked if c.name != best.name), None)
            if runner_up is not None and runner_up.in_flight <= best.in_flight - 2:
                return Decision(runner_up.name, "hot_spread", decision.estimate)
        return decision


class Policy:
    """Base of the policies: ``choose`` one of ``candidates`` (never empty); then, for each replica the request is
    sent to (a retry sends it to a second one), ``sent`` and, once that replica answered or failed, ``answered``."""

    name = ""
    needs_tokens = False  # whether the request's prompt must be tokenized before choosing
    needs_text = False  # whether it reads the request's prompt as text (``RouteRequest.text``)

    def __init__(self) -> None:
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.in_flight = InFlight()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        raise NotImplementedError

    def keys_for(self, request: RouteRequest, replica: str) -> list[str]:
        """The chunk keys of ``request`` that this policy tracks on ``replica`` (none: the policy keeps no index)."""
        return []

    def hold_slots(self, request: RouteRequest, replica: str) -> int | None:
        """The sequences ``replica`` generates at once when ``request`` waits at the router beyond them (hold.py),
        sent by ``hold_cost``; None: sent at once (a policy that prices no request)."""
        return None

    def hold_cost(self, request: RouteRequest, candidate: Candidate) -> float:
        """Seconds of ``candidate``'s work for a held ``request``, as things stand now: the order it is sent in."""
        return 0.0

    def sent(self, request: RouteRequest, replica: str) -> None:
        """``request`` is on its way to ``replica``: its keys count as held there until it is answered."""
        request.in_flight_keys = self.keys_for(request, replica)
        if request.in_flight_keys:
            self.in_flight.add(replica, request.in_flight_keys)

    def answered(self, request: RouteRequest, replica: str, ok: bool) -> None:
        """``replica`` answered ``request`` (``ok``: with a 2xx) or failed before answering (``ok`` False). Only an
        ``ok`` answer teaches the index anything: the replica computed, so cached, the prompt's chunks."""
        keys, request.in_flight_keys = request.in_flight_keys, []
        if keys:
            self.in_flight.remove(replica, keys)
            if ok:
                self.learn(replica, keys)

    def learn(self, replica: str, keys: list[str]) -> None:
        """Remember that ``replica`` now holds ``keys`` (a 2xx answered the request they came from)."""

    def forget(self, replica: str) -> None:
        """The replica was ejected or restarted: whatever was learnt about its cache is stale."""

    def index_sizes(self) -> dict[tuple[str, str], int]:
        """Keys remembered, per (replica, index): for ``/metrics``."""
        return {(name, "in_flight"): n for name, n in self.in_flight.sizes().items()}

    def reported_loads(self) -> dict[str, tuple[int, int]]:
        """Per replica, its own ``(running, waiting)`` as it last reported them (policies that read them): for
        ``/metrics``."""
        return {}

    def least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """The fewest in flight; ties broken in turn, so that idle replicas share the work evenly."""
        low = min(c.in_flight for c in candidates)
        tied = [c for c in candidates if c.in_flight == low]
        with self._lock:
            turn = next(self._turn)
        return tied[turn % len(tied)]


class RoundRobin(Policy):
    name = "round-robin"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        with self._lock:
            turn = next(self._turn)
        return Decision(candidates[turn % len(candidates)].name, "round_robin")


class LeastLoad(Policy):
    name = "least-load"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        return Decision(self.least_loaded(candidates).name, "least_load")


class Session(Policy):
    """Sticky by session id (``X-Session-Id`` header, else the body's ``user``); no id: least-load."""

    name = "session"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        if request.session is None:
            return Decision(self.least_loaded(candidates).name, "no_session")
        return Decision(rendezvous(request.session, [c.name for c in candidates]), "session")


def rendezvous(session: str, names: Sequence[str]) -> str:
    """Highest-random-weight hashing: the same session maps to the same name while that name is present, and losing
    a name moves only the sessions that mapped to it.

    >>> rendezvous("alice", ["a", "b", "c"]) == rendezvous("alice", ["c", "b", "a"])
    True
    """
    return max(names, key=lambda name: xxhash.xxh3_64_intdigest(f"{session}\x00{name}".encode()))


class Prefix(Policy):
    """The replica this router already sent the longest run of the prompt text's leading ``chunk_bytes`` chunks to;
    ``fingerprint`` seeds the keys (every router of a fleet that shares what it learnt uses the same one)."""

    name = "prefix"
    needs_text = True

    def __init__(self, fingerprint: str, chunk_bytes: int, index: PrefixIndex, guard: LoadGuard) -> None:
        super().__init__()
        if chunk_bytes < 1:
            raise ConfigError(f"prefix: a chunk is at least one byte (got {chunk_bytes})")
        self.fingerprint, self.chunk_bytes, self.index, self.guard = fingerprint, chunk_bytes, index, guard
        self._seed = bytes.fromhex(fingerprint)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        keys = request.text_keys(self._seed, self.chunk_bytes)
        matches = {c.name: self.match(c.name, keys) for c in candidates} if keys else {}
        if not any(matches.values()):
            return Decision(self.least_loaded(candidates).name, "no_match")
        ranked = sorted(candidates, key=lambda c: (-matches[c.name], c.in_flight))
        return self.guard.apply(ranked, Decision(ranked[0].name, "prefix_match"))

    def match(self, replica: str, keys: Sequence[str]) -> int:
        """Leading ``keys`` answered there within the index's ttl, or in requests still in flight there."""
        return self.index.match(replica, keys, also=lambda key: self.in_flight.contains(replica, key))

    def keys_for(self, request: RouteRequest, replica: str) -> list[str]:
        return request.text_keys(self._seed, self.chunk_bytes)

    def learn(self, replica: str, keys: list[str]) -> None:
        self.index.record(replica, keys)

    def forget(self, replica: str) -> None:
        self.index.forget(replica)

    def index_sizes(self) -> dict[tuple[str, str], int]:
        return super().index_sizes() | {(name, "routed"): n for name, n in self.index.sizes().items()}


class KVAware(Policy):
    """The lowest expected TTFT (score.py) from the replicas' KV events and the work queued at each; keys of requests
    in flight to a replica, or answered there since its last events, count as L1 hits until its own events confirm
    them (a poll interval would otherwise hide them).

    Calibrated, not constant: the per-token costs are each replica's own measurements (its events' ``costs``); the
    queue is the estimated service of each request this router sent there and not answered yet, plus the time the
    ones still generating have left (the mean duration of a request there less the mean time to its first token,
    both measured by this router), plus the requests the replica reports beyond this router's. Replicas are ranked
    by ``score.rank_cost``: the TTFT, plus the request's own work again as far as the fleet is busy."""

    name = "kv"
    needs_tokens = True

    def __init__(
        self,
        index: KVIndex,
        guard: LoadGuard,
        recent: PrefixIndex,
        *,
        engines: Collection[str] = (),
        fallback: tuple[str, int] | None = None,
        routed: PrefixIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
        holds: bool = True,
    ) -> None:
        """``engines``: the replicas whose KV state comes from an engine's event stream (vLLM, SGLang); until one of
        them has a mapped block (or while its events cannot be mapped) it is scored as ``prefix`` would: the keys
        ``(fingerprint, chunk_tokens) = fallback`` of the prompts it answered, kept in ``routed``, as GPU hits.
        ``holds`` False: nothing is held at the router (``hold``; ``--no-hold``)."""
        super().__init__()
        self.index, self.guard, self.recent = index, guard, recent
        self.engines = frozenset(engines)
        self.fallback = fallback
        self.routed = routed if routed is not None else PrefixIndex()
        self._clock = clock
        self.holds = holds
        # Per replica: the requests sent there and not answered yet (ticket -> (sent at, estimated service s)),
        # the mean seconds from sending one to its first byte, the mean estimated service of one, and the event
        # sequence number its KV state had when it last answered (newer events confirm or deny ``recent``).
        self._waiting: dict[str, dict[int, tuple[float, float]]] = {}
        self._first_byte: dict[str, float] = {}
        self._typical: dict[str, float] = {}
        self._answered_seq: dict[str, int] = {}
        self._tickets = itertools.count()

    def estimate(self, request: RouteRequest, candidate: Candidate, *, in_flight: bool = True) -> Estimate | None:
        """``candidate``'s expected TTFT; None when it has published no KV state yet (an engine replica without
        mapped events: what ``prefix`` would say, ``_by_prefix``). ``in_flight`` False: the keys of requests still
        in flight there do not count as held (hold.py's order)."""
        state = self.index.state(candidate.name)
        if request.token_ids is None:
            return None
        if state is None:
            return self._by_prefix(request, candidate)
        keys = request.keys(state.fingerprint, state.chunk_tokens)
        others = [c for c in self.index.all_costs() if c is not state.costs]
        costs = resolve_costs(state.costs, others)
        wait = self.queue(candidate, state.load, state.finished).wait()
        name = candidate.name
        l2 = self.index.l2_view(name)
        # Keys answered there count until the replica's events move past that answer: from then on its own events
        # say what it holds (its stores came before its answer), evictions included.
        unconfirmed = name in self.engines or state.seq <= self._answered_seq.get(name, -1)

        def pending(key: str) -> bool:
            return (in_flight and self.in_flight.contains(name, key)) or (
                unconfirmed and self.recent.contains(name, key)
            )

        if name in self.engines:  # an engine computes a prompt into its GPU cache
            return expected_ttft(
                len(request.token_ids), keys, state.chunk_tokens, l1=state.l1, l2=l2, costs=costs,
                queue_wait=wait, gpu=_Either(state.gpu, pending),
            )  # fmt: skip
        l1 = _Either(state.l1, pending)
        return expected_ttft(
            len(request.token_ids), keys, state.chunk_tokens, l1=l1, l2=l2, costs=costs, queue_wait=wait
        )

    def _by_prefix(self, request: RouteRequest, candidate: Candidate) -> Estimate | None:
        """An engine replica without mapped KV events: what ``prefix`` would say, priced as GPU hits."""
        name = candidate.name
        if name not in self.engines or self.fallback is None or request.token_ids is None:
            return None
        fingerprint, chunk_tokens = self.fallback
        keys = request.keys(fingerprint, chunk_tokens)
        costs = resolve_costs((None, None, None), self.index.all_costs())
        wait = self.queue(candidate, (0, 0), 0).wait()
        held = _Either(frozenset(), lambda key: self.routed.contains(name, key) or self.in_flight.contains(name, key))
        return expected_ttft(
            len(request.token_ids), keys, chunk_tokens, l1=frozenset(), l2=frozenset(), costs=costs,
            queue_wait=wait, gpu=held,
        )  # fmt: skip

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        estimates = {c.name: self.estimate(request, c) for c in candidates}
        request.estimates = {name: e for name, e in estimates.items() if e is not None}
        known = [c for c in candidates if estimates[c.name] is not None]
        if not known:
            return Decision(self.least_loaded(candidates).name, "kv_no_hit")
        busy = sum(1 for c in candidates if c.in_flight) / len(candidates)
        cost = {c.name: _cost(estimates[c.name], busy) for c in known}
        ranked = sorted(known, key=lambda c: (cost[c.name], c.in_flight))
        best = estimates[ranked[0].name]
        if log.isEnabledFor(logging.DEBUG):  # the decision's terms, for profiling the cost model
            log.debug("kv %d tokens: %s", len(request.token_ids or ()), "; ".join(
                f"{c.name} in_flight={c.in_flight} {estimates[c.name]}" for c in candidates))  # fmt: skip
        no_hit = all(e is None or not e.hit_tokens for e in estimates.values())
        if no_hit and len(known) < len(candidates):
            # Nobody holds any of it, and a replica without KV state cannot be priced: go by the count in flight.
            return Decision(self.least_loaded(candidates).name, "kv_no_hit", best)
        own = [e.service for e in estimates.values() if e is not None]
        # Every replica would do the same work for it (as much held, in the same tier, at the same costs: a shared
        # system prompt, a shared L2)?
        even = len(candidates) > 1 and len(own) == len(candidates) and max(own) - min(own) <= 1e-9 * max(own)
        if no_hit or even:
            # The caches do not tell the replicas apart, so the load does, priced as for a hit: the work queued at
            # each at its own measured speed, so a slower replica (a straggler, a busier accelerator) takes fewer
            # new prompts, where a count in flight would give it as many. Equal prices go by the count, in turn.
            tied = [c for c in ranked if cost[c.name] <= cost[ranked[0].name] * (1 + 1e-9)]
            decision = Decision(self.least_loaded(tied).name, "kv_no_hit" if no_hit else "kv_even", best)
        else:
            decision = Decision(ranked[0].name, "kv_hit", best)
        if any(c.service_seconds is None and c.in_flight for c in candidates):
            # A replica with requests in flight and none finished: its queue is not priced yet, so guard it.
            return self.guard.apply(ranked, decision)
        return decision

    def queue(self, candidate: Candidate, load: tuple[int, int], finished: int) -> Queue:
        """The work ahead of a new request at ``candidate`` (score.Queue). ``load``: the replica's own ``(running,
        waiting)`` from its KV events, with ``finished`` of this router's requests over there then; newer, where
        there is one, ``candidate.load`` (an engine's ``/metrics``)."""
        name = candidate.name
        now = self._clock()
        with self._lock:
            sent = sorted((self._waiting.get(name) or {}).values())
            first_byte, typical = self._first_byte.get(name), self._typical.get(name)
        waiting = tuple(service for _, service in sent)
        streaming = max(candidate.in_flight - len(waiting), 0)
        service = candidate.service_seconds
        tail = _tail(service, first_byte)
        if candidate.load is not None:
            load, finished = candidate.load, candidate.load_finished
        # The replica's running + waiting are as old as its last report: this router's requests that finished
        # there since are counted in them, but are over (they would send a user's next request away from the
        # replica that just cached its context).
        reported = sum(load) - max(candidate.finished - finished, 0)
        others = max(reported - candidate.in_flight, 0)
        return Queue(
            waiting, now - sent[0][0] if sent else 0.0, streaming, tail, others,
            typical if typical is not None else (service or 0.0),
        )  # fmt: skip

    def hold_slots(self, request: RouteRequest, replica: str) -> int | None:
        """A preheat replica that says how many sequences it generates at once (its events' ``load.slots``): its
        requests past that wait at the router (hold.py). An engine batches what it is sent: nothing is held for it;
        nor a request whose prompt could not be read (it cannot be priced)."""
        state = self.index.state(replica)
        if not self.holds or replica in self.engines or state is None or request.token_ids is None:
            return None
        return state.slots

    def hold_cost(self, request: RouteRequest, candidate: Candidate) -> float:
        """Its service there and the answer after it, without the keys still in flight (a request must not pass
        the one computing its prefix); a typical request's there when its KV state is gone meanwhile."""
        estimate = self.estimate(request, candidate, in_flight=False)
        with self._lock:
            first_byte, typical = self._first_byte.get(candidate.name), self._typical.get(candidate.name)
        if estimate is None:
            return typical or 0.0
        return estimate.service + _tail(candidate.service_seconds, first_byte)

    def sent(self, request: RouteRequest, replica: str) -> None:
        super().sent(request, replica)
        estimate = request.estimates.get(replica)
        with self._lock:
            typical = self._typical.get(replica)
            service = estimate.service if estimate is not None else (typical or 0.0)
            ticket = request.tickets[replica] = next(self._tickets)
            self._waiting.setdefault(replica, {})[ticket] = (self._clock(), service)
            self._typical[replica] = moving_mean(typical, service)

    def keys_for(self, request: RouteRequest, replica: str) -> list[str]:
        state = self.index.state(replica)
        if state is None:
            if replica in self.engines and self.fallback is not None:
                return request.keys(*self.fallback)
            return []
        return request.keys(state.fingerprint, state.chunk_tokens)

    def answered(self, request: RouteRequest, replica: str, ok: bool) -> None:
        super().answered(request, replica, ok)
        state = self.index.state(replica)
        with self._lock:
            ticket = request.tickets.pop(replica, None)
            entry = (self._waiting.get(replica) or {}).pop(ticket, None) if ticket is not None else None
            if ok and entry is not None:  # from its sending on, not from when it was routed and held
                seconds = self._clock() - entry[0] - request.held_seconds
                self._first_byte[replica] = moving_mean(self._first_byte.get(replica), seconds)
            if ok and state is not None:
                self._answered_seq[replica] = state.seq
        # What an engine replica answered is its prefix fallback's index, kept while its events are also mapped:
        # a restart of the engine (or of its events) then falls back on what it most likely still holds.
        if ok and replica in self.engines and self.fallback is not None:
            self.routed.record(replica, request.keys(*self.fallback))

    def learn(self, replica: str, keys: list[str]) -> None:
        self.recent.record(replica, keys)

    def forget(self, replica: str) -> None:
        self.recent.forget(replica)
        self.routed.forget(replica)
        with self._lock:
            for measured in (self._first_byte, self._typical, self._answered_seq):
                measured.pop(replica, None)

    def index_sizes(self) -> dict[tuple[str, str], int]:
        sizes = super().index_sizes() | {(name, "recent"): n for name, n in self.recent.sizes().items()}
        sizes |= {(name, "routed"): n for name, n in self.routed.sizes().items()}
        for name, (l1, l2) in self.index.sizes().items():
            sizes[(name, "l1")], sizes[(name, "l2")] = l1, l2
        sizes |= {(name, "gpu"): n for name, n in self.index.gpu_sizes().items()}
        return sizes

    def reported_loads(self) -> dict[str, tuple[int, int]]:
        # An engine's event stream carries no load (its /metrics does, read into Candidate.load).
        return {name: load for name, load in self.index.loads().items() if name not in self.engines}


def _tail(service: float | None, first_byte: float | None) -> float:
    """What a request has left once its first byte came: the mean request less the mean wait for the first byte."""
    return max(service - first_byte, 0.0) if service is not None and first_byte is not None else 0.0


def _cost(estimate: Estimate | None, busy: float) -> float:
    return rank_cost(estimate, busy) if estimate is not None else float("inf")


class _Either:
    """Membership in a set or by a predicate (the keys routed there recently, or in flight there)."""

    def __init__(self, keys: Container[str], predicate: Callable[[str], bool]) -> None:
        self._keys, self._predicate = keys, predicate

    def __contains__(self, key: object) -> bool:
        return key in self._keys or (isinstance(key, str) and self._predicate(key))


def text_fingerprint(chunk_tokens: int) -> str:
    """The seed of ``prefix``'s text keys: the same in every router (no model in it: text is text), so a fleet's
    routers that share what they learnt (--shared-state) compare like with like."""
    # The text's format (prompts.prompt_text) and its bytes a token are in it: a router that reads text otherwise
    # makes other keys, and the fleet ignores them by fingerprint instead of missing silently.
    layout = {"index": "preheat-router-text", "format": 1, "bytes_per_token": TEXT_BYTES_PER_TOKEN}
    return kv_fingerprint(identity="prompt text", layout=layout, chunk_tokens=chunk_tokens)


def make_policy(
    name: str,
    *,
    fingerprint: str | None = None,
    chunk_tokens: int = 256,
    kv_index: KVIndex | None = None,
    guard: LoadGuard | None = None,
    index_keys: int = 100_000,
    index_ttl: float = 600.0,
    engines: Collection[str] = (),
    hold: bool = True,
) -> Policy:
    """The policy called ``name`` (one of ``POLICIES``); ``hold``: ``kv`` holds requests (``KVAware.hold``)."""
    guard = guard or LoadGuard()
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "session":
        return Session()
    if name == "prefix":
        fingerprint = fingerprint or text_fingerprint(chunk_tokens)
        chunk_bytes = chunk_tokens * TEXT_BYTES_PER_TOKEN
        return Prefix(fingerprint, chunk_bytes, PrefixIndex(max_keys=index_keys, ttl=index_ttl), guard)
    if name == "kv":
        # Keys answered there recently stand in for the replica's store events for a few poll intervals only.
        return KVAware(
            kv_index or KVIndex(), guard, PrefixIndex(max_keys=index_keys, ttl=5.0),
            engines=engines,
            fallback=(fingerprint, chunk_tokens) if fingerprint is not None else None,
            routed=PrefixIndex(max_keys=index_keys, ttl=index_ttl), holds=hold,
        )  # fmt: skip
    raise ConfigError(f"--policy {name!r}: use one of {', '.join(POLICIES)}")
