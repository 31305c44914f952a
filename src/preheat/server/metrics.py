"""``preheat serve``'s ``/metrics``: every series it serves (docs/server.md lists them), on the thread-safe series of
``preheat.http.metrics``, which renders them through prometheus-client.
"""

from __future__ import annotations

from collections.abc import Callable

from preheat.core.timeline import Stage
from preheat.http.metrics import Counter, Family, Gauge, Histogram, Samples, Series, render

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """Every series of ``GET /metrics``. ``stages`` and ``load`` are read at scrape time (timeline, queue)."""

    def __init__(
        self,
        stages: Callable[[], list[Stage]],
        load: Callable[[], tuple[int, int]],  # (requests waiting, requests generating)
    ) -> None:
        self._stages, self._load = stages, load
        # Series computed at scrape time elsewhere (the KV tiers' per-tier counters, the peer server).
        self.extra: list[Callable[[], list[Family]]] = []
        self.ttft = Histogram(
            "preheat_time_to_first_token_seconds",
            "Seconds from a generation request's arrival to its first token (queueing included).",
            TTFT_BUCKETS,
        )
        self.latency = Histogram(
            "preheat_request_duration_seconds",
            "Seconds from a generation request's arrival to its end.",
            LATENCY_BUCKETS,
        )
        self.rate = Histogram(
            "preheat_generation_tokens_per_second",
            "Per request: generated tokens after the first, divided by the seconds after the first token.",
            RATE_BUCKETS,
        )
        self.prompt_tokens = Counter("preheat_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.cached_tokens = Counter(
            "preheat_prompt_tokens_cached_total", "Prompt tokens whose KV was reused instead of computed."
        )
        self.generated_tokens = Counter("preheat_generated_tokens_total", "Tokens generated, all requests.")
        self.requests = Counter("preheat_requests_total", "HTTP requests answered, by endpoint and status code.")
        self.finished = Counter(
            "preheat_generations_finished_total",
            "Generations ended, by reason: stop, length, abort (client went away) or error.",
        )
        queue = Gauge("preheat_queue_depth", "Generation requests waiting for the engine.", lambda: self._queue(0))
        running = Gauge("preheat_requests_running", "Generation requests being generated now.", lambda: self._queue(1))
        stage_gauge = Gauge(
            "preheat_load_stage_seconds",
            "Duration of each cold-start stage of this process (GET /v1/preheat/timeline has the full record).",
            self._stage_durations,
        )
        ready = Gauge("preheat_time_to_ready_seconds", "Seconds from the timeline origin to ready.", self._ready)
        self._all: list[Series] = [
            self.ttft,
            self.latency,
            self.rate,
            self.prompt_tokens,
            self.cached_tokens,
            self.generated_tokens,
            self.requests,
            self.finished,
            queue,
            running,
            stage_gauge,
            ready,
        ]

    def _stage_durations(self) -> Samples:
        return [({"stage": s.name}, s.end - s.start) for s in self._stages() if s.end is not None and s.end != s.start]

    def _queue(self, which: int) -> Samples:
        return [({}, float(self._load()[which]))]

    def _ready(self) -> Samples:
        return [({}, float(s.start)) for s in self._stages() if s.name == "ready"][:1]

    def render(self) -> str:
        """The whole exposition, one ``# HELP``/``# TYPE`` block per metric."""
        return render(self._all, self.extra)
