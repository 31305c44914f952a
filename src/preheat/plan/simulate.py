"""``preheat simulate``: replicas under a request trace, with cold starts, autoscaling and their cost. Pure.

The model (docs/plan.md has the formulas and the reasoning):

- A replica serves up to ``slots`` requests at once, each at the measured single-request speed: TTFT is the wait
  in the queue plus ``prompt tokens x prefill ms/token``; the request then holds its slot for ``output tokens x
  decode ms/token`` more. Requests wait in one FIFO queue and go to the lowest-numbered ready replica with a free
  slot, so load packs onto the oldest replicas and the newest ones go idle first.
- Scale out: when a request arrives, the fleet should have ceil(requests in the system / (``slots`` x
  ``target_utilization``)) replicas, ready or starting, up to ``max_replicas``; the missing ones are started. A new
  replica serves after its cold start.
- Scale in: a ready replica with nothing in flight for ``idle_timeout_s`` stops, unless that would leave fewer than
  ``min_replicas`` or fewer than the scale-out rule wants. ``min_replicas = 0`` is scale-to-zero;
  ``min_replicas > 0`` keeps warm replicas (ready at t=0).
- Cold start: the phases of a measured timeline (``ColdStart``). Node-local model cache: no download phase.
  Quantized weights: download and load x ``quantized_load_factor``. Warm node pool: ``warm_pool`` nodes are always
  up (and always billed); a replica placed on a free one skips provisioning. Standby replicas: ``standby`` processes
  are always up on their nodes (and always billed) with no model (``preheat serve --standby``); a replica placed on
  a free one becomes ready after an activation only (``ColdStart.standby_seconds``), and its slot returns to
  standby when it stops (the restart into standby is not modelled). Standby slots are used first, then pool nodes.
  Replicas beyond them go to burst nodes, at the spot price with ``spot_burst`` (preemption is not modelled).
- Cost: burst replicas are billed from the moment they are asked for until they stop; warm pool nodes for the whole
  horizon (first arrival to last completion). Idle cost is billed time with no request in flight.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypedDict, cast

import numpy as np

from preheat.core.errors import ConfigError
from preheat.plan.coldstart import ColdStart
from preheat.plan.traces import TraceArrays

_READY, _DONE, _IDLE = 0, 1, 2  # event kinds; at equal times a completion frees a slot before a timer fires
_STARTING, _SERVING, _GONE = 0, 1, 2  # replica states


@dataclass(frozen=True)
class Policy:
    """One way to run the fleet: the four cold-start patterns as switches, plus scale-to-zero's idle timeout."""

    name: str
    min_replicas: int = 0
    max_replicas: int = 64
    idle_timeout_s: float = 300.0
    node_cache: bool = False
    quantized: bool = False
    warm_pool: int = 0
    spot_burst: bool = False
    standby: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError(f"policy {self.name}: need 0 <= min ({self.min_replicas}) <= max ({self.max_replicas})")
        if self.idle_timeout_s < 0 or self.warm_pool < 0 or self.standby < 0:
            raise ConfigError(f"policy {self.name}: idle timeout, warm pool and standby must not be negative")


@dataclass(frozen=True)
class SimSettings:
    """Speeds and prices shared by every policy."""

    prefill_ms_per_token: float = 0.1
    decode_ms_per_token: float = 20.0
    slots: int = 16
    gpu_cost_per_hour: float = 32.0
    spot_discount: float = 0.6
    quantized_load_factor: float = 0.5
    target_utilization: float = 0.7  # Knative's default: keep 30% of the slots free for what arrives next


class PolicySettings(TypedDict):
    """A ``Policy``'s switches in its ``--json`` record (every field but the name)."""

    min_replicas: int
    max_replicas: int
    idle_timeout_s: float
    node_cache: bool
    quantized: bool
    warm_pool: int
    spot_burst: bool
    standby: int


class PolicyRecord(TypedDict):
    """One policy's ``--json`` record (``SimResult.to_dict``; docs/plan.md): what ``--emit-values`` reads."""

    policy: str
    settings: PolicySettings
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    ttft_max_s: float
    accelerator_hours: float
    busy_hours: float
    cost: float
    idle_cost: float
    cold_starts: int
    peak_replicas: int
    requests_queued: int
    cold_start_s: dict[str, float]
    horizon_s: float


