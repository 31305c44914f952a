"""``preheat analyze``: is a KV cache tier worth it for this workload? Pure: requests in, a report out.

The numbers (formulas in docs/plan.md):

- ``shared_prefix_ratio``: sum over requests of the tokens in leading full chunks some earlier request already had,
  over all prompt tokens. Measured in whole chunks (what a chunk cache can reuse), so token-level sharing is at
  least this high.
- reusable prefix length per request (tokens): its distribution.
- hit rates (fractions of prompt tokens served from a cache) for an infinite cache shared by all replicas, for an
  infinite cache per replica, and for the given L1 per replica / shared L2, under round-robin and prefix-aware
  routing; and over a sweep of cache sizes (the plot).
- prefill time saved: ``hit tokens x prefill ms/token - L2 hit tokens x L2 read ms/token``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from preheat.core.config import format_bytes
from preheat.kv.keys import cacheable_chunks, chunk_keys
from preheat.plan.prefix import (
    UNBOUNDED,
    CacheResult,
    KeyedRequest,
    KeyTable,
    capacity_sweep,
    reusable_chunks,
    route_prefix_aware,
    route_round_robin,
    simulate_lru,
)
from preheat.plan.traces import Request

SHARED_L2_THRESHOLD = 0.40  # the seed's rule of thumb: a shared L2 pays off from ~40% shared leading tokens
# The seed's measurement: ~56 ms to read ~1,900 tokens of KV from L2. Taken as Llama-3-8B's KV (128 KiB per token in
# BF16), that is ~4.4 GB/s, which prices an L2 read for any model by its KV bytes per token.
L2_READ_MS_PER_TOKEN = 56.0 / 1900.0
L2_GBPS = 1900 * 131072 / 0.056 / 1e9


def l2_read_ms_per_token(kv_bytes_per_token: int | None, gbps: float = L2_GBPS) -> float:
    """Milliseconds to read one token's KV from L2 at ``gbps`` (the seed's 56 ms per 1,900 tokens without a size).

    >>> round(l2_read_ms_per_token(131072), 4), round(l2_read_ms_per_token(None), 4)
    (0.0295, 0.0295)
    """
    if not kv_bytes_per_token:
        return L2_READ_MS_PER_TOKEN
    return kv_bytes_per_token / (gbps * 1e9) * 1000.0


ROUTINGS = ("round_robin", "prefix_aware")


@dataclass(frozen=True)
class AnalyzeSettings:
    """What to simulate. Capacities are bytes; they need ``kv_bytes_per_token`` to become chunks."""

    fingerprint: str
    chunk_tokens: int = 256
    replicas: int = 4
    l1_bytes: int | None = None
    l2_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    prefill_ms_per_token: float | None = None
    l2_read_ms_per_token: float = L2_READ_MS_PER_TOKEN
    sweep_points: int = 8

    def chunks(self, nbytes: int | None) -> int:
        """A capacity in bytes as whole chunks (0 when not given)."""
        if nbytes is None or not self.kv_bytes_per_token:
            return 0
        return nbytes // (self.kv_bytes_per_token * self.chunk_tokens)


@dataclass
class AnalyzeReport:
    """Everything ``preheat analyze`` prints; ``to_dict`` is the ``--json`` document."""

    settings: AnalyzeSettings
    requests: int
    prompt_tokens: int
    unique_chunks: int
    shared_prefix_ratio: float
    reusable_tokens: list[int]
    infinite_shared: CacheResult
    infinite_per_replica: dict[str, CacheResult]
    configured: dict[str, CacheResult] | None
    sweep: list[dict[str, float | int]]
    recommendation: list[str] = field(default_factory=list)

    def saved_seconds(self, result: CacheResult) -> float | None:
        """Prefill seconds a cache saves over the trace (None without a per-token prefill cost)."""
        cost = self.settings.prefill_ms_per_token
        if cost is None:
            return None
        l2_tokens = result.l2_chunks * result.chunk_tokens
        return (result.hit_tokens * cost - l2_tokens * self.settings.l2_read_ms_per_token) / 1000.0

    def to_dict(self) -> dict[str, object]:
        """The ``--json`` document (keys documented in docs/plan.md)."""
        s = self.settings
        prefill_total = s.prefill_ms_per_token * self.prompt_tokens / 1000.0 if s.prefill_ms_per_token else None

        def tier(result: CacheResult) -> dict[str, object]:
            out: dict[str, object] = dict(result.to_dict())
            saved = self.saved_seconds(result)
            out["prefill_seconds_saved"] = saved
            out["prefill_fraction_saved"] = saved / prefill_total if saved is not None and prefill_total else None
            return out

        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "chunk_tokens": s.chunk_tokens,
            "replicas": s.replicas,
            "unique_chunks": self.unique_chunks,
            "kv_bytes_per_token": s.kv_bytes_per_token,
            "shared_prefix_ratio": self.shared_prefix_ratio,
            "reusable_prefix_tokens": distribution(self.reusable_tokens, s.chunk_tokens),
            "prefill_ms_per_token": s.prefill_ms_per_token,
            "prefill_seconds_total": prefill_total,
            "l2_read_ms_per_token": s.l2_read_ms_per_token,
            "infinite_shared": tier(self.infinite_shared),
            "infinite_per_replica": {name: tier(r) for name, r in self.infinite_per_replica.items()},
            "configured": None
            if self.configured is None
            else {
                "l1_bytes": s.l1_bytes,
                "l2_bytes": s.l2_bytes,
                "l1_chunks": s.chunks(s.l1_bytes),
                "l2_chunks": s.chunks(s.l2_bytes),
                **{name: tier(r) for name, r in self.configured.items()},
            },
            "sweep": self.sweep,
            "recommendation": self.recommendation,
        }


def key_requests(
    requests: Iterable[Request],
    settings: AnalyzeSettings,
    table: KeyTable,
    progress: Callable[[int], None] | None = None,
) -> list[KeyedRequest]:
    """Each request's cacheable chunk keys (the cache's and router's own key function), interned."""
    out = []
    chunk = settings.chunk_tokens
    for request in requests:
        ids = request.token_ids or []
        keys = chunk_keys(settings.fingerprint, ids, chunk, limit=cacheable_chunks(len(ids), chunk))
        out.append(KeyedRequest(table.intern(keys), len(ids)))
        if progress is not None and len(out) % 1024 == 0:
            progress(len(out))
    return out


