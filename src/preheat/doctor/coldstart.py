"""Which part of a recorded cold start to fix first, and with which pattern. Pure: a timeline document in, findings out.

Stages are grouped as the fixes see them (a pattern removes a group, not a stage), each moment of the timeline is
counted once for the stage that gates progress then (``preheat.plan.coldstart.critical_seconds``, so overlapped
stages cost nothing), and each group is priced in seconds and, with ``gpu_cost_per_hour``, dollars per start:

=========  ================================================  ==========================================  =========
group      stages                                            pattern that removes it                     removes
=========  ================================================  ==========================================  =========
image      platform (PREHEAT_T0 to process start)           standby replicas / warm node pool           all
start      imports, config, engine_imports, model_config     standby replicas (``serve --standby``)      all
download   fetch, download                                   node cache + peers (``pull``, registry)     all
load       weight_load, weight_handoff, model_build,         node cache on NVMe (slow reads), pre-sharded
           page_in, restore                                  checkpoint (TP), else quantized checkpoint  ~1/2
compile    compile, warmup, engine_warm                      compiled artifacts (``serve --compile``)    ~9/10
kv_warm    kv_warm                                           a smaller ``--kv-warm``                     --
other      tokenizer and anything else                       --                                          --
=========  ================================================  ==========================================  =========

A vLLM start (preheat's plugin records it: ``program`` ``vllm ...``) joins the same groups: its processes' imports,
plugins, spawns and handshakes are ``start`` (removed by a vLLM standby, ``preheat vllm-standby``), its profiling
pass and graph capture ``compile``; what follows ``ready`` (the wait for the first request, that request) is not
part of the start.
"""

from __future__ import annotations

from dataclasses import dataclass

from preheat.core.errors import PlanError
from preheat.doctor.findings import Finding
from preheat.plan.coldstart import critical_seconds
from preheat.timeline.waterfall import Row, Waterfall

GROUP_OF = {
    "platform": "image",
    "imports": "start",
    "config": "start",
    "engine_imports": "start",
    "standby_imports": "start",
    "model_config": "start",
    "fetch": "download",
    "download": "download",
    "weight_load": "load",
    "weight_handoff": "load",
    "model_build": "load",
    "page_in": "load",
    "restore": "load",
    "compile": "compile",
    "warmup": "compile",
    "engine_warm": "compile",
    "kv_warm": "kv_warm",
    # vLLM's start as preheat's plugin records it (its API server, engine core and worker processes).
    "plugin": "start",
    "argument_parsing": "start",
    "engine_core_imports": "start",
    "engine_core_plugin": "start",
    "engine_core_spawn": "start",
    "engine_core_handshake": "start",
    "worker_imports": "start",
    "worker_plugin": "start",
    "worker_spawn": "start",
    "device_init": "start",
    "api_server_setup": "start",
    "weights_fetch": "download",
    "weights_read": "load",
    "weights_handoff": "load",
    "kv_cache_profile": "compile",  # vLLM's profiling forward pass: where torch.compile runs when it does
    "cuda_graph_capture": "compile",
}
# After ready: not part of the start (vLLM's plugin records the wait for the first request and that request).
AFTER_READY = frozenset(("waiting_for_request", "first_request"))
SLOW_LOAD_GBPS = 1.0  # weights read slower than this are storage-bound: the fix is where they live, not their size
DOMINANT_MIN_S = 5.0  # a dominant group shorter than this is not worth a warning
DOMINANT_MIN_SHARE = 0.3
MIN_GROUP_S = 0.05  # groups shorter than this are not worth a line


@dataclass(frozen=True)
class Pattern:
    name: str
    removes: float  # the fraction of the group's seconds it removes
    fix: str


STANDBY = Pattern("standby replicas", 1.0,
                  "Keep standby replicas (`preheat serve --standby`: image pulled, imports done; `preheat "
                  "activate` / `POST /v1/preheat/load` gives one its model) or a warm node pool with the image "
                  "pre-pulled.")
NODE_CACHE = Pattern("node cache and peers", 1.0,
                     "Download once per node, not per start: `preheat pull` into the node cache (an init container "
                     "or DaemonSet) and let replicas pull from peers that hold it (`--registry`).")
FAST_STORAGE = Pattern("node cache on local NVMe", 0.7,
                       "The weights read slowly: keep them in the node cache on local NVMe (not NFS/overlay) and "
                       "page them in before the engine asks (`preheat serve` does, `page_in`).")
PRESHARDED = Pattern("pre-sharded checkpoint", 0.5,
                     "Each TP rank reads slices of every tensor: convert once to a pre-sharded checkpoint "
                     "(`preheat convert SRC DST --tp N`) so each rank reads only its own files.")
QUANTIZED = Pattern("quantized checkpoint", 0.5,
                    "Loading is bound by the bytes moved: a quantized checkpoint (`preheat convert SRC DST --dtype "
                    "fp8` or `int8`) moves half of them.")
ARTIFACTS = Pattern("compiled artifacts", 0.9,
                    "Share compiled artifacts between nodes: one replica compiles (`preheat serve --compile --peer "
                    "--registry URL`), the rest fetch the signed blob from it (`--trust-key`; vLLM: `preheat "
                    "artifacts pack/push/pull`) instead of compiling.")
KV_WARM = Pattern("smaller KV warm-up", 0.5,
                  "Warming L1 from L2 before ready delays the start: bound it (`--kv-warm SIZE`) or warm after ready.")
