"""Which replica gets a request, and why. Pure: a policy sees the request and the healthy replicas' load, never a
socket; ``Router`` (proxy.py) feeds it and counts its reasons in ``/metrics``.

- ``round-robin``: the next replica in turn (reason ``round_robin``);
- ``least-load``: the fewest requests in flight through this router, ties in turn (``least_load``);
- ``session``: the replica a session id hashes to, by rendezvous hashing, so that only a dead replica's sessions
  move (``session``; ``no_session``: least-load);
- ``prefix``: the longest run of leading chunk keys this router already sent there (``prefix_match``;
  ``no_match``: least-load);
- ``kv``: the lowest expected time to first token from the replicas' own KV events, score.py (``kv_hit``;
  ``kv_no_hit``: least-load).

``prefix`` and ``kv`` then apply the load guard (``LoadGuard``): ``load_guard`` and ``hot_spread`` override them.

``prefix`` and ``kv`` learn a request's chunk keys only once a replica answered it with a 2xx (``answered``); while
it is in flight (``sent``) its keys count as held there, so that a burst sharing a new prefix stays together, and
a request that fails or is refused leaves nothing behind.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass, field

import xxhash

from preheat.core.errors import ConfigError
from preheat.kv.keys import chunk_keys
from preheat.router.index import InFlight, KVIndex, PrefixIndex
from preheat.router.score import Estimate, expected_ttft, resolve_costs
from preheat.router.settings import POLICIES  # spelt once: the flag's choices


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
    """What a policy may know about a request: its session id and its prompt's token ids (None when the policy
    needs none, or the body could not be read: such a request goes by load, and the replica answers its 400)."""

    session: str | None = None
    token_ids: list[int] | None = None
    _keys: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    in_flight_keys: list[str] = field(default_factory=list)  # what ``Policy.sent`` marked, for ``answered``

    def keys(self, fingerprint: str, chunk_tokens: int) -> list[str]:
        """The prompt's chunk keys under ``fingerprint`` (computed once per fingerprint and chunk size)."""
        if self.token_ids is None:
            return []
        memo = (fingerprint, chunk_tokens)
        if memo not in self._keys:
            self._keys[memo] = chunk_keys(fingerprint, self.token_ids, chunk_tokens)
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

    def __init__(self) -> None:
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.in_flight = InFlight()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        raise NotImplementedError

    def keys_for(self, request: RouteRequest, replica: str) -> list[str]:
        """The chunk keys of ``request`` that this policy tracks on ``replica`` (none: the policy keeps no index)."""
        return []

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
    """The replica this router already sent the longest run of the prompt's leading chunks to."""

    name = "prefix"
    needs_tokens = True

    def __init__(self, fingerprint: str, chunk_tokens: int, index: PrefixIndex, guard: LoadGuard) -> None:
        super().__init__()
        self.fingerprint, self.chunk_tokens, self.index, self.guard = fingerprint, chunk_tokens, index, guard

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        keys = request.keys(self.fingerprint, self.chunk_tokens)
        matches = {c.name: self.match(c.name, keys) for c in candidates} if keys else {}
        if not any(matches.values()):
            return Decision(self.least_loaded(candidates).name, "no_match")
        ranked = sorted(candidates, key=lambda c: (-matches[c.name], c.in_flight))
        return self.guard.apply(ranked, Decision(ranked[0].name, "prefix_match"))

    def match(self, replica: str, keys: Sequence[str]) -> int:
        """Leading ``keys`` answered there within the index's ttl, or in requests still in flight there."""
        return self.index.match(replica, keys, also=lambda key: self.in_flight.contains(replica, key))

    def keys_for(self, request: RouteRequest, replica: str) -> list[str]:
        return request.keys(self.fingerprint, self.chunk_tokens)

    def learn(self, replica: str, keys: list[str]) -> None:
        self.index.record(replica, keys)

    def forget(self, replica: str) -> None:
        self.index.forget(replica)

    def index_sizes(self) -> dict[tuple[str, str], int]:
        return super().index_sizes() | {(name, "routed"): n for name, n in self.index.sizes().items()}


