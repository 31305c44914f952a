"""A real ``preheat serve`` replica told its pod (``PREHEAT_POD_NAME``/``PREHEAT_POD_NAMESPACE``, as the downward
API sets them) reads it from a fake API server (tests/k8sapi.py) through the official client: its timeline starts at
the pod's creation and shows the stages before the process started; without the RBAC to read them they are labelled
unknown, and the replica starts all the same."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from k8sapi import FakeAPIServer, fixture
from preheat.core.timeline import Timeline, TimelineDocument
from preheat.k8s.pod import parse_time
from preheat.k8s.pod_timeline import apply_pod_start, read_pod_start
from preheat.router.cluster import ServerProcess
from routing import wait_until
from serving import Client

pytest.importorskip("kubernetes")

TIMES = ("creationTimestamp", "lastTransitionTime", "startedAt", "firstTimestamp", "lastTimestamp", "eventTime",
         "startTime")  # fmt: skip
POD = "preheat-replica-6d9f7c8b5-2lqvx"


def shifted(value: Any, by: float) -> Any:  # Any: JSON
    """The recorded JSON with every timestamp moved ``by`` seconds (so the recorded start ends just now)."""
    if isinstance(value, dict):
        return {k: _moved(v, by) if k in TIMES else shifted(v, by) for k, v in value.items()}
    if isinstance(value, list):
        return [shifted(v, by) for v in value]
    return value


def _moved(value: object, by: float) -> object:
    when = parse_time(value)
    if when is None or not isinstance(value, str):
        return value
    moment = datetime.fromtimestamp(when + by, tz=timezone.utc)
    micro = "." in value
    return moment.strftime("%Y-%m-%dT%H:%M:%S" + (".%fZ" if micro else "Z"))


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeAPIServer]:
    server = FakeAPIServer()
    pod = fixture("pod-starting.json")
    recorded_start = parse_time(pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"])
    assert recorded_start is not None
    by = int(datetime.now(tz=timezone.utc).timestamp()) - 1 - recorded_start  # the container started a second ago
    server.put("pods", shifted(pod, by))
    for event in fixture("pod-events.json")["items"]:
        server.put("events", shifted(event, by))
    server.kubeconfig(tmp_path / "kubeconfig")
    yield server
    server.stop()


def replica(model: Path, api: FakeAPIServer, tmp_path: Path) -> ServerProcess:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"), "PREHEAT_POD_NAME": POD,
           "PREHEAT_POD_NAMESPACE": "llm"}  # fmt: skip
    env.pop("PREHEAT_T0", None)
    server = ServerProcess(str(model), "--max-model-len", "256", env=env)
    server.wait_ready(timeout=120)
    return server


def timeline_once(url: str, stage: str) -> dict[str, Any]:
    """The replica's timeline once ``stage`` is on it (the pod is read on its own thread)."""
    client = Client(url)
    wait_until(lambda: any(s["name"] == stage for s in client.get("/v1/preheat/timeline").json()["stages"]), stage)
    answer: dict[str, Any] = client.get("/v1/preheat/timeline").json()
    return answer


def test_a_replica_dates_its_timeline_from_its_pods_creation(
    tiny_servable_model: Path, api: FakeAPIServer, tmp_path: Path
) -> None:
    with replica(tiny_servable_model, api, tmp_path) as server:
        timeline = timeline_once(server.url, "scheduling")
        shown = subprocess.run(
            [sys.executable, "-m", "preheat", "timeline", server.url], capture_output=True, text=True, check=True
        ).stdout
    assert timeline["origin_source"] == "pod creation"
    assert timeline["origin"] == parse_time(api.objects[("pods", "llm", POD)]["metadata"]["creationTimestamp"])
    names = [s["name"] for s in timeline["stages"]]
    before = ["scheduling", "pod_setup", "image_pull", "container_start"]
    assert names[:4] == before
    assert names.index("imports") > 3  # the process's own stages follow, on the same clock
    assert {"weight_load", "ready"} <= set(names)
    assert "platform" not in names
    for name in [*before, "imports", "weight_load"]:
        assert name in shown
    assert api.count("GET pods") == 1
    assert api.count("LIST events") == 1


# The same reads, in this process (the replica's start was shown above): what each missing RBAC rule leaves unknown.
def read_into_timeline(api: FakeAPIServer, tmp_path: Path) -> TimelineDocument:
    timeline = Timeline()
    apply_pod_start(timeline, read_pod_start("llm", POD, {"KUBECONFIG": str(tmp_path / "kubeconfig")}))
    return timeline.to_dict()


def test_without_rbac_for_events_the_stages_after_scheduling_are_labelled_unknown(
    api: FakeAPIServer, tmp_path: Path
) -> None:
    api.forbid.add("events")
    timeline = read_into_timeline(api, tmp_path)
    assert timeline["origin_source"] == "pod creation"
    stages = {s["name"]: s for s in timeline["stages"]}
    assert list(stages) == ["scheduling", "platform"]
    assert stages["platform"]["detail"]["unknown"] == ["pod_setup", "image_pull", "container_start"]
    assert "list on events" in stages["platform"]["detail"]["why"]


def test_without_rbac_for_its_pod_nothing_is_guessed_and_the_origin_stays(api: FakeAPIServer, tmp_path: Path) -> None:
    api.forbid.add("pods")
    timeline = read_into_timeline(api, tmp_path)
    assert timeline["origin_source"] == "process start"
    [mark] = timeline["stages"]
    assert mark["name"] == "pod"
    assert mark["detail"]["unknown"] == ["scheduling", "pod_setup", "image_pull", "container_start"]
    assert "get on pods" in mark["detail"]["why"]


def test_an_unreachable_api_server_is_unknown_within_the_read_timeout(api: FakeAPIServer, tmp_path: Path) -> None:
    api.stop()
    timeline = read_into_timeline(api, tmp_path)
    [mark] = timeline["stages"]
    assert mark["name"] == "pod"
    assert "cannot get pod llm/" in mark["detail"]["why"]
