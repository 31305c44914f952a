"""A running replica (its /health, /metrics and /v1/preheat/timeline) or a recorded timeline file. A vLLM replica is
diagnosed too: its own metrics (``kvtiers.analyze_engine``) and the start timeline preheat's vLLM plugin serves.

Read-only GETs with short timeouts, through preheat's own HTTP client; the analysis is in ``coldstart`` (which
stage to fix, with which pattern) and ``kvtiers`` (hit rates, whether L2 pays off).
"""

from __future__ import annotations

import json

from preheat.core.errors import JSONInputError, PlanError, SourceError
from preheat.core.jsonsafe import loads_bounded
from preheat.dashboard.prom import parse
from preheat.dashboard.signals import SGLANG, VLLM, read
from preheat.doctor.check import Check, DoctorOptions
from preheat.doctor.coldstart import analyze_timeline
from preheat.doctor.findings import Finding
from preheat.doctor.kvtiers import analyze_engine, analyze_kv, parse_metrics
from preheat.http.control import TIMELINE_ROUTE, VLLM_IS_SLEEPING

MAX_BODY = 16 * 1024 * 1024


def checks(options: DoctorOptions) -> list[Check]:
    found = []
    if options.url:
        found += [Check("replica.health", "replica", 3.0, check_health),
                  Check("replica.timeline", "timeline", 3.0, check_replica_timeline),
                  Check("replica.kv", "kv", 3.0, check_replica_kv)]
    if options.timeline:
        found.append(Check("timeline.file", "timeline", 3.0, check_timeline_file))
    return found


def get(url: str, path: str, options: DoctorOptions, timeout_s: float) -> tuple[int, bytes]:
    """(status, body) of ``GET url+path``; ``SourceError`` naming the URL when it cannot be fetched."""
    from preheat.core.errors import HTTPClientError
    from preheat.http.client import Timeouts, request

    full = url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    try:
        answer = request(full, timeouts=Timeouts.within(timeout_s), headers=headers, max_body=MAX_BODY)
    except HTTPClientError as exc:
        raise SourceError(f"GET {full}: {exc}") from None
    return answer.status, answer.body


def _unreachable(url: str, exc: Exception) -> Finding:
    return Finding("replica.unreachable", "replica", "fail", f"replica {url} does not answer: {exc}",
                   evidence={"url": url, "error": type(exc).__name__, "message": str(exc)},
                   fix="Is it running and listening on that address? `preheat serve` binds 127.0.0.1 unless "
                   "--host says otherwise.")


def _refused(url: str, path: str, status: int) -> Finding:
    return Finding("replica.unauthorized", "replica", "fail", f"{url}{path} answers HTTP {status}",
                   evidence={"url": url + path, "status": status},
                   fix="Pass the replica's key: --api-key or PREHEAT_API_KEY.")


def check_health(options: DoctorOptions, bound_s: float) -> list[Finding]:
    assert options.url is not None
    try:
        status, body = get(options.url, "/health", options, bound_s)
    except SourceError as exc:
        return [_unreachable(options.url, exc)]
    try:
        doc = loads_bounded(body, max_bytes=MAX_BODY)
    except JSONInputError:
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    evidence = {"url": options.url, "status": status, "health": doc}
    state = str(doc.get("status", ""))
    if status == 200 and not doc and _vllm_asleep(options, bound_s):  # vLLM's /health: 200, empty, asleep or not
        return [Finding("replica.not_ready", "replica", "info", "replica is sleeping (vLLM's /is_sleeping)",
                        evidence={**evidence, "is_sleeping": True})]
    if status == 200:
        return [Finding("replica.healthy", "replica", "ok", f"replica is ready ({doc.get('model', '?')})",
                        evidence=evidence)]
    if state == "failed":
        return [Finding("replica.failed", "replica", "fail", f"replica failed to start: {doc.get('error')}",
                        evidence=evidence, fix="Fix the error its /health and log name, then restart it.")]
    if state in ("loading", "warming", "standby", "sleeping", "waking", "draining"):
        return [Finding("replica.not_ready", "replica", "info", f"replica is {state}"
                        + (f" ({doc['stage']})" if doc.get("stage") else ""), evidence=evidence)]
    return [Finding("replica.unhealthy", "replica", "fail", f"replica /health answers HTTP {status}",
                    evidence=evidence, fix="Check the replica's log; a router sends it no traffic meanwhile.")]


def _vllm_asleep(options: DoctorOptions, bound_s: float) -> bool:
    assert options.url is not None
    try:
        status, body = get(options.url, VLLM_IS_SLEEPING, options, bound_s)
        answer = loads_bounded(body, max_bytes=MAX_BODY) if status == 200 else {}
    except (SourceError, JSONInputError):
        return False
    return isinstance(answer, dict) and answer.get("is_sleeping") is True


def check_replica_timeline(options: DoctorOptions, bound_s: float) -> list[Finding]:
    assert options.url is not None
    path = TIMELINE_ROUTE
    try:
        status, body = get(options.url, path, options, bound_s)
    except SourceError as exc:
        return [_unreachable(options.url, exc)]
    if status in (401, 403):
        return [_refused(options.url, path, status)]
    if status != 200:
        return [Finding("replica.no_timeline", "timeline", "info", f"{options.url}{path} answers HTTP {status}",
                        evidence={"url": options.url + path, "status": status},
                        fix="A router has no timeline of its own: point the doctor at one replica's URL.")]
    try:
        data = loads_bounded(body, max_bytes=MAX_BODY)
        return analyze_timeline(data, where=options.url + path, gpu_cost_per_hour=options.gpu_cost_per_hour)
    except (JSONInputError, PlanError) as exc:
        return [_bad_timeline(options.url + path, exc)]


def check_replica_kv(options: DoctorOptions, bound_s: float) -> list[Finding]:
    assert options.url is not None
    try:
        status, body = get(options.url, "/metrics", options, bound_s)
    except SourceError as exc:
        return [_unreachable(options.url, exc)]
    if status != 200:
        return [Finding("replica.no_metrics", "kv", "info", f"{options.url}/metrics answers HTTP {status}",
                        evidence={"url": options.url + "/metrics", "status": status})]
    text = body.decode("utf-8", "replace")
    signals = read(parse(text))
    if signals.engine in (VLLM, SGLANG):  # another engine's own series (dashboard.signals reads every kind)
        return analyze_engine(signals, where=options.url + "/metrics")
    return analyze_kv(parse_metrics(text), where=options.url + "/metrics")


def _bad_timeline(where: str, exc: Exception) -> Finding:
    return Finding("timeline.invalid", "timeline", "fail", f"{where} is not a preheat timeline: {exc}",
                   evidence={"source": where, "error": str(exc)},
                   fix="Pass the JSON of `preheat timeline URL --json` or of GET /v1/preheat/timeline.")


def check_timeline_file(options: DoctorOptions, bound_s: float) -> list[Finding]:
    assert options.timeline is not None
    try:
        with open(options.timeline, "rb") as handle:
            data = loads_bounded(handle.read(MAX_BODY + 1), max_bytes=MAX_BODY)
        return analyze_timeline(data, where=options.timeline, gpu_cost_per_hour=options.gpu_cost_per_hour)
    except OSError as exc:
        return [_bad_timeline(options.timeline, SourceError(f"cannot read ({exc.strerror})"))]
    except (JSONInputError, PlanError, json.JSONDecodeError) as exc:
        return [_bad_timeline(options.timeline, exc)]
