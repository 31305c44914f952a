"""A `preheat timeline` JSON becomes the simulator's cold-start phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preheat.core.errors import PlanError
from preheat.core.timeline import Timeline, TimelineDocument
from preheat.plan.coldstart import PHASES, ColdStart
from preheat.timeline.waterfall import Waterfall

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "traces"


def _timeline(*stages: tuple[str, float, float], platform: bool = False) -> TimelineDocument:
    timeline = Timeline(1000.0, origin_source="PREHEAT_T0" if platform else "process start")
    for name, start, end in stages:
        timeline.add(name, start, end)
    timeline.add("ready", stages[-1][2], stages[-1][2])
    timeline.add("first_request_ttft", stages[-1][2] + 1, stages[-1][2] + 1, ttft=0.2)
    return timeline.to_dict()


def test_server_stages_map_onto_phases() -> None:
    data = _timeline(
        ("imports", 0.0, 1.0),
        ("config", 1.0, 1.5),
        ("fetch", 1.5, 31.5),
        ("engine_imports", 31.5, 33.0),
        ("weight_load", 33.0, 43.0),
        ("model_build", 43.0, 45.0),
        ("tokenizer", 45.0, 45.5),
        ("warmup", 45.5, 47.5),
        ("compile", 47.5, 50.0),
    )
    cold = ColdStart.from_timeline(data, provision_s=60.0, image_s=30.0)
    assert cold.phases == pytest.approx(
        {"provision": 60.0, "image": 30.0, "start": 3.0, "download": 30.0, "load": 12.0, "warmup": 2.5, "other": 2.5}
    )
    assert cold.seconds() == pytest.approx(140.0)
    assert cold.seconds(provision=False, download=False) == pytest.approx(50.0)
    assert cold.seconds(load_factor=0.5) == pytest.approx(140.0 - 15.0 - 6.0)


def test_a_measured_platform_stage_replaces_the_image_guess() -> None:
    data = _timeline(("platform", 0.0, 42.0), ("imports", 42.0, 43.0), platform=True)
    cold = ColdStart.from_timeline(data, image_s=999.0, download_s=120.0)
    assert cold.phases["image"] == 42.0
    assert cold.phases["download"] == 120.0


def test_a_pod_timeline_measures_provisioning_and_the_image_pull() -> None:
    data = _timeline(
        ("scheduling", 0.0, 70.0),
        ("pod_setup", 70.0, 72.0),
        ("image_pull", 72.0, 100.0),
        ("container_start", 100.0, 101.0),
        ("imports", 101.0, 102.0),
        platform=True,
    )
    cold = ColdStart.from_timeline(data, provision_s=999.0, image_s=999.0)
    assert cold.phases["provision"] == pytest.approx(70.0)
    assert cold.phases["image"] == pytest.approx(28.0)
    assert cold.phases["start"] == pytest.approx(4.0)


def test_the_shipped_timeline_covers_every_phase_but_other() -> None:
    cold = ColdStart.from_timeline(json.loads((EXAMPLES / "coldstart-8b.json").read_text()))
    assert set(cold.phases) == set(PHASES)
    assert all(cold.phases[p] > 0 for p in PHASES if p != "other")
    assert cold.to_dict()["total"] == pytest.approx(sum(cold.phases.values()))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"stages": "no"}, "not a preheat timeline"),
        ({"stages": [{"name": "x"}]}, "stage 0 is malformed"),
        ({"stages": [{"name": "fetch", "start": 5.0, "end": 1.0}]}, "ends before it starts"),
    ],
)
def test_a_bad_timeline_is_a_plan_error_naming_the_file(data: object, message: str) -> None:
    with pytest.raises(PlanError, match=f"t.json: .*{message}"):
        ColdStart.from_timeline(data, where="t.json")


def test_the_timeline_commands_json_reads_the_same_as_the_servers() -> None:
    served = json.loads((EXAMPLES / "coldstart-8b.json").read_text())
    printed = Waterfall.from_dict(served).to_dict(gpu_cost_per_hour=4.0)  # what `preheat timeline --json` prints
    assert ColdStart.from_timeline(printed) == ColdStart.from_timeline(served)


def test_overlapping_stages_count_once_on_the_critical_path() -> None:
    # preheat serve's start: the tokenizer and page-in run while torch imports; the phases still add up to ready.
    data = _timeline(
        ("imports", 0.0, 0.2),
        ("config", 0.2, 0.25),
        ("engine_imports", 0.25, 1.75),
        ("model_config", 0.25, 0.26),
        ("page_in", 0.26, 0.27),
        ("tokenizer", 0.27, 0.6),
        ("weight_load", 1.75, 1.85),
        ("model_build", 1.85, 1.9),
        ("warmup", 1.9, 2.0),
    )
    cold = ColdStart.from_timeline(data, provision_s=0.0, image_s=0.0)
    assert cold.phases["start"] == pytest.approx(1.75)  # the tokenizer hid behind torch's import
    assert cold.phases["warmup"] == pytest.approx(0.1)
    assert cold.phases["other"] == pytest.approx(0.0)
    assert sum(cold.phases.values()) == pytest.approx(2.0)
    assert cold.standby_seconds(download=False) == pytest.approx(0.25)  # load 0.15 + warmup 0.1