def analyze(keyed: list[KeyedRequest], settings: AnalyzeSettings, unique_chunks: int) -> AnalyzeReport:
    """The report for a keyed trace (see ``key_requests``)."""
    chunk, replicas = settings.chunk_tokens, settings.replicas
    reusable = [n * chunk for n in reusable_chunks(keyed)]
    prompt_tokens = sum(r.tokens for r in keyed)
    routes = {
        "round_robin": route_round_robin(keyed, replicas),
        "prefix_aware": route_prefix_aware(keyed, replicas),
    }

    def run(route: str, l1: int, l2: int = 0) -> CacheResult:
        return simulate_lru(keyed, routes[route], replicas, l1_chunks=l1, l2_chunks=l2, chunk_tokens=chunk)

    shared = simulate_lru(keyed, [0] * len(keyed), 1, l1_chunks=UNBOUNDED, chunk_tokens=chunk)
    per_replica = {name: run(name, UNBOUNDED) for name in ROUTINGS}
    l1, l2 = settings.chunks(settings.l1_bytes), settings.chunks(settings.l2_bytes)
    configured = {name: run(name, l1, l2) for name in ROUTINGS} if (l1 or l2) else None
    sweep = []
    for capacity in capacity_sweep(unique_chunks, settings.sweep_points):
        point: dict[str, float | int] = {"capacity_chunks": capacity}
        if settings.kv_bytes_per_token:
            point["capacity_bytes"] = capacity * chunk * settings.kv_bytes_per_token
        for name in ROUTINGS:
            point[f"{name}_l1"] = run(name, capacity).hit_rate
        point["shared_l2"] = run("round_robin", 0, capacity).hit_rate
        sweep.append(point)
    report = AnalyzeReport(
        settings=settings,
        requests=len(keyed),
        prompt_tokens=prompt_tokens,
        unique_chunks=unique_chunks,
        shared_prefix_ratio=sum(reusable) / prompt_tokens if prompt_tokens else 0.0,
        reusable_tokens=reusable,
        infinite_shared=shared,
        infinite_per_replica=per_replica,
        configured=configured,
        sweep=sweep,
    )
    report.recommendation = recommend(report)
    return report


