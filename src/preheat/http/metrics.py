"""Prometheus metrics for preheat's servers: series cheap enough for the request path, written out in the text
exposition format (version 0.0.4) by ``prometheus-client`` when ``/metrics`` is scraped.

The series only hold numbers (thread-safe: request threads and workers update them concurrently). ``render`` turns
them into ``prometheus-client`` metric families, so the text itself (escaping, ``# HELP``/``# TYPE``, ``_bucket`` /
``_sum`` / ``_count``, ``+Inf``) is the library's. The library is imported on the first scrape, not at import: its
exposition module pulls in wsgiref, urllib and more (~20 ms), and ``preheat serve`` is on the cold-start path.

>>> requests = Counter("demo_requests_total", "Requests answered.")
>>> requests.inc(status="200")
>>> print(render([requests]), end="")
# HELP demo_requests_total Requests answered.
# TYPE demo_requests_total counter
demo_requests_total{status="200"} 1.0
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

# prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4, spelled out so that importing this costs nothing.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = tuple[tuple[str, str], ...]
Samples = Sequence[tuple[Mapping[str, str], float]]


@dataclass(frozen=True)
class Family:
    """One metric's values at scrape time: a counter or gauge's ``samples`` (labels, value), or a histogram's
    cumulative ``buckets`` (upper bound, count; the last bound is +inf) and ``total`` (the sum of observations).
    A counter's ``name`` ends in ``_total``."""

    name: str
    help: str
    kind: Literal["counter", "gauge", "histogram"]
    samples: Samples
    buckets: Sequence[tuple[float, int]] = ()
    total: float = 0.0


class Series:
    """A metric that can say what it holds now (``family``)."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self._lock = threading.Lock()

    def family(self) -> Family:
        raise NotImplementedError


class Counter(Series):
    """A monotonically increasing count per label set; ``name`` ends in ``_total``. Shown as 0 before any count."""

    def __init__(self, name: str, help_text: str) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: Prometheus counter names end in _total")
        super().__init__(name, help_text)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def forget(self, **match: str) -> None:
        """Drop every series whose labels include ``match`` (a replica that left the fleet: its series would
        otherwise stay in every scrape forever, one set per pod that ever came and went)."""
        wanted = set(match.items())
        with self._lock:
            self._values = {k: v for k, v in self._values.items() if not wanted <= set(k)}

    def family(self) -> Family:
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        return Family(self.name, self.help, "counter", [(dict(k), v) for k, v in items])


class Gauge(Series):
    """A value that goes up and down; ``source`` (when given) is asked for the current values at scrape time."""

    def __init__(self, name: str, help_text: str, source: Callable[[], Samples] | None = None) -> None:
        super().__init__(name, help_text)
        self._values: dict[Labels, float] = {}
        self._source = source

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[tuple(sorted(labels.items()))] = value

    def family(self) -> Family:
        with self._lock:
            values = dict(self._values)
        if self._source is not None:
            values.update((tuple(sorted(labels.items())), value) for labels, value in self._source())
        return Family(self.name, self.help, "gauge", [(dict(k), v) for k, v in sorted(values.items())])


class Histogram(Series):
    """Observations counted into cumulative ``le`` buckets, plus their sum and count."""

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

    def family(self) -> Family:
        with self._lock:
            counts, total = list(self._counts), self._sum
        running, buckets = 0, []
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            running += n
            buckets.append((bound, running))
        return Family(self.name, self.help, "histogram", [], buckets, total)


def render(series: Iterable[Series], extra: Iterable[Callable[[], list[Family]]] = ()) -> str:
    """The exposition of ``series`` and then of the families each ``extra`` callable returns (series computed at
    scrape time elsewhere: KV tiers, the peer server); a gauge or histogram with nothing to show is left out."""
    families = [s.family() for s in series]
    for more in extra:
        families += more()
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import Collector

    class Scrape(Collector):
        def collect(self) -> Iterator[Metric]:
            return (_to_client(f) for f in families if f.samples or f.buckets)

    return generate_latest(Scrape()).decode()


def _to_client(family: Family) -> Metric:
    """``family`` as a ``prometheus-client`` metric family."""
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    if family.kind == "histogram":
        histogram = HistogramMetricFamily(family.name, family.help, labels=[])
        buckets = [("+Inf" if math.isinf(b) else repr(float(b)), float(n)) for b, n in family.buckets]  # Go's format
        histogram.add_metric([], buckets, family.total)
        return histogram
    names = sorted(family.samples[0][0]) if family.samples else []
    metric: CounterMetricFamily | GaugeMetricFamily
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.help, labels=names)
    else:
        metric = GaugeMetricFamily(family.name, family.help, labels=names)
    for labels, value in family.samples:
        metric.add_metric([labels[name] for name in names], value)
    return metric