class KVAware(Policy):
    """The lowest expected TTFT (score.py) from the replicas' KV events; keys of requests in flight to a replica, or
    answered there in the last few seconds, count as L1 hits until the replica's own events confirm them (a poll
    interval would otherwise hide them)."""

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
    ) -> None:
        """``engines``: the replicas whose KV state comes from an engine's event stream (vLLM, SGLang); until one of
        them has a mapped block (or while its events cannot be mapped) it is scored as ``prefix`` would: the keys
        ``(fingerprint, chunk_tokens) = fallback`` of the prompts it answered, kept in ``routed``, as GPU hits."""
        super().__init__()
        self.index, self.guard, self.recent = index, guard, recent
        self.engines = frozenset(engines)
        self.fallback = fallback
        self.routed = routed if routed is not None else PrefixIndex()

    def estimate(self, request: RouteRequest, candidate: Candidate) -> Estimate | None:
        """``candidate``'s expected TTFT; None when it has published no KV state yet (an engine replica without
        mapped events: what ``prefix`` would say, ``_by_prefix``)."""
        state = self.index.state(candidate.name)
        if request.token_ids is None:
            return None
        if state is None:
            return self._by_prefix(request, candidate)
        keys = request.keys(state.fingerprint, state.chunk_tokens)
        others = [c for c in self.index.all_costs() if c is not state.costs]
        costs = resolve_costs(state.costs, others)
        wait = _queue_wait(candidate, state.load, state.finished)
        name = candidate.name
        l2 = self.index.l2_view(name)

        def pending(key: str) -> bool:
            return self.recent.contains(name, key) or self.in_flight.contains(name, key)

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
        wait = _queue_wait(candidate, (0, 0), 0)
        held = _Either(frozenset(), lambda key: self.routed.contains(name, key) or self.in_flight.contains(name, key))
        return expected_ttft(
            len(request.token_ids), keys, chunk_tokens, l1=frozenset(), l2=frozenset(), costs=costs,
            queue_wait=wait, gpu=held,
        )  # fmt: skip

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        estimates = {c.name: self.estimate(request, c) for c in candidates}
        known = [c for c in candidates if estimates[c.name] is not None]
        if not known:
            return Decision(self.least_loaded(candidates).name, "kv_no_hit")
        ranked = sorted(known, key=lambda c: (_ttft(estimates[c.name]), c.in_flight))
        best = estimates[ranked[0].name]
        reason = "kv_hit" if best is not None and best.hit_tokens else "kv_no_hit"
        if reason == "kv_no_hit":
            # Nobody holds any of it: every replica would recompute the whole prompt, so go by load instead.
            return Decision(self.least_loaded(candidates).name, reason, best)
        return self.guard.apply(ranked, Decision(ranked[0].name, reason, best))

    def keys_for(self, request: RouteRequest, replica: str) -> list[str]:
        state = self.index.state(replica)
        if state is None:
            if replica in self.engines and self.fallback is not None:
                return request.keys(*self.fallback)
            return []
        return request.keys(state.fingerprint, state.chunk_tokens)

    def answered(self, request: RouteRequest, replica: str, ok: bool) -> None:
        super().answered(request, replica, ok)
        # What an engine replica answered is its prefix fallback's index, kept while its events are also mapped:
        # a restart of the engine (or of its events) then falls back on what it most likely still holds.
        if ok and replica in self.engines and self.fallback is not None:
            self.routed.record(replica, request.keys(*self.fallback))

    def learn(self, replica: str, keys: list[str]) -> None:
        self.recent.record(replica, keys)

    def forget(self, replica: str) -> None:
        self.recent.forget(replica)
        self.routed.forget(replica)

    def index_sizes(self) -> dict[tuple[str, str], int]:
        sizes = super().index_sizes() | {(name, "recent"): n for name, n in self.recent.sizes().items()}
        sizes |= {(name, "routed"): n for name, n in self.routed.sizes().items()}
        for name, (l1, l2) in self.index.sizes().items():
            sizes[(name, "l1")], sizes[(name, "l2")] = l1, l2
        sizes |= {(name, "gpu"): n for name, n in self.index.gpu_sizes().items()}
        return sizes


def _ttft(estimate: Estimate | None) -> float:
    return estimate.ttft if estimate is not None else float("inf")


def _queue_wait(candidate: Candidate, load: tuple[int, int], finished: int) -> float:
    """Seconds of work ahead of a request at ``candidate``: its queue times the mean request there. The queue is
    what the replica itself reported, ``load`` (from its KV events, with ``finished`` of this router's requests
    over there then) or, newer where there is one, ``candidate.load`` (an engine's ``/metrics``); never less than
    what this router has in flight there.

    >>> _queue_wait(Candidate("a", 1, 2.0, 5, load=(2, 2), load_finished=4), (0, 0), 0)
    5.0
    """
    if candidate.load is not None:
        load, finished = candidate.load, candidate.load_finished
    # The replica's own running + waiting are as old as its last report: the requests of this router that finished
    # there since are counted in them, but are over. Counted anyway, they would send a user's next request away from
    # the replica that just cached its context.
    over = max(candidate.finished - finished, 0)
    queued = max(candidate.in_flight, sum(load) - over)
    # Each queued request takes about what requests there have taken so far; the one generating now is half done.
    return max(queued - 0.5, 0.0) * (candidate.service_seconds or 0.0)


class _Either:
    """Membership in a set or by a predicate (the keys routed there recently, or in flight there)."""

    def __init__(self, keys: Container[str], predicate: Callable[[str], bool]) -> None:
        self._keys, self._predicate = keys, predicate

    def __contains__(self, key: object) -> bool:
        return key in self._keys or (isinstance(key, str) and self._predicate(key))


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
) -> Policy:
    """The policy called ``name`` (one of ``POLICIES``)."""
    guard = guard or LoadGuard()
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "session":
        return Session()
    if name == "prefix":
        if fingerprint is None:
            raise ConfigError("--policy prefix needs a fingerprint (the router derives one from --model)")
        return Prefix(fingerprint, chunk_tokens, PrefixIndex(max_keys=index_keys, ttl=index_ttl), guard)
    if name == "kv":
        # Keys answered there recently stand in for the replica's store events for a few poll intervals only.
        return KVAware(
            kv_index or KVIndex(), guard, PrefixIndex(max_keys=index_keys, ttl=5.0),
            engines=engines,
            fallback=(fingerprint, chunk_tokens) if fingerprint is not None else None,
            routed=PrefixIndex(max_keys=index_keys, ttl=index_ttl),
        )  # fmt: skip
    raise ConfigError(f"--policy {name!r}: use one of {', '.join(POLICIES)}")