@dataclass
class SimResult:
    """Per-policy outcome; ``served`` counts how often each request was served (always 1: a property tested)."""

    policy: Policy
    cold_start_s: dict[str, float]
    ttft: np.ndarray
    served: np.ndarray
    horizon_s: float
    accelerator_hours: float
    busy_hours: float
    cost: float
    idle_cost: float
    cold_starts: int
    peak_replicas: int
    requests_queued: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> PolicyRecord:
        """The ``--json`` record of one policy."""
        ttft = self.ttft
        # vars(): every switch a Policy has, in its order (PolicySettings names them; a unit test keeps the two equal)
        switches = cast(PolicySettings, {k: v for k, v in vars(self.policy).items() if k != "name"})
        return {
            "policy": self.policy.name,
            "settings": switches,
            "requests": int(ttft.size),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else 0.0,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else 0.0,
            "ttft_mean_s": float(ttft.mean()) if ttft.size else 0.0,
            "ttft_max_s": float(ttft.max()) if ttft.size else 0.0,
            "accelerator_hours": self.accelerator_hours,
            "busy_hours": self.busy_hours,
            "cost": self.cost,
            "idle_cost": self.idle_cost,
            "cold_starts": self.cold_starts,
            "peak_replicas": self.peak_replicas,
            "requests_queued": self.requests_queued,
            "cold_start_s": self.cold_start_s,
            "horizon_s": self.horizon_s,
        }


class _Fleet:
    """Replica state as parallel lists (cheap to index in the event loop), and billing."""

    def __init__(self, policy: Policy, settings: SimSettings, cold: ColdStart) -> None:
        self.policy, self.settings = policy, settings
        factor = settings.quantized_load_factor if policy.quantized else 1.0
        download = not policy.node_cache
        self.pool_start_s = cold.seconds(provision=False, download=download, load_factor=factor)
        self.burst_start_s = cold.seconds(provision=True, download=download, load_factor=factor)
        self.standby_start_s = cold.standby_seconds(download=download, load_factor=factor)
        price = settings.gpu_cost_per_hour / 3600.0
        self.pool_price = price
        self.burst_price = price * (1.0 - settings.spot_discount) if policy.spot_burst else price
        self.state: list[int] = []
        self.in_flight: list[int] = []
        self.on_pool: list[bool] = []
        self.on_standby: list[bool] = []
        self.asked_at: list[float] = []
        self.ended_at: list[float] = []
        self.busy_since: list[float] = []
        self.busy: list[float] = []
        self.epoch: list[int] = []
        self.pool_free = policy.warm_pool
        self.standby_free = policy.standby
        self.alive = 0
        self.starting = 0
        self.peak = 0
        self.cold_starts = 0

    def add(self, now: float, *, warm: bool) -> tuple[int, float]:
        """A new replica asked for at ``now``; returns its id and when it is ready."""
        rid = len(self.state)
        standby = self.standby_free > 0
        pool = not standby and self.pool_free > 0
        self.standby_free -= standby
        self.pool_free -= pool
        start = self.standby_start_s if standby else self.pool_start_s if pool else self.burst_start_s
        ready = now if warm else now + start
        self.state.append(_SERVING if warm else _STARTING)
        self.in_flight.append(0)
        self.on_pool.append(pool)
        self.on_standby.append(standby)
        self.asked_at.append(now)
        self.ended_at.append(math.nan)
        self.busy_since.append(0.0)
        self.busy.append(0.0)
        self.epoch.append(0)
        self.alive += 1
        self.starting += not warm
        self.cold_starts += not warm
        self.peak = max(self.peak, self.alive)
        return rid, ready

    def stop(self, rid: int, now: float) -> None:
        self.state[rid] = _GONE
        self.ended_at[rid] = now
        self.alive -= 1
        self.pool_free += self.on_pool[rid]
        self.standby_free += self.on_standby[rid]

    def bill(self, horizon: float) -> tuple[float, float, float, float]:
        """(accelerator seconds, busy seconds, cost, idle cost) over ``[0, horizon]``."""
        pool_seconds = (self.policy.warm_pool + self.policy.standby) * horizon  # standby nodes are billed alike
        seconds, cost = pool_seconds, pool_seconds * self.pool_price
        busy_total, idle_cost = 0.0, pool_seconds * self.pool_price
        for rid, state in enumerate(self.state):
            busy = self.busy[rid]
            busy_total += busy
            if self.on_pool[rid] or self.on_standby[rid]:
                idle_cost -= busy * self.pool_price  # the node is paid for anyway; busy time is not idle
                continue
            end = horizon if state != _GONE else self.ended_at[rid]
            billed = max(end - self.asked_at[rid], 0.0)
            seconds += billed
            cost += billed * self.burst_price
            idle_cost += (billed - busy) * self.burst_price
        return seconds, busy_total, cost, max(idle_cost, 0.0)


