"""The dashboard's state document (``preheat.dashboard/1``), built from values: pure, so it is tested without servers.

A replica's entry joins what the router knows of it (``ReplicaRow``: health, phase, requests in flight) with what its
own ``/metrics`` says (queue, tokens/s, KV hit rate per tier, cached-token share, TTFT: ``signals.read``, for preheat,
vLLM and SGLang replicas alike) and its last cold start (``/v1/preheat/timeline``: the waterfall; a vLLM replica
serves it through preheat's plugin). docs/dashboard.md documents every key; add keys, never rename them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from preheat.dashboard.prom import Metrics
from preheat.dashboard.signals import Signals, read

SCHEMA = "preheat.dashboard/1"
RATE_WINDOW = 2.0  # seconds between the two scrapes a tokens/s is measured over (shorter: too noisy to read)
MAX_STAGES = 64  # a waterfall's bars: a timeline is a few dozen stages; more would be unreadable anyway


# The state document's parts, as docs/dashboard.md lists them (the page's app.js reads these keys).
class Bar(TypedDict):
    name: str
    start: float
    end: float | None  # None: the stage is still running


class Waterfall(TypedDict):
    total: float
    origin: float | None
    stages: list[Bar]


KvTiers = dict[str, dict[str, float | None]]  # tier -> hits, misses, hit_rate, up (kv_tiers)


class Ttft(TypedDict):
    """A replica's time to first token from its own histogram (seconds; p50/p90 interpolated in its buckets)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None


class ReplicaEntry(TypedDict):
    url: str
    healthy: bool
    phase: str
    standby: bool
    in_flight: int
    finished: int
    queue: int | None
    running: int | None
    tokens_per_s: float | None
    generated_tokens: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    cached_share: float | None
    kv: KvTiers
    waterfall: Waterfall | None
    error: str | None
    engine: str  # preheat, vllm, sglang or unknown (signals.engine_of: by its metric names)
    kv_usage: float | None  # share of its KV cache in use (vLLM, SGLang)
    ttft: Ttft | None


class TierState(TypedDict):
    tier: str
    replicas: int
    down: int
    text: str


class DecisionRow(TypedDict):
    policy: str
    reason: str
    count: int


class FleetRouter(TypedDict):
    """One router of a fleet that shares its view (``--shared-state``): this one (``age_seconds`` None) or another
    heard from lately."""

    router: str
    age_seconds: float | None  # since its last update
    decisions: int
    hit_ratio: float | None  # the share of its decisions that followed a cache


class FleetView(TypedDict):
    """The shared view as this router holds it (router/shared_redis.py): null without ``--shared-state``."""

    router: str
    fleet: str
    up: bool  # the shared store answers
    staleness_seconds: float | None  # since the view last held every update the others published
    hit_ratio: float | None  # fleet-wide
    routers: list[FleetRouter]


class StateDocument(TypedDict):
    """The whole ``preheat.dashboard/1`` document (``document``), served at ``/dashboard/api/state``."""

    schema: str
    kind: str
    time: float
    status: str
    tiers: list[TierState]
    policy: str | None
    replicas: list[ReplicaEntry]
    decisions: list[DecisionRow]
    findings: dict[str, object] | None  # the doctor's preheat.doctor/1 document, passed through
    findings_error: str | None
    doctor: bool
    shared: FleetView | None  # several routers, one view: null on a replica, or a router on its own


@dataclass(frozen=True)
class ReplicaRow:
    """What the router (or a replica, of itself) knows of one replica without asking it."""

    url: str
    healthy: bool
    phase: str = "unknown"
    standby: bool = False
    in_flight: int = 0
    finished: int = 0


