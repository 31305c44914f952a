"""A pod's start, from its Pod and Events as the API server sends them (tests/data/k8s/), into the stages before
preheat's process ran: scheduling, pod setup, image pull, container start. What cannot be read is labelled unknown,
never guessed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from k8sapi import fixture
from preheat.core.timeline import Timeline
from preheat.k8s.pod import POD_STAGES, PodStart, parse_time, pod_start
from preheat.k8s.pod_timeline import apply_pod_start

CREATED = parse_time("2026-12-01T10:00:00Z")


def spans(start: PodStart) -> list[tuple[str, float, float]]:
    assert start.origin is not None
    return [(s.name, round(s.start - start.origin, 6), round(s.end - start.origin, 6)) for s in start.stages]


def test_a_recorded_pods_start_becomes_its_four_stages_from_creation() -> None:
    start = pod_start(fixture("pod-starting.json"), fixture("pod-events.json")["items"])
    assert start.origin == CREATED
    assert spans(start) == [
        ("scheduling", 0.0, 91.120873),  # the scheduler's event has microseconds; Karpenter made the node meanwhile
        ("pod_setup", 91.120873, 93.0),
        ("image_pull", 93.0, 138.0),
        ("container_start", 138.0, 139.0),
    ]
    assert start.unknown == ()
    assert start.why is None
    by_name = {s.name: s.detail for s in start.stages}
    assert by_name["scheduling"]["node"] == "gpu-node-a"
    assert by_name["image_pull"]["cache"] == "miss"
    assert by_name["image_pull"]["pull_s"] == 44.718  # the kubelet's own measure, finer than the events'
    assert by_name["container_start"]["container"] == "preheat"


def test_an_image_already_on_the_node_is_an_instant_pull() -> None:
    pod: dict[str, Any] = fixture("pod-starting.json")
    pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = "2026-12-01T10:01:34Z"
    start = pod_start(pod, fixture("pod-events-image-present.json")["items"])
    pull = next(s for s in start.stages if s.name == "image_pull")
    assert (pull.start, pull.end, pull.detail["cache"]) == (pull.start, pull.start, "present")
    assert [s.name for s in start.stages] == ["scheduling", "pod_setup", "image_pull", "container_start"]


def test_without_events_the_span_after_scheduling_is_one_platform_stage_labelled_unknown() -> None:
    why = "cannot list the events of pod llm/x (403): the service account needs list on events in its namespace"
    start = pod_start(fixture("pod-starting.json"), None, events_why=why)
    assert spans(start) == [("scheduling", 0.0, 91.0), ("platform", 91.0, 139.0)]  # the condition: to the second
    platform = start.stages[1].detail
    assert platform["unknown"] == ["pod_setup", "image_pull", "container_start"]
    assert platform["why"] == why
    assert start.unknown == ("pod_setup", "image_pull", "container_start")


def test_a_container_not_started_yet_leaves_its_last_stages_unknown() -> None:
    pod: dict[str, Any] = fixture("pod-starting.json")
    pod["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ContainerCreating"}}
    start = pod_start(pod, fixture("pod-events.json")["items"])
    assert [s.name for s in start.stages] == ["scheduling", "pod_setup", "image_pull"]
    assert start.unknown == ("container_start",)


def test_a_restarted_container_claims_nothing_of_the_pods_start() -> None:
    pod: dict[str, Any] = copy.deepcopy(fixture("pod-starting.json"))
    pod["status"]["containerStatuses"][0]["restartCount"] = 2
    start = pod_start(pod, fixture("pod-events.json")["items"])
    assert start.origin is None
    assert start.unknown == POD_STAGES
    assert start.why is not None
    assert "restarted 2 time(s)" in start.why


@pytest.mark.parametrize("value", [None, "", "yesterday", 12])
def test_unreadable_times_are_unknown(value: object) -> None:
    assert parse_time(value) is None


def test_the_pods_start_moves_the_timelines_origin_and_keeps_what_was_recorded() -> None:
    start = pod_start(fixture("pod-starting.json"), fixture("pod-events.json")["items"])
    assert CREATED is not None
    process = CREATED + 140.0  # the process started a second after the container (interpreter, imports)
    timeline = Timeline(process)
    timeline.add("imports", 0.0, 0.5)
    apply_pod_start(timeline, start)
    data = timeline.to_dict()
    assert (data["origin"], data["origin_source"]) == (CREATED, "pod creation")
    names = [(s["name"], s["start"], s["end"]) for s in data["stages"]]
    assert names[-1] == ("imports", 140.0, 140.5)
    assert [n for n, _, _ in names] == ["scheduling", "pod_setup", "image_pull", "container_start", "imports"]


def test_an_unreadable_pod_is_a_mark_saying_why_and_the_origin_stays() -> None:
    timeline = Timeline(1000.0)
    apply_pod_start(timeline, PodStart(None, unknown=POD_STAGES, why="no API", pod="llm/x"))
    data = timeline.to_dict()
    assert (data["origin"], data["origin_source"]) == (1000.0, "process start")
    assert data["stages"] == [
        {
            "name": "pod",
            "start": 0.0,
            "end": 0.0,
            "detail": {"pod": "llm/x", "unknown": list(POD_STAGES), "why": "no API"},
        }
    ]
