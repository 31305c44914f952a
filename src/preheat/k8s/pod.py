"""A pod's start before preheat's process ran, as cold-start stages (pure: the Pod and its Events as the API server
sends them, in; stages in epoch seconds, out).

From the pod's creation (the timeline's origin) to the container's start:

- ``scheduling``: creation → the ``PodScheduled`` condition (or the scheduler's ``Scheduled`` event, whose time has
  microseconds): waiting for a node, node provisioning included (Karpenter, cluster-autoscaler);
- ``pod_setup``: scheduled → the kubelet starts pulling the image (sandbox, network, volumes, init containers);
- ``image_pull``: ``Pulling`` → ``Pulled`` for this container (an instant when the image was already on the node);
- ``container_start``: pulled → the container's ``state.running.startedAt`` (created and started by the runtime).

Kubernetes keeps most of these times to the second (``detail.resolution_s``), so a boundary may sit up to a second
early. What cannot be read is never guessed: a span whose two ends are known but whose inner boundaries are not
becomes one ``platform`` stage whose ``detail.unknown`` names the stages inside it and ``detail.why`` says why;
when even the ends are unknown, nothing is recorded but ``unknown`` and ``why``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

POD_STAGES = ("scheduling", "pod_setup", "image_pull", "container_start")
PULLED_IN = re.compile(r"Successfully pulled image \"[^\"]*\" in ([0-9.]+)(ms|s)\b")


@dataclass(frozen=True)
class PodStage:
    """One stage, in epoch seconds."""

    name: str
    start: float
    end: float
    detail: dict[str, Any] = field(default_factory=dict)  # Any: JSON values for the timeline's detail


@dataclass(frozen=True)
class PodStart:
    """What the pod says of this replica's start: ``origin`` (its creation, epoch seconds; None when unknown), the
    stages known, the ``unknown`` ones and ``why`` they are."""

    origin: float | None
    stages: tuple[PodStage, ...] = ()
    unknown: tuple[str, ...] = ()
    why: str | None = None
    pod: str = ""


def parse_time(value: object) -> float | None:
    """RFC 3339 (``2026-12-01T10:00:03Z``, or with microseconds) as epoch seconds; None for anything else.

    >>> parse_time("2026-12-01T10:00:03.250000Z") - parse_time("2026-12-01T10:00:03Z")
    0.25
    """
    if not isinstance(value, str) or not value:
        return None
    text = value.replace("Z", "+00:00").replace("z", "+00:00")
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _get(obj: object, *path: str) -> object:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _objects(value: object) -> list[Mapping[str, object]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def _event_time(event: Mapping[str, object], last: bool = False) -> float | None:
    """An event's time: ``eventTime`` (microseconds) when set, else its first (or ``last``) occurrence's."""
    precise = parse_time(event.get("eventTime"))
    if precise is not None:
        return precise
    first, latest = parse_time(event.get("firstTimestamp")), parse_time(event.get("lastTimestamp"))
    return (latest or first) if last else (first or latest)


def container_name(pod: Mapping[str, object], wanted: str | None = None) -> str | None:
    """``wanted`` when the pod has that container, else its first container's name (preheat's, by convention)."""
    names = [c.get("name") for c in _objects(_get(pod, "spec", "containers"))]
    if wanted in names:
        return wanted
    return names[0] if names and isinstance(names[0], str) else None


def pod_start(
    pod: Mapping[str, object],  # the API server's JSON, read path by path (_get) and checked as it is read
    events: Sequence[Mapping[str, object]] | None,
    *,
    container: str | None = None,
    events_why: str | None = None,
) -> PodStart:
    """The stages of ``pod``'s start for ``container`` (default: its first); ``events`` None when they could not be
    read (``events_why`` says why).

    A container that restarted is not the start the pod's times describe: then nothing is known.
    """
    name = f"{_get(pod, 'metadata', 'namespace')}/{_get(pod, 'metadata', 'name')}"
    created = parse_time(_get(pod, "metadata", "creationTimestamp"))
    if created is None:
        return PodStart(None, unknown=POD_STAGES, why=f"pod {name} has no creationTimestamp", pod=name)
    chosen = container_name(pod, container)
    status = next((s for s in _objects(_get(pod, "status", "containerStatuses")) if s.get("name") == chosen), None)
    restarts = status.get("restartCount") if status is not None else None
    if isinstance(restarts, int) and restarts > 0:
        restarted = f"container {chosen} restarted {restarts} time(s): the pod's times describe its first start"
        return PodStart(None, unknown=POD_STAGES, why=restarted, pod=name)
    started = parse_time(_get(status, "state", "running", "startedAt"))
    condition = next((c for c in _objects(_get(pod, "status", "conditions")) if c.get("type") == "PodScheduled"), None)
    scheduled = (
        parse_time(condition.get("lastTransitionTime")) if condition and condition.get("status") == "True" else None
    )
    node = _get(pod, "spec", "nodeName")
    mine = _container_events(events or (), chosen)
    scheduled_event = next((e for e in events or () if e.get("reason") == "Scheduled"), None)
    if scheduled_event is not None and parse_time(scheduled_event.get("eventTime")) is not None:
        scheduled = parse_time(scheduled_event.get("eventTime"))  # microseconds, where the condition has seconds
    known: list[tuple[str, float | None, dict[str, object]]] = [("created", created, {})]
    known.append(("scheduled", scheduled, {"node": node} if isinstance(node, str) else {}))
    pulling, pulled = mine.get("Pulling"), mine.get("Pulled")
    pull_detail: dict[str, object] = {}
    if pulled is not None:
        message = str(pulled.get("message") or "")
        pull_detail["cache"] = "present" if "already present" in message else "miss"
        if match := PULLED_IN.search(message):
            seconds = float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)
            pull_detail["pull_s"] = seconds  # the kubelet's own measure, finer than the events' seconds
        if pulling is None and pull_detail["cache"] == "present":
            pulling = pulled
    pull_start = _event_time(pulling) if pulling is not None else None
    pull_end = _event_time(pulled, last=True) if pulled is not None else None
    known.append(("pull_started", pull_start, {}))
    known.append(("pulled", pull_end, pull_detail))
    known.append(("started", started, {"container": chosen}))
    why: str | None = (
        events_why if events is None else f"no image events for container {chosen} (events expire after an hour)"
    )
    return PodStart(created, *_stages(known, why), pod=name)


def _container_events(
    events: Sequence[Mapping[str, object]], container: str | None
) -> dict[str, Mapping[str, object]]:
    """This container's kubelet events by reason (the last of each)."""
    field_path = f"spec.containers{{{container}}}"
    out: dict[str, Mapping[str, object]] = {}
    for event in sorted(events, key=lambda e: _event_time(e) or 0.0):
        if _get(event, "involvedObject", "fieldPath") == field_path:
            out[str(event.get("reason"))] = event
    return out