class TokenRate:
    """Tokens per second from successive readings of a counter (``preheat_generated_tokens_total``).

    The rate is measured over at least ``RATE_WINDOW`` seconds; a counter that went down (the replica restarted)
    starts the measure again."""

    def __init__(self) -> None:
        self._mark: tuple[float, float] | None = None  # (when, count) the window started at
        self.rate: float | None = None

    def observe(self, when: float, count: float | None) -> float | None:
        if count is None:
            return self.rate
        if self._mark is None or count < self._mark[1]:
            self._mark, self.rate = (when, count), None
            return None
        since, before = self._mark
        if when - since >= RATE_WINDOW:
            self.rate = (count - before) / (when - since)
            self._mark = (when, count)
        return self.rate


def kv_tiers(signals: Signals) -> KvTiers:
    """Per KV tier: hits, misses, hit rate (None before the first lookup) and up (1/0, None: not said). A vLLM
    replica's tiers are ``gpu`` (its prefix cache, in tokens) and ``external`` (a KV connector's, once asked)."""
    return {
        name: {"hits": t.hits, "misses": t.misses, "hit_rate": t.hit_rate, "up": t.up}
        for name, t in signals.tiers.items()
    }


def ttft(signals: Signals) -> Ttft | None:
    """The replica's TTFT histogram summarised; None when its engine exports none."""
    h = signals.ttft
    if h is None:
        return None
    p50, p90 = h.quantile(0.5), h.quantile(0.9)
    return {"count": int(h.count), "mean": _rounded(h.mean), "p50": _rounded(p50), "p90": _rounded(p90)}


def _rounded(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)


def waterfall(timeline: Mapping[str, object] | None) -> Waterfall | None:
    """The bars of a cold start: ``{"total", "origin", "stages": [{"name", "start", "end"}]}`` (end None: running).

    ``timeline`` is a replica's ``/v1/preheat/timeline`` JSON as it came (a ``TimelineDocument`` when the replica is
    preheat's, anything from a stranger): each value is checked here, where it enters the dashboard."""
    listed = timeline.get("stages") if timeline else None
    if timeline is None or not isinstance(listed, list):
        return None
    stages: list[Bar] = []
    for stage in listed[:MAX_STAGES]:
        start = _seconds(stage.get("start")) if isinstance(stage, dict) else None
        if start is None:
            continue
        stages.append({"name": str(stage.get("name", "?"))[:64], "start": start, "end": _seconds(stage.get("end"))})
    return {
        "total": _seconds(timeline.get("total")) or 0.0,
        "origin": _seconds(timeline.get("origin")),
        "stages": stages,
    }


def _seconds(value: object) -> float | None:
    """A timeline's number of seconds as a finite float, else None: a replica's JSON may hold an integer no float
    holds or ``1e999`` (infinite), and the page's ``JSON.parse`` refuses the ``Infinity`` that would be written."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) else None


def replica_entry(
    row: ReplicaRow,
    metrics: Metrics | None,
    timeline: Mapping[str, object] | None,  # the replica's timeline JSON, checked by waterfall()
    tokens_per_s: float | None,
    error: str | None = None,
) -> ReplicaEntry:
    """One replica's entry of the state document."""
    signals = read(metrics or {})
    prompt, cached, generated = signals.prompt_tokens, signals.cached_tokens, signals.generated_tokens
    return {
        "url": row.url,
        "healthy": row.healthy,
        "phase": row.phase,
        "standby": row.standby,
        "in_flight": row.in_flight,
        "finished": row.finished,
        "queue": signals.waiting,
        "running": signals.running,
        "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 2),
        "generated_tokens": None if generated is None else int(generated),
        "prompt_tokens": None if prompt is None else int(prompt),
        "cached_tokens": None if cached is None else int(cached),
        "cached_share": signals.cached_share,
        "kv": kv_tiers(signals),
        "waterfall": waterfall(timeline),
        "error": error,
        "engine": signals.engine,
        "kv_usage": _rounded(signals.kv_usage),
        "ttft": ttft(signals),
    }


IDLE_PHASES = ("standby", "sleeping")  # out of rotation by design (scaled to zero, waiting to be activated)