def simulate(trace: TraceArrays, cold: ColdStart, policy: Policy, settings: SimSettings) -> SimResult:
    """Run ``trace`` through a fleet run by ``policy``; every request is served once (queues are unbounded)."""
    if settings.slots < 1:
        raise ConfigError(f"--slots must be at least 1 (got {settings.slots})")
    if not 0 < settings.target_utilization <= 1:
        raise ConfigError(f"--target-utilization must be in (0, 1] (got {settings.target_utilization})")
    return _Simulation(trace, cold, policy, settings).run()


class _Simulation:
    """One run of the event loop: the trace as lists, the fleet, the event heap, the FIFO queue and the free list.

    Arrivals and events are taken in time order (events first at equal times), one method per kind of event. The
    fleet's per-replica lists are held here too, and hot methods copy attributes to locals: the loop runs a few
    million times per policy.
    """

    def __init__(self, trace: TraceArrays, cold: ColdStart, policy: Policy, settings: SimSettings) -> None:
        self.n = len(trace)
        self.arrival: list[float] = trace.arrival.tolist()
        prefill = trace.input_tokens * (settings.prefill_ms_per_token / 1000.0)
        self.prefill: list[float] = prefill.tolist()
        self.service: list[float] = (prefill + trace.output_tokens * (settings.decode_ms_per_token / 1000.0)).tolist()
        self.fleet = fleet = _Fleet(policy, settings, cold)
        self.state, self.in_flight, self.busy_since = fleet.state, fleet.in_flight, fleet.busy_since
        self.busy, self.epoch = fleet.busy, fleet.epoch
        self.slots, self.timeout = settings.slots, policy.idle_timeout_s
        self.lo, self.hi = policy.min_replicas, policy.max_replicas
        self.per_replica = settings.slots * settings.target_utilization  # requests one replica should hold
        self.ttft = [math.nan] * self.n
        self.served = [0] * self.n
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind, replica, epoch)
        self.free: list[int] = []  # heap of serving replicas that may have a free slot (lazily cleaned)
        self.listed: list[bool] = []  # whether each replica is in ``free``
        self.queue: deque[int] = deque()
        self.waited = 0  # requests that did not start at their arrival
        self.in_system = 0  # requests queued or in flight, for the scale-out rule

    def run(self) -> SimResult:
        self._start_warm()
        self._arrivals()
        horizon = max(self._drain(), self.arrival[-1] if self.n else 0.0)
        self._close_busy_spans(horizon)
        return self._result(horizon)

    def _start_warm(self) -> None:
        """The ``min_replicas`` that are ready at t=0."""
        for _ in range(self.lo):
            rid, _ready = self.fleet.add(0.0, warm=True)
            self.listed.append(True)
            heapq.heappush(self.free, rid)

    def _arrivals(self) -> None:
        """Each request in arrival order: the events before it happen, it queues, the fleet scales out, dispatch."""
        events, queue, arrival, fleet = self.events, self.queue, self.arrival, self.fleet
        next_event, dispatch = self._next_event, self._dispatch
        per_replica, hi = self.per_replica, self.hi
        for i in range(self.n):
            now = arrival[i]
            while events and events[0][0] <= now:
                next_event()
            self.in_system += 1
            queue.append(i)
            # Starting replicas count: their capacity is on its way.
            wanted = min(math.ceil(self.in_system / per_replica), hi) - fleet.alive
            if wanted > 0:
                self._start(now, wanted)
            dispatch(now)

    def _drain(self) -> float:
        """The events left after the last arrival, until every request is done; returns the last event's time."""
        last = 0.0
        while self.events and self.in_system:
            last = self._next_event()
        return last

    def _next_event(self) -> float:
        """Pop the earliest event and handle it; returns its time."""
        when, kind, rid, stamp = heapq.heappop(self.events)
        if kind == _DONE:
            self.in_system -= 1
            self._on_done(when, rid)
        elif kind == _READY:
            self._on_ready(when, rid)
        else:
            self._on_idle(when, rid, stamp)
        return when

    def _start(self, now: float, count: int) -> None:
        """Ask for ``count`` new replicas at ``now``; each is ready after its cold start."""
        for _ in range(count):
            rid, ready = self.fleet.add(now, warm=False)
            self.listed.append(False)
            heapq.heappush(self.events, (ready, _READY, rid, 0))

    def _dispatch(self, now: float) -> None:
        """Hand queued requests to the lowest-numbered serving replica with a free slot, while there are both."""
        queue, free = self.queue, self.free
        if not (queue and free):
            return
        listed, events, slots, state, in_flight = self.listed, self.events, self.slots, self.state, self.in_flight
        arrival, prefill, service, ttft, served = self.arrival, self.prefill, self.service, self.ttft, self.served
        while queue and free:
            rid = free[0]
            if state[rid] != _SERVING or in_flight[rid] >= slots:
                heapq.heappop(free)
                listed[rid] = False
                continue
            i = queue.popleft()
            if now > arrival[i]:
                self.waited += 1
            served[i] += 1
            ttft[i] = now - arrival[i] + prefill[i]
            if in_flight[rid] == 0:
                self.busy_since[rid] = now
            in_flight[rid] += 1
            heapq.heappush(events, (now + service[i], _DONE, rid, 0))

    def _arm_idle(self, rid: int, now: float) -> None:
        """Start (or restart) ``rid``'s idle timer; the new epoch makes its older timers stale."""
        epoch = self.epoch
        epoch[rid] += 1
        heapq.heappush(self.events, (now + self.timeout, _IDLE, rid, epoch[rid]))

    def _on_done(self, when: float, rid: int) -> None:
        """A request on ``rid`` finished: its slot serves the queue, or the replica goes idle."""
        in_flight = self.in_flight
        in_flight[rid] -= 1
        if not self.listed[rid]:
            self.listed[rid] = True
            heapq.heappush(self.free, rid)
        self._dispatch(when)
        if in_flight[rid] == 0:
            self.busy[rid] += when - self.busy_since[rid]
            self._arm_idle(rid, when)

    def _on_ready(self, when: float, rid: int) -> None:
        """``rid``'s cold start is over: it takes from the queue, or starts idle."""
        self.state[rid] = _SERVING
        self.fleet.starting -= 1
        self.listed[rid] = True
        heapq.heappush(self.free, rid)
        self._dispatch(when)
        if self.in_flight[rid] == 0:
            self._arm_idle(rid, when)

    def _on_idle(self, when: float, rid: int, stamp: int) -> None:
        """Stop ``rid`` if this timer is its latest, it is still idle, and the fleet stays at what the rules want."""
        fleet = self.fleet
        if (
            stamp == self.epoch[rid]
            and self.state[rid] == _SERVING
            and self.in_flight[rid] == 0
            and fleet.alive > max(self.lo, math.ceil(self.in_system / self.per_replica))
        ):
            fleet.stop(rid, when)

    def _close_busy_spans(self, horizon: float) -> None:
        """Busy spans still open at the horizon end there."""
        for rid, s in enumerate(self.state):
            if s == _SERVING and self.in_flight[rid]:
                self.busy[rid] += horizon - self.busy_since[rid]

    def _result(self, horizon: float) -> SimResult:
        fleet = self.fleet
        seconds, busy_s, cost, idle_cost = fleet.bill(horizon)
        return SimResult(
            policy=fleet.policy,
            cold_start_s={
                "warm_pool_node": fleet.pool_start_s,
                "new_node": fleet.burst_start_s,
                "standby": fleet.standby_start_s,
            },
            ttft=np.asarray(self.ttft, dtype=np.float64),
            served=np.asarray(self.served, dtype=np.int64),
            horizon_s=horizon,
            accelerator_hours=seconds / 3600.0,
            busy_hours=busy_s / 3600.0,
            cost=cost,
            idle_cost=idle_cost,
            cold_starts=fleet.cold_starts,
            peak_replicas=fleet.peak,
            requests_queued=self.waited,
        )


