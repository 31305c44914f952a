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
  up (and always billed); a replica placed on a free one skips provisioning. Replicas beyond the pool go to burst
  nodes, at the spot price with ``spot_burst`` (preemption is not modelled).
- Cost: burst replicas are billed from the moment they are asked for until they stop; warm pool nodes for the whole
  horizon (first arrival to last completion). Idle cost is billed time with no request in flight.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from preheat.errors import ConfigError
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

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError(f"policy {self.name}: need 0 <= min ({self.min_replicas}) <= max ({self.max_replicas})")
        if self.idle_timeout_s < 0 or self.warm_pool < 0:
            raise ConfigError(f"policy {self.name}: idle timeout and warm pool must not be negative")


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

    def to_dict(self) -> dict[str, object]:
        """The ``--json`` record of one policy."""
        ttft = self.ttft
        return {
            "policy": self.policy.name,
            "settings": {k: v for k, v in vars(self.policy).items() if k != "name"},
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
        price = settings.gpu_cost_per_hour / 3600.0
        self.pool_price = price
        self.burst_price = price * (1.0 - settings.spot_discount) if policy.spot_burst else price
        self.state: list[int] = []
        self.in_flight: list[int] = []
        self.on_pool: list[bool] = []
        self.asked_at: list[float] = []
        self.ended_at: list[float] = []
        self.busy_since: list[float] = []
        self.busy: list[float] = []
        self.epoch: list[int] = []
        self.pool_free = policy.warm_pool
        self.alive = 0
        self.starting = 0
        self.peak = 0
        self.cold_starts = 0

    def add(self, now: float, *, warm: bool) -> tuple[int, float]:
        """A new replica asked for at ``now``; returns its id and when it is ready."""
        rid = len(self.state)
        pool = self.pool_free > 0
        self.pool_free -= pool
        ready = now if warm else now + (self.pool_start_s if pool else self.burst_start_s)
        self.state.append(_SERVING if warm else _STARTING)
        self.in_flight.append(0)
        self.on_pool.append(pool)
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

    def bill(self, horizon: float) -> tuple[float, float, float, float]:
        """(accelerator seconds, busy seconds, cost, idle cost) over ``[0, horizon]``."""
        pool_seconds = self.policy.warm_pool * horizon
        seconds, cost = pool_seconds, pool_seconds * self.pool_price
        busy_total, idle_cost = 0.0, pool_seconds * self.pool_price
        for rid, state in enumerate(self.state):
            busy = self.busy[rid]
            busy_total += busy
            if self.on_pool[rid]:
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
    n = len(trace)
    arrival: list[float] = trace.arrival.tolist()
    prefill_arr = trace.input_tokens * (settings.prefill_ms_per_token / 1000.0)
    prefill: list[float] = prefill_arr.tolist()
    service: list[float] = (prefill_arr + trace.output_tokens * (settings.decode_ms_per_token / 1000.0)).tolist()
    fleet = _Fleet(policy, settings, cold)
    slots, timeout, lo, hi = settings.slots, policy.idle_timeout_s, policy.min_replicas, policy.max_replicas
    per_replica = slots * settings.target_utilization  # requests one replica should hold, by the scaling rules
    state, in_flight, busy_since, busy, epoch = fleet.state, fleet.in_flight, fleet.busy_since, fleet.busy, fleet.epoch
    ttft = [math.nan] * n
    served = [0] * n
    events: list[tuple[float, int, int, int]] = []  # (time, kind, replica, epoch)
    free: list[int] = []  # heap of serving replicas that may have a free slot (lazily cleaned)
    listed: list[bool] = []
    queue: deque[int] = deque()
    waited = 0
    for _ in range(lo):
        rid, _ready = fleet.add(0.0, warm=True)
        listed.append(True)
        heapq.heappush(free, rid)

    def dispatch(now: float) -> None:
        nonlocal waited
        while queue and free:
            rid = free[0]
            if state[rid] != _SERVING or in_flight[rid] >= slots:
                heapq.heappop(free)
                listed[rid] = False
                continue
            i = queue.popleft()
            if now > arrival[i]:
                waited += 1
            served[i] += 1
            ttft[i] = now - arrival[i] + prefill[i]
            if in_flight[rid] == 0:
                busy_since[rid] = now
            in_flight[rid] += 1
            heapq.heappush(events, (now + service[i], _DONE, rid, 0))

    def arm_idle(rid: int, now: float) -> None:
        epoch[rid] += 1
        heapq.heappush(events, (now + timeout, _IDLE, rid, epoch[rid]))

    def handle(when: float, kind: int, rid: int, stamp: int) -> None:
        if kind == _DONE:
            in_flight[rid] -= 1
            if not listed[rid]:
                listed[rid] = True
                heapq.heappush(free, rid)
            dispatch(when)
            if in_flight[rid] == 0:
                busy[rid] += when - busy_since[rid]
                arm_idle(rid, when)
        elif kind == _READY:
            state[rid] = _SERVING
            fleet.starting -= 1
            listed[rid] = True
            heapq.heappush(free, rid)
            dispatch(when)
            if in_flight[rid] == 0:
                arm_idle(rid, when)
        elif (
            stamp == epoch[rid]
            and state[rid] == _SERVING
            and in_flight[rid] == 0
            and fleet.alive > max(lo, math.ceil(in_system / per_replica))
        ):
            fleet.stop(rid, when)

    in_system = 0  # requests queued or in flight, for the scale-out rule
    last = 0.0
    for i in range(n):
        now = arrival[i]
        while events and events[0][0] <= now:
            when, kind, rid, stamp = heapq.heappop(events)
            in_system -= kind == _DONE
            handle(when, kind, rid, stamp)
        in_system += 1
        queue.append(i)
        # Starting replicas count: their capacity is on its way.
        wanted = min(math.ceil(in_system / per_replica), hi) - fleet.alive
        if wanted > 0:
            for _ in range(wanted):
                rid, ready = fleet.add(now, warm=False)
                listed.append(False)
                heapq.heappush(events, (ready, _READY, rid, 0))
        dispatch(now)
    while events and in_system:
        when, kind, rid, stamp = heapq.heappop(events)
        in_system -= kind == _DONE
        handle(when, kind, rid, stamp)
        last = when
    horizon = max(last, arrival[-1] if n else 0.0)
    for rid, s in enumerate(state):  # close the busy spans still open at the horizon
        if s == _SERVING and in_flight[rid]:
            busy[rid] += horizon - busy_since[rid]
    seconds, busy_s, cost, idle_cost = fleet.bill(horizon)
    return SimResult(
        policy=policy,
        cold_start_s={"warm_pool_node": fleet.pool_start_s, "new_node": fleet.burst_start_s},
        ttft=np.asarray(ttft, dtype=np.float64),
        served=np.asarray(served, dtype=np.int64),
        horizon_s=horizon,
        accelerator_hours=seconds / 3600.0,
        busy_hours=busy_s / 3600.0,
        cost=cost,
        idle_cost=idle_cost,
        cold_starts=fleet.cold_starts,
        peak_replicas=fleet.peak,
        requests_queued=waited,
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
}
_FIELDS = {
    "min": ("min_replicas", int),
    "max": ("max_replicas", int),
    "idle": ("idle_timeout_s", float),
    "pool": ("warm_pool", int),
}
_SWITCHES = {"cache": "node_cache", "quant": "quantized", "spot": "spot_burst"}


def parse_policy(text: str, *, max_replicas: int = 64, idle_timeout_s: float = 300.0) -> Policy:
    """A preset name (``PRESETS``), optionally with overrides, or a new named policy:

    ``warm-replicas:min=2``, ``mine:min=1,max=8,idle=120,cache,quant,pool=2,spot``. ``max_replicas`` and
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