def tier_states(replicas: Sequence[ReplicaEntry], *, fleet: bool = True) -> list[TierState]:
    """Each KV tier of the replicas in rotation, as the header says it: ``{"tier": "l2", "replicas": 2, "down": 2,
    "text": "L2 down on 2/2 replicas"}`` (``L2 up`` when it is up on all; ``L2 down`` on a replica's own page,
    ``fleet`` False). A replica out of rotation is left out: the header counts it already, and what its tiers said
    last is stale.

    >>> [t["text"] for t in tier_states([{"healthy": True, "kv": {"l1": {"up": 1}, "l2": {"up": 0}}}])]
    ['L1 up', 'L2 down on 1/1 replicas']
    """
    counts: dict[str, list[int]] = {}  # tier -> [replicas reporting it, of which down]
    for replica in replicas:
        if not replica.get("healthy"):
            continue
        for tier, values in sorted((replica.get("kv") or {}).items()):
            up = values.get("up")
            if up is None:  # a replica that publishes no preheat_kv_tier_up for it: unknown, not down
                continue
            seen = counts.setdefault(tier, [0, 0])
            seen[0] += 1
            seen[1] += up == 0
    states: list[TierState] = []
    for tier, (reporting, down) in counts.items():
        name = tier.upper()
        text = f"{name} up" if not down else f"{name} down on {down}/{reporting} replicas" if fleet else f"{name} down"
        states.append({"tier": tier, "replicas": reporting, "down": down, "text": text})
    return states


def overall(status: str, replicas: Sequence[ReplicaEntry], tiers: Sequence[TierState]) -> str:
    """The header's word: ``ok`` only when every replica meant to serve is in rotation and every KV tier is up on
    each; ``degraded`` when it serves but not whole (a replica out, an L2 down: requests recompute); otherwise the
    ``status`` given (``cold``, ``no_replica``, a replica's phase)."""
    if status != "ok":
        return status
    out = any(not r.get("healthy") and not r.get("standby") and r.get("phase") not in IDLE_PHASES for r in replicas)
    return "degraded" if out or any(t["down"] for t in tiers) else "ok"


def decisions(samples: Sequence[tuple[Mapping[str, str], float]]) -> list[DecisionRow]:
    """The router's ``preheat_router_decisions_total`` as rows ``{"policy", "reason", "count"}``, most first."""
    rows: list[DecisionRow] = [
        {"policy": labels["policy"], "reason": labels.get("reason", "?"), "count": int(value)}
        for labels, value in samples
        if "policy" in labels and value > 0  # a counter with no decision yet has one unlabelled 0
    ]
    return sorted(rows, key=lambda r: (-r["count"], r["policy"], r["reason"]))


def document(
    kind: str,
    replicas: list[ReplicaEntry],
    *,
    now: float,
    status: str,
    policy: str | None = None,
    decision_rows: list[DecisionRow] | None = None,
    findings: Mapping[str, object] | None = None,  # the doctor's JSON (preheat.doctor/1), passed through
    findings_error: str | None = None,
    doctor: bool = False,
    shared: FleetView | None = None,
) -> StateDocument:
    """The whole state document: ``kind`` is ``router`` (a fleet) or ``replica`` (one ``preheat serve``);
    ``doctor``: whether findings are provided here (None findings then mean the first run is under way).
    ``status`` is what serves (the router's ``/health`` word, or the replica's phase); the document's says
    ``degraded`` instead of ``ok`` when a replica or a KV tier is down (``overall``)."""
    tiers = tier_states(replicas, fleet=kind == "router")
    return {
        "schema": SCHEMA,
        "kind": kind,
        "time": now,
        "status": overall(status, replicas, tiers),
        "tiers": tiers,
        "policy": policy,
        "replicas": replicas,
        "decisions": decision_rows or [],
        "findings": dict(findings) if findings is not None else None,
        "findings_error": findings_error,
        "doctor": doctor,
        "shared": shared,
    }