def simulate_all(
    trace: TraceArrays,
    cold: ColdStart,
    policies: list[Policy],
    settings: SimSettings,
    progress: Callable[[str], None] | None = None,
) -> list[SimResult]:
    """``simulate`` for each policy, in order."""
    results = []
    for policy in policies:
        if progress is not None:
            progress(policy.name)
        results.append(simulate(trace, cold, policy, settings))
    return results


# -- policies from the command line --------------------------------------------------------------------------------
PRESETS: dict[str, Policy] = {
    "scale-to-zero": Policy("scale-to-zero"),
    "warm-replicas": Policy("warm-replicas", min_replicas=1),
    "node-cache": Policy("node-cache", node_cache=True),
    "quantized": Policy("quantized", quantized=True),
    "warm-pool": Policy("warm-pool", warm_pool=2, spot_burst=True),
    "all-four": Policy("all-four", min_replicas=1, node_cache=True, quantized=True, warm_pool=2, spot_burst=True),
    "standby": Policy("standby", node_cache=True, standby=2),
}
_FIELDS = {
    "min": ("min_replicas", int),
    "max": ("max_replicas", int),
    "idle": ("idle_timeout_s", float),
    "pool": ("warm_pool", int),
    "standby": ("standby", int),
}
_SWITCHES = {"cache": "node_cache", "quant": "quantized", "spot": "spot_burst"}