VLLM_STANDBY = Pattern("vLLM standby replicas", 1.0,
                       "Keep warm vLLM standbys (`preheat vllm-standby`: torch, vLLM and its engine machinery "
                       "imported; `POST /v1/preheat/load` or `preheat router --standby URL` gives one its model), or "
                       "sleeping replicas on CUDA (`vllm serve --enable-sleep-mode`, woken by `preheat router "
                       "--sleep-idle`).")
NOTHING = Pattern("none", 0.0, "")


FIXED_PATTERN = {"image": STANDBY, "start": STANDBY, "download": NODE_CACHE, "compile": ARTIFACTS, "kv_warm": KV_WARM}


def pattern_for(group: str, rows: list[Row], *, vllm: bool = False) -> Pattern:
    """The pattern that removes most of ``group``; for ``load`` it depends on how the weights were read; ``vllm``:
    the start is a vLLM's (its imports and processes are removed by a vLLM standby)."""
    if vllm and group in ("image", "start"):
        return VLLM_STANDBY
    if group in FIXED_PATTERN:
        return FIXED_PATTERN[group]
    if group == "load":
        loads = [r for r in rows if r.name == "weight_load"]
        moved = sum(r.nbytes or 0 for r in loads)
        seconds = sum(r.duration for r in loads)
        # Under a second, fixed costs (opening files, headers) dominate and GB/s says nothing about the storage.
        if moved and seconds >= 1.0 and moved / seconds / 1e9 < SLOW_LOAD_GBPS:
            return FAST_STORAGE
        if any(int(r.detail.get("world_size", 1) or 1) > 1 and not r.detail.get("presharded") for r in loads):
            return PRESHARDED
        return QUANTIZED
    return NOTHING


def group_seconds(waterfall: Waterfall) -> dict[str, float]:
    """Seconds per group on the critical path (each moment once), largest first."""
    spans = [
        (r.start, r.end, GROUP_OF.get(r.name, "other"))
        for r in waterfall.rows
        if r.duration > 0 and r.name not in AFTER_READY
    ]
    return dict(sorted(critical_seconds(spans).items(), key=lambda item: -item[1]))


def analyze_timeline(data: object, *, where: str, gpu_cost_per_hour: float = 0.0) -> list[Finding]:
    """Findings for one timeline document: one per group that took time, the dominant one a warning when it
    matters, plus whether the start reached ``ready``. ``PlanError`` naming ``where`` when it is not a timeline."""
    waterfall = Waterfall.from_dict(data, where=where)
    for row in waterfall.rows:
        if row.duration < 0:
            raise PlanError(f"{where}: stage {row.name!r} ends before it starts ({row.start} > {row.end})")
    groups = group_seconds(waterfall)
    total = sum(groups.values())
    program = data.get("program") if isinstance(data, dict) else None
    vllm = isinstance(program, str) and program.startswith("vllm")
    price = gpu_cost_per_hour / 3600.0
    findings: list[Finding] = []
    for rank, (group, seconds) in enumerate(groups.items()):
        if seconds < MIN_GROUP_S:
            continue
        rows = [r for r in waterfall.rows if GROUP_OF.get(r.name, "other") == group and r.name not in AFTER_READY]
        pattern = pattern_for(group, rows, vllm=vllm)
        share = seconds / total if total else 0.0
        dominant = rank == 0 and seconds >= DOMINANT_MIN_S and share >= DOMINANT_MIN_SHARE
        removable = seconds * pattern.removes
        title = f"{group} takes {seconds:.1f} s of the {total:.1f} s cold start ({share:.0%})"
        if pattern.removes:
            title += f"; {pattern.name} would remove ~{removable:.1f} s"
        findings.append(Finding(
            f"timeline.{group}", "timeline", "warn" if dominant else "info", title, seconds=seconds,
            evidence={
                "source": where, "group": group, "share": round(share, 3), "dominant": rank == 0,
                "program": program if isinstance(program, str) else None,
                "stages": {r.name: round(r.duration, 3) for r in rows if r.duration > 0},
                "gbps": next((round(r.gbps, 3) for r in rows if r.name == "weight_load" and r.gbps), None),
                "pattern": pattern.name if pattern.removes else None,
                "removable_s": round(removable, 3),
                "usd_per_start": round(seconds * price, 6) if price else None,
                "usd_saved_per_start": round(removable * price, 6) if price else None,
            },
            fix=pattern.fix or None,
        ))
    findings.append(_readiness(waterfall, where, price))
    return findings


def _readiness(waterfall: Waterfall, where: str, price: float) -> Finding:
    evidence: dict[str, object] = {"source": where, "ready_s": waterfall.ready, "ttft_s": waterfall.ttft,
                                   "idle_usd": round(waterfall.idle_seconds * price, 6) if price else None}
    failed = next((r for r in waterfall.rows if r.name == "failed"), None)
    if failed is not None:
        evidence["error"] = failed.detail.get("error")
        return Finding("timeline.failed", "timeline", "fail", f"the start failed at {failed.start:.1f} s",
                       evidence=evidence, fix="Read the replica's log and /health for the error; fix it before tuning "
                       "speed.")
    if waterfall.ready is None:
        return Finding("timeline.not_ready", "timeline", "info",
                       f"not ready yet after {waterfall.total:.1f} s (no 'ready' mark)", evidence=evidence)
    return Finding("timeline.ready", "timeline", "ok", f"ready {waterfall.ready:.1f} s after the origin "
                   f"({waterfall.origin_source})", evidence=evidence)
