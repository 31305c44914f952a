"""A replica on Kubernetes dates its timeline from its pod's creation (``PREHEAT_POD_NAME`` and
``PREHEAT_POD_NAMESPACE``, from the downward API), with the stages before its process started (k8s/pod.py).

Off the critical path: the reads run on their own daemon thread once the replica is ready (or on standby, or
failed; at the latest after ``SETTLE_SECONDS``), since importing the client alone takes half a second of CPU that a
cold start should not share. Each read is bounded (``READ_SECONDS``); what they find is put on the timeline: the
origin moves back to the pod's creation (every stage recorded so far moves with it) and the pod's stages go in
front. A failure (no RBAC, no API server, no client installed) is recorded as a ``pod`` mark saying what is unknown
and why, and never stops or slows the start.

The service account needs ``get`` on pods and ``list`` on events (core API group) in its namespace; without the
events, ``scheduling`` is still known, and the rest is one ``platform`` stage labelled unknown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from preheat.core import env as envs
from preheat.core.errors import ConfigError
from preheat.core.jsonsafe import load_object
from preheat.core.timeline import Timeline
from preheat.k8s.client import api_client, api_status, kubernetes_module
from preheat.k8s.pod import POD_STAGES, PodStart, pod_start

log = logging.getLogger("preheat.k8s")
READ_SECONDS = 5.0  # each API read; the start never waits for them
MAX_ANSWER_BYTES = 16 * 1024 * 1024  # a pod, or its events: tens of kB
SETTLE_SECONDS = 600.0  # the longest the reads wait for the start to settle
SETTLED = ("ready", "standby", "failed")  # marks after which the replica's start is over
ORIGIN_SOURCE = "pod creation"


class _Response(Protocol):
    """urllib3's response, as the client returns it with ``_preload_content=False``."""

    data: bytes

    def release_conn(self) -> None: ...


def read_pod_start(namespace: str, name: str, env: Mapping[str, str] | None = None) -> PodStart:
    """Read the pod and its events and return its start; never raises (what failed is in ``why``)."""
    where = f"pod {namespace}/{name}"
    try:
        kubernetes = kubernetes_module()
        core = kubernetes.client.CoreV1Api(api_client(env))
        pod = _json(core.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=READ_SECONDS))
    except ConfigError as exc:
        return PodStart(None, unknown=POD_STAGES, why=str(exc), pod=f"{namespace}/{name}")
    except Exception as exc:  # any failure of the client or the network: the stages are unknown, the start goes on
        why = _why(exc, f"get {where}", "get on pods")
        return PodStart(None, unknown=POD_STAGES, why=why, pod=f"{namespace}/{name}")
    events: list[dict[str, object]] | None = None
    events_why = None
    try:
        answer = _json(
            core.list_namespaced_event(
                namespace,
                field_selector=f"involvedObject.name={name},involvedObject.kind=Pod",
                _preload_content=False,
                _request_timeout=READ_SECONDS,
            )
        )
        items = answer.get("items")
        events = [e for e in items if isinstance(e, dict)] if isinstance(items, list) else []
    except Exception as exc:  # as above: the pod's own times still count
        events_why = _why(exc, f"list the events of {where}", "list on events")
    chosen = envs.get(envs.CONTAINER_NAME, env)  # optional: which of the pod's containers is preheat
    return pod_start(pod, events, container=chosen, events_why=events_why)


def _json(response: _Response) -> dict[str, object]:
    try:
        # Bounded as any answer from the network; a refusal (a ValueError) leaves the stages unknown, as any failure.
        return load_object(response.data, max_bytes=MAX_ANSWER_BYTES)
    finally:
        response.release_conn()


def _why(exc: BaseException, what: str, rule: str) -> str:
    status = api_status(exc)
    if status in (401, 403):
        return f"cannot {what} ({status}): the service account needs {rule} in its namespace"
    return f"cannot {what}: {type(exc).__name__}: {exc}".splitlines()[0]


def apply_pod_start(timeline: Timeline, start: PodStart) -> None:
    """Put ``start`` on ``timeline``: the origin moves to the pod's creation and its stages go in front (the
    ``platform`` stage ``PREHEAT_T0`` made, now covered by them, is dropped); else a ``pod`` mark with what is
    unknown and why."""
    if start.origin is None:
        timeline.add("pod", 0.0, 0.0, pod=start.pod, unknown=list(start.unknown), why=start.why)
        log.warning("timeline: the stages before the process started are unknown: %s", start.why)
        return
    timeline.rebase(start.origin, ORIGIN_SOURCE)
    timeline.discard("platform")
    for stage in start.stages:
        timeline.add(stage.name, stage.start - start.origin, stage.end - start.origin, **stage.detail)
    if start.unknown:
        log.warning("timeline: %s unknown: %s", ", ".join(start.unknown), start.why)


def record_pod_start(
    timeline: Timeline, env: Mapping[str, str] | None = None, *, settle: float = SETTLE_SECONDS
) -> threading.Thread | None:
    """With ``PREHEAT_POD_NAME`` and ``PREHEAT_POD_NAMESPACE`` set, read the pod on a daemon thread once ``timeline``
    has a ``SETTLED`` mark (or after ``settle`` seconds) and put its start on it (returns the thread; None without
    them)."""
    name, namespace = envs.get(envs.POD_NAME, env), envs.get(envs.POD_NAMESPACE, env)
    if not name or not namespace:
        return None

    def read() -> None:
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline and not any(s.name in SETTLED for s in timeline.stages()):
            time.sleep(0.25)
        apply_pod_start(timeline, read_pod_start(namespace, name, env))

    thread = threading.Thread(target=read, name="preheat pod timeline", daemon=True)
    thread.start()
    return thread