def parse_policy(text: str, *, max_replicas: int = 64, idle_timeout_s: float = 300.0) -> Policy:
    """A preset name (``PRESETS``), optionally with overrides, or a new named policy:

    ``warm-replicas:min=2``, ``mine:min=1,max=8,idle=120,cache,quant,pool=2,spot,standby=1``. ``max_replicas`` and
    ``idle_timeout_s`` apply unless the text sets ``max=`` or ``idle=``.

    >>> policy = parse_policy("fast:min=1,cache,idle=60")
    >>> policy.name, policy.min_replicas, policy.node_cache, policy.idle_timeout_s, policy.quantized
    ('fast:min=1,cache,idle=60', 1, True, 60.0, False)
    """
    name, _, spec = text.partition(":")
    name = name.strip()
    if not name:
        raise ConfigError(f"--policy {text!r}: starts with a name, e.g. 'scale-to-zero' or 'mine:min=1,cache'")
    preset = PRESETS.get(name, Policy(name))
    # The whole text names the policy, so 'scale-to-zero' and 'scale-to-zero:idle=60' stay apart in the report.
    label = name if not spec.strip() else f"{name}:{spec.strip()}"
    policy = replace(preset, name=label, max_replicas=max_replicas, idle_timeout_s=idle_timeout_s)
    changes: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq and key in _SWITCHES:
            changes[_SWITCHES[key]] = True
        elif eq and key in _FIELDS:
            attr, kind = _FIELDS[key]
            try:
                changes[attr] = kind(value)
            except ValueError:
                raise ConfigError(f"--policy {text!r}: {key}={value!r} is not a {kind.__name__}") from None
        else:
            known = ", ".join([*(f"{k}=N" for k in _FIELDS), *_SWITCHES])
            raise ConfigError(f"--policy {text!r}: unknown setting {item!r} (known: {known})")
    return replace(policy, **changes)  # type: ignore[arg-type]  # values checked against _FIELDS above
