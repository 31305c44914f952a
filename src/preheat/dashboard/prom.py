"""A reader of the Prometheus text exposition format (0.0.4), enough for preheat's own ``/metrics``: sans I/O.

Only samples are read (``# HELP``/``# TYPE`` lines are skipped); histograms come out as their ``_bucket``/``_sum``/
``_count`` series, as written.

>>> parse('# TYPE x_total counter\\nx_total{tier="l1"} 3.0\\nx_total{tier="l2"} 1\\n')
{'x_total': [({'tier': 'l1'}, 3.0), ({'tier': 'l2'}, 1.0)]}
"""

from __future__ import annotations

import math
import re

Metrics = dict[str, list[tuple[dict[str, str], float]]]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse(text: str) -> Metrics:
    """Every sample of ``text`` by metric name; lines that are not samples are skipped (a scrape of another kind of
    server must not break the dashboard)."""
    out: Metrics = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        found = _LINE.match(line)
        if found is None:
            continue
        name, raw_labels, raw_value = found.groups()
        try:
            value = float(raw_value)
        except ValueError:
            continue
        labels = {key: re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], val)
                  for key, val in _LABEL.findall(raw_labels or "")}  # fmt: skip
        out.setdefault(name, []).append((labels, value))
    return out


def total(metrics: Metrics, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels``; None when there is none."""
    values = [v for got, v in metrics.get(name, []) if all(got.get(k) == want for k, want in labels.items())]
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) if finite else None


def by_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed by the value of ``label`` (samples without it are left out)."""
    out: dict[str, float] = {}
    for labels, value in metrics.get(name, []):
        if label in labels and math.isfinite(value):
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out
