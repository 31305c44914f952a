"""Prometheus metrics in the text exposition format (version 0.0.4), hand-written: no client library to import.

``ServerMetrics`` holds every series ``/metrics`` serves (docs/server.md lists them); the three primitives below
are thread-safe, because request threads and the generation worker update them concurrently.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from preheat.timeline import Stage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = tuple[tuple[str, str], ...]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def _format_labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = [*labels, *([extra] if extra else [])]
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped, strict=True)) + "}"


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it: integers without a fraction, infinities as +Inf/-Inf."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A monotonically increasing count, per label set (``name`` should end in ``_total``)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = _labels(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(_labels(labels), 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        return [f"{self.name}{_format_labels(k)} {format_value(v)}" for k, v in items]


class Gauge(_Metric):
    """A value that goes up and down; ``source`` (when given) is asked for the current values at scrape time."""

    kind = "gauge"

    def __init__(
        self, name: str, help_text: str, source: Callable[[], Iterable[tuple[Mapping[str, str], float]]] | None = None
    ) -> None:
        super().__init__(name, help_text)
        self._values: dict[Labels, float] = {}
        self._source = source

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[_labels(labels)] = value

    def lines(self) -> list[str]:
        with self._lock:
            values = dict(self._values)
        if self._source is not None:
            values.update((_labels(labels), value) for labels, value in self._source())
        return [f"{self.name}{_format_labels(k)} {format_value(v)}" for k, v in sorted(values.items())]


class Histogram(_Metric):
    """Observations counted into cumulative ``le`` buckets, plus their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def lines(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            running += n
            out.append(f"{self.name}_bucket{_format_labels((), ('le', format_value(bound)))} {running}")
        out += [f"{self.name}_sum {format_value(total)}", f"{self.name}_count {running}"]
        return out


def exposition(metrics: Iterable[_Metric], extra: Iterable[Callable[[], list[str]]] = ()) -> str:
    """Prometheus text for ``metrics`` (one ``# HELP``/``# TYPE`` block each, empty ones left out), then the lines
    of each ``extra`` renderer."""
    lines: list[str] = []
    for metric in metrics:
        body = metric.lines()
        if body:
            lines += metric.header() + body
    for render in extra:
        lines += render()
    return "\n".join(lines) + "\n"


class ServerMetrics:
    """Every series of ``GET /metrics``. ``stages`` and ``load`` are read at scrape time (timeline, queue)."""

    def __init__(
        self,
        stages: Callable[[], list[Stage]],
        load: Callable[[], tuple[int, int]],  # (requests waiting, requests generating)
    ) -> None:
        self._stages, self._load = stages, load
        # Renderers of extra series (the KV tiers' per-tier counters), each returning finished exposition lines.
        self.extra: list[Callable[[], list[str]]] = []
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
        self._all: list[_Metric] = [
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

    def _stage_durations(self) -> list[tuple[Mapping[str, str], float]]:
        return [({"stage": s.name}, s.end - s.start) for s in self._stages() if s.end is not None and s.end != s.start]

    def _queue(self, which: int) -> list[tuple[Mapping[str, str], float]]:
        no_labels: Mapping[str, str] = {}
        return [(no_labels, float(self._load()[which]))]

    def _ready(self) -> list[tuple[Mapping[str, str], float]]:
        no_labels: Mapping[str, str] = {}
        return [(no_labels, float(s.start)) for s in self._stages() if s.name == "ready"][:1]

    def render(self) -> str:
        """The whole exposition, one ``# HELP``/``# TYPE`` block per metric."""
        return exposition(self._all, self.extra)
