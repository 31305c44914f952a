"""The router's ``/metrics`` (docs/router.md lists the series), on ``preheat.http.metrics``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from preheat.http.metrics import Counter, Gauge, Histogram, Samples, Series, render

OVERHEAD_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
COLD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """Every series of the router's ``GET /metrics``; replica state is read at scrape time."""

    def __init__(
        self,
        replica_state: Callable[[], Sequence[tuple[str, bool, int]]],
        index_sizes: Callable[[], Mapping[tuple[str, str], int]] = dict,
        reported_loads: Callable[[], Mapping[str, tuple[int, int]]] = dict,
        held: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self._replica_state = replica_state  # (url, healthy, in flight) per replica
        self._index_sizes = index_sizes  # keys per (replica, index) the policy remembers
        self._reported_loads = reported_loads  # (running, waiting) per replica, as it said last
        self._held = held  # requests held at the router per replica (hold.py)
        self.routed = Counter(
            "preheat_router_requests_total", "Requests answered through the router, by replica and status code."
        )
        self.decisions = Counter("preheat_router_decisions_total", "Routing decisions by policy and reason.")
        self.moved = Counter(
            "preheat_router_moved_total",
            "Held requests an idle replica took from another replica's line (router/hold.py), by the replica that took "
            "them.",
        )
        self.retries = Counter(
            "preheat_router_retries_total", "Requests retried on another replica after failing before a response."
        )
        self.ejections = Counter("preheat_router_ejections_total", "Times a replica was taken out of rotation.")
        self.errors = Counter("preheat_router_errors_total", "Requests the router answered with an error itself.")
        self.refused = Counter(
            "preheat_router_refused_answers_total",
            "Replica answers the router refused before relaying a byte (answer_too_large, event_too_large, "
            "replica_failed), by replica and code; the request was retried on another replica when one was left.",
        )
        self.connections_refused = Counter(
            "preheat_router_connections_refused_total",
            "Client connections answered 503 and closed at once because --max-connections were already open.",
        )
        self.overhead = Histogram(
            "preheat_router_overhead_seconds",
            "Seconds a request spends in the router itself (routing, forwarding), excluding the replica's time.",
            OVERHEAD_BUCKETS,
        )
        self.activations = Counter(
            "preheat_router_activations_total",
            "Standby replicas the router activated (POST /v1/preheat/load), by replica and outcome "
            "(ok, refused: model not allowed there, failed).",
        )
        self.wakes = Counter(
            "preheat_router_wakes_total",
            "Sleeping replicas the router woke (POST /v1/preheat/wake; vLLM: POST /wake_up, and reload_weights after a "
            "level-2 sleep), by replica and outcome (ok, failed).",
        )
        self.sleeps = Counter(
            "preheat_router_sleeps_total",
            "Idle replicas the router put to sleep (--sleep-idle; preheat's or vLLM's sleep route), by replica and "
            "outcome (ok, failed).",
        )
        self.activation_seconds = Histogram(
            "preheat_router_activation_seconds",
            "Seconds from the router's load request to the activated replica's first /health 200 (successes only).",
            COLD_BUCKETS,
        )
        self.wake_seconds = Histogram(
            "preheat_router_wake_seconds",
            "Seconds from the router's wake request to the woken replica's first /health 200 (successes only).",
            COLD_BUCKETS,
        )
        up = Gauge("preheat_router_replica_up", "1 when a replica is in rotation, 0 when ejected.", self._up)
        flight = Gauge("preheat_router_in_flight", "Requests in flight through the router, per replica.", self._flight)
        index = Gauge(
            "preheat_router_index_keys",
            "Chunk keys the routing policy holds per replica and index (prefix: routed, in_flight; "
            "kv: l1, l2, gpu (engine replicas), recent, routed (engine replicas' prefix fallback), in_flight).",
            self._index,
        )
        reported = Gauge(
            "preheat_router_replica_requests",
            "kv: requests running and waiting on each preheat replica as its KV events last reported them (asked "
            "every 0.25 s), every router's requests included.",
            self._reported,
        )
        held_now = Gauge(
            "preheat_router_held",
            "kv: requests held at the router for each replica that generates one sequence at a time, sent the "
            "cheapest first (counted in preheat_router_in_flight too).",
            self._held_now,
        )
        self._all: list[Series] = [
            self.routed, self.decisions, self.moved, self.retries, self.ejections, self.errors, self.refused,
            self.connections_refused, self.overhead, up, flight, index, reported, held_now,
            self.activations, self.wakes, self.sleeps, self.activation_seconds, self.wake_seconds,
        ]  # fmt: skip

    def _up(self) -> Samples:
        return [({"replica": url}, 1.0 if healthy else 0.0) for url, healthy, _ in self._replica_state()]

    def _flight(self) -> Samples:
        return [({"replica": url}, float(n)) for url, _, n in self._replica_state()]

    def _held_now(self) -> Samples:
        held = self._held()
        return [({"replica": url}, float(held.get(url, 0))) for url, _, _ in self._replica_state()]

    def _index(self) -> Samples:
        return [({"replica": url, "index": index}, float(n)) for (url, index), n in self._index_sizes().items()]

    def _reported(self) -> Samples:
        return [
            ({"replica": url, "state": state}, float(n))
            for url, load in self._reported_loads().items()
            for state, n in zip(("running", "waiting"), load, strict=True)
        ]

    def forget_replica(self, url: str) -> None:
        """A replica left the fleet (Kubernetes discovery): its per-replica counters leave ``/metrics`` with it, so
        a fleet whose pods come and go does not grow a set of series per pod. (A request still finishing there
        counts once more under its URL: one line that stays.)"""
        for series in self._all:
            if isinstance(series, Counter):
                series.forget(replica=url)

    def add(self, series: Series) -> None:
        """One more series on ``/metrics`` (the engine-events counter, when the router subscribes to any)."""
        self._all.append(series)

    def render(self) -> str:
        return render(self._all)
