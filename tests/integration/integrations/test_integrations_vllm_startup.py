"""vLLM's start-up timeline where vLLM cannot be observed (no vLLM here, in .venv): the plugin's recorder runs in real
processes (an "API server" that starts an "engine core"), and a vLLM version outside the supported range, or one
whose modules are missing, gives ``unknown`` stages naming why, never a crash or a number. The real vLLM start is
tests/engines/test_vllm_startup.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from preheat.core import env
from preheat.integrations.vllm.startup import CATALOGUE

# An "API server" records itself, then starts its "engine core" as vLLM does (a child process), which records itself.
START = """
import subprocess, sys, time
from preheat.integrations.vllm.startup_hooks import install
install(VERSION, entered=time.time(), role=ROLE)
if CHILD:
    subprocess.run([sys.executable, "-c", sys.argv[1]], check=True)
"""


def start(records: Path, version: str, *, switch: str | None = None, t0: float | None = None) -> None:
    child = START.replace("ROLE", '"engine_core"').replace("VERSION", repr(version)).replace("CHILD", "False")
    parent = START.replace("ROLE", '"api_server"').replace("VERSION", repr(version)).replace("CHILD", "True")
    environ = {**env.snapshot(), "PREHEAT_VLLM_STARTUP": switch or str(records)}
    environ.pop("PREHEAT_T0", None)
    if t0 is not None:
        environ["PREHEAT_T0"] = repr(t0)
    subprocess.run([sys.executable, "-c", parent, child], env=environ, check=True, timeout=120)


def timeline(records: Path, *, as_json: bool = True) -> Any:  # Any: `preheat timeline --json`'s JSON, or its text
    command = [sys.executable, "-m", "preheat", "timeline", str(records), *(["--json"] if as_json else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(done.stdout) if as_json else done.stdout


def test_a_version_outside_the_range_gives_unknown_stages_naming_it(tmp_path: Path) -> None:
    start(tmp_path, "0.31.2")
    merged = timeline(tmp_path)
    observed = [r["name"] for r in merged["stages"] if r["end"] > r["start"]]
    # What a process knows of itself (its /proc start, the plugin's own time) is observed at any version...
    assert [n for n in observed if n != "engine_core_spawn"] == [
        "imports",
        "plugin",
        "engine_core_imports",
        "engine_core_plugin",
    ]
    unknown = {u["name"]: u for u in merged["unknown"]}
    # ...and every stage a vLLM hook would observe is unknown, with the version named: no number, no crash.
    for name in ("argument_parsing", "config", "tokenizer", "model_build", "weight_load", "kv_cache_profile"):
        assert unknown[name]["status"] == "unknown"
        assert "vLLM 0.31.2 is outside the versions observed (0.32.x and 0.33.x)" in unknown[name]["why"]
    assert unknown["worker_imports"]["why"] == "no record from the worker process"
    everything = {s["name"] for s in CATALOGUE}
    assert set(observed) | set(unknown) >= everything  # each catalogued stage is observed or said to be unknown
    text = timeline(tmp_path, as_json=False)
    assert "unknown          weight_load: vLLM 0.31.2 is outside" in text


def test_a_supported_version_without_its_modules_gives_unknown_stages(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this venv: its hooks' targets can be imported")
    start(tmp_path, "0.32.0")
    unknown = {u["name"]: u["why"] for u in timeline(tmp_path)["unknown"]}
    assert unknown["model_build"].startswith(
        "not observable in this vLLM: cannot import vllm.model_executor.model_loader.base_loader"
    )
    assert unknown["config"].startswith("not observable in this vLLM: cannot import vllm.engine.arg_utils")


def test_off_records_nothing(tmp_path: Path) -> None:
    start(tmp_path, "0.32.0", switch="off")
    assert list(tmp_path.iterdir()) == []


def test_the_platform_clock_starts_the_timeline(tmp_path: Path) -> None:
    start(tmp_path, "0.32.0", t0=time.time() - 5.0)  # e.g. the pod was created 5 s before its process started
    merged = timeline(tmp_path)
    assert merged["origin_source"] == "PREHEAT_T0"
    first = merged["stages"][0]
    assert first["name"] == "platform"
    assert first["duration"] >= 4.9
