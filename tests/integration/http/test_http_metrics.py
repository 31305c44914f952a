"""Prometheus exposition without sockets: what a scraper reads from ``/metrics`` (names, labels, HELP/TYPE, values)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from preheat.core.timeline import Stage
from preheat.http.metrics import Counter, Family, Gauge, Histogram, render
from preheat.server.metrics import ServerMetrics


def test_histogram_buckets_are_cumulative() -> None:
    histogram = Histogram("h_seconds", "help", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 5.0):
        histogram.observe(value)
    lines = render([histogram]).splitlines()
    assert lines[:2] == ["# HELP h_seconds help", "# TYPE h_seconds histogram"]
    assert sorted(lines[2:]) == sorted(
        [
            'h_seconds_bucket{le="0.1"} 2.0',
            'h_seconds_bucket{le="1.0"} 3.0',
            'h_seconds_bucket{le="+Inf"} 4.0',
            "h_seconds_sum 5.65",
            "h_seconds_count 4.0",
        ]
    )


def test_label_values_are_escaped() -> None:
    counter = Counter("c_total", "help")
    counter.inc(endpoint='a"b\\c\nd')
    assert 'c_total{endpoint="a\\"b\\\\c\\nd"} 1.0' in render([counter]).splitlines()


def test_a_counter_is_zero_before_its_first_count_and_keeps_its_total_name() -> None:
    text = render([Counter("jobs_total", "Jobs done.")])
    assert text.splitlines() == ["# HELP jobs_total Jobs done.", "# TYPE jobs_total counter", "jobs_total 0.0"]


def test_a_counter_forgets_the_series_of_one_label_value() -> None:
    counter = Counter("requests_total", "Requests.")
    counter.inc(replica="a", status="200")
    counter.inc(replica="a", status="503")
    counter.inc(replica="b", status="200")
    counter.forget(replica="a")
    assert counter.family().samples == [({"replica": "b", "status": "200"}, 1.0)]


def test_a_counter_name_must_end_in_total() -> None:
    with pytest.raises(ValueError, match="_total"):
        Counter("jobs", "Jobs done.")


def test_a_gauge_with_nothing_to_show_is_left_out() -> None:
    assert render([Gauge("nothing", "Never set.")]) == ""


def test_families_computed_at_scrape_time_follow_the_series() -> None:
    up = Family("tier_up", "1 when usable.", "gauge", [({"tier": "l2"}, 0.0), ({"tier": "l1"}, 1.0)])
    text = render([Counter("a_total", "A.")], [lambda: [up]])
    assert text.index("a_total") < text.index("tier_up")
    assert 'tier_up{tier="l1"} 1.0' in text
    assert 'tier_up{tier="l2"} 0.0' in text


def test_stage_durations_come_from_the_timeline() -> None:
    stages = [
        Stage("weight_load", 1.0, 1.5),
        Stage("ready", 2.0, 2.0),
        Stage("warmup", 1.5, None),  # still running: not a duration yet
    ]
    text = ServerMetrics(lambda: stages, lambda: (2, 1)).render()
    assert 'preheat_load_stage_seconds{stage="weight_load"} 0.5' in text
    assert "warmup" not in text
    assert "preheat_time_to_ready_seconds 2.0" in text
    assert "preheat_queue_depth 2.0" in text
    assert "preheat_requests_running 1.0" in text


def test_importing_the_server_does_not_import_prometheus_client() -> None:
    # preheat serve binds before it imports anything heavy: the library is loaded on the first scrape.
    code = "import sys, preheat.server.app; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