# Each stage runs from one boundary to the next: (stage, from, to).
SPANS = (
    ("scheduling", "created", "scheduled"),
    ("pod_setup", "scheduled", "pull_started"),
    ("image_pull", "pull_started", "pulled"),
    ("container_start", "pulled", "started"),
)


def _stages(
    boundaries: list[tuple[str, float | None, dict[str, object]]], why: str | None
) -> tuple[tuple[PodStage, ...], tuple[str, ...], str | None]:
    """Stages between known boundaries; runs of unknown ones between two known boundaries become ``platform``."""
    at = {name: when for name, when, _ in boundaries}
    details = {name: detail for name, _, detail in boundaries}
    stages: list[PodStage] = []
    unknown: list[str] = []
    pending: list[str] = []  # unknown stages since the last known boundary
    last_at = at["created"]
    assert last_at is not None  # the caller returned early without a creation time
    for stage, _, end in SPANS:
        pending.append(stage)
        when = at[end]
        if when is None:
            continue
        when = max(when, last_at)  # times to the second can tie or cross: order is what the pod went through
        detail = {**details[end], "resolution_s": 1}
        if len(pending) == 1:
            stages.append(PodStage(stage, last_at, when, detail))
        else:
            stages.append(PodStage("platform", last_at, when, {"unknown": list(pending), "why": why, **detail}))
            unknown += pending
        pending, last_at = [], when
    unknown += pending
    return tuple(stages), tuple(unknown), why if unknown else None