def distribution(values: list[int], chunk_tokens: int) -> dict[str, object]:
    """Percentiles and a histogram (bins: 0, then powers of two times the chunk size) of reusable prefix lengths."""
    if not values:
        return {"mean": 0.0, "p50": 0, "p90": 0, "p99": 0, "max": 0, "histogram": []}
    ordered = sorted(values)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    bins: list[dict[str, int]] = [{"from": 0, "to": 0, "requests": ordered.count(0)}]
    low = chunk_tokens
    while low <= ordered[-1]:
        high = low * 2 - 1
        bins.append({"from": low, "to": high, "requests": sum(1 for v in ordered if low <= v <= high)})
        low *= 2
    return {
        "mean": sum(values) / len(values),
        "p50": pct(0.50),
        "p90": pct(0.90),
        "p99": pct(0.99),
        "max": ordered[-1],
        "histogram": bins,
    }


def recommend(report: AnalyzeReport) -> list[str]:
    """Plain-language advice from the report's numbers (the rules are in docs/plan.md)."""
    s = report.settings
    ratio = report.shared_prefix_ratio
    rr = report.infinite_per_replica["round_robin"].hit_rate
    pa = report.infinite_per_replica["prefix_aware"].hit_rate
    shared = report.infinite_shared.hit_rate
    advice = []
    if ratio < 0.10:
        advice.append(
            f"Little prefix sharing ({ratio:.0%} of prompt tokens): a KV cache tier will not pay for itself here; "
            "spend on cold start (weights, node cache, warm replicas) instead."
        )
    elif ratio < SHARED_L2_THRESHOLD:
        advice.append(
            f"Moderate prefix sharing ({ratio:.0%}, below the ~40% where a shared L2 usually pays off): a host-DRAM "
            f"L1 per replica with prefix-aware routing reaches {pa:.0%} of prompt tokens; a shared L2 could add at "
            f"most {max(shared - pa, 0.0):.0%} more."
        )
    else:
        advice.append(
            f"High prefix sharing ({ratio:.0%} of prompt tokens, above the ~40% rule of thumb): a shared L2 every "
            f"replica mounts is worth it; it serves up to {shared:.0%} of prompt tokens from cache."
        )
    if s.replicas > 1 and pa - rr >= 0.05:
        advice.append(
            f"Route by prefix: with {s.replicas} replicas, prefix-aware routing lifts the per-replica hit rate from "
            f"{rr:.0%} (round-robin) to {pa:.0%}."
        )
    if s.prefill_ms_per_token is not None and s.l2_read_ms_per_token >= s.prefill_ms_per_token:
        advice.append(
            f"On this model, reading a token's KV from L2 ({s.l2_read_ms_per_token:.4f} ms) costs more than "
            f"recomputing it ({s.prefill_ms_per_token:.4f} ms): an L2 tier only pays off for larger models or "
            "faster storage."
        )
    if report.configured is not None:
        got = report.configured["prefix_aware"].hit_rate
        if shared > 0 and got < 0.9 * shared:
            need = next((p for p in report.sweep if float(p["shared_l2"]) >= 0.9 * shared), None)
            where = ""
            if need is not None and "capacity_bytes" in need:
                where = f"; a shared L2 of {format_bytes(float(need['capacity_bytes']))} reaches 90% of it"
            advice.append(
                f"The configured tiers serve {got:.0%} of prompt tokens of the {shared:.0%} an unbounded cache "
                f"would{where}."
            )
        saved = report.saved_seconds(report.configured["prefix_aware"])
        if saved is not None and report.requests:
            advice.append(
                f"Estimated prefill saved with the configured tiers and prefix-aware routing: {saved:.1f} s over the "
                f"trace ({saved / report.requests * 1000:.1f} ms per request)."
            )
    elif s.prefill_ms_per_token is not None and report.requests:
        saved = report.saved_seconds(report.infinite_per_replica["prefix_aware"]) or 0.0
        advice.append(
            f"An unbounded L1 per replica with prefix-aware routing would save {saved:.1f} s of prefill "
            f"({saved / report.requests * 1000:.1f} ms per request); pass --l1/--l2 to size real tiers."
        )
    return advice
