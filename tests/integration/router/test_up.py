"""``preheat up``: N replicas and a router as child processes, serving through the router, and every child gone
after Ctrl-C or SIGTERM (checked in /proc, not trusted)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from routing import NAME, start_up
from serving import Client


@contextlib.contextmanager
def running_up(
    model: Path, *extra: str, lines: list[str] | None = None, stderr: Path | None = None
) -> Iterator[tuple[subprocess.Popen[str], str, list[int], list[str]]]:
    """``start_up``, and ``preheat up`` killed on the way out if the test did not stop it (a failed assertion)."""
    up, router, pids, replicas = start_up(model, *extra, lines=lines, stderr=stderr)
    try:
        yield up, router, pids, replicas
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is dead: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], deadline: float = 30.0) -> list[int]:
    end = time.monotonic() + deadline
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_up_serves_through_its_router_and_stops_every_child(tiny_servable_model: Path, stop: signal.Signals) -> None:
    with running_up(tiny_servable_model, "--policy", "least-load") as (up, router, pids, _):
        assert len(pids) == 3
        assert all(alive(p) for p in pids)
        client = Client(router)
        reply = client.post("/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 2})
        assert reply.status == 200, reply.body
        assert len(client.get("/health").json()["replicas"]) == 2
        up.send_signal(stop)
        assert up.wait(timeout=60) == 0
    assert wait_gone(pids) == []


def test_children_do_not_outlive_a_killed_up(tiny_servable_model: Path) -> None:
    up, _, pids, _ = start_up(tiny_servable_model)
    up.kill()  # no chance to clean up: the kernel's parent-death signal stops the children
    up.wait()
    assert wait_gone(pids) == []
    assert not os.path.exists(f"/proc/{up.pid}/stat") or not alive(up.pid)


def test_up_with_an_api_key_locks_the_router_and_every_replica(tiny_servable_model: Path) -> None:
    with running_up(tiny_servable_model, "--api-key", "sesame") as (up, router, pids, replicas):
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 2}
        locked = [Client(url).post("/v1/completions", body).status for url in (router, *replicas)]
        opened = Client(router, api_key="sesame").post("/v1/completions", body)
        health = Client(router).get("/health")  # probes need no key
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert locked == [401, 401, 401]
    assert opened.status == 200, opened.body
    assert health.status == 200
    assert wait_gone(pids) == []


def test_up_with_an_api_key_activates_a_standby_with_a_key_no_client_holds(tiny_servable_model: Path) -> None:
    extra = ("--api-key", "sesame", "--replicas", "0", "--standby", "1")
    with running_up(tiny_servable_model, *extra) as (up, router, pids, replicas):
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 2}
        served = Client(router, api_key="sesame").post("/v1/completions", body)  # the router activates the standby
        refused = Client(replicas[0], api_key="sesame").post("/v1/preheat/sleep", {"level": 1})
        state = Client(replicas[0]).get("/health").json()["status"]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert served.status == 200, served.body
    assert (refused.status, refused.json()["error"]["code"]) == (403, "invalid_admin_key")
    assert state == "ok"
    assert wait_gone(pids) == []


def test_up_hands_the_l2_url_to_replicas_through_their_environment(kv_model: Path, tmp_path: Path) -> None:
    """An L2 URL may carry a Redis password: it must not appear on any child's command line (readable by all)."""
    shared = tmp_path / "kv-l2-with-a-secret"
    with running_up(kv_model, "--kv-l1", "1MiB", "--kv-l2", f"fs://{shared}") as (up, _, pids, replicas):
        command_lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids]
        l2_ids = [Client(url).get("/v1/kv/events").json()["l2_id"] for url in replicas]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert all(str(shared).encode() not in line for line in command_lines)
    assert all(l2_ids), l2_ids  # every replica still runs on the shared L2...
    assert len(set(l2_ids)) == 1, l2_ids  # ...the same one


def test_up_prints_every_kv_tier_state_and_makes_a_fresh_l2_directory(kv_model: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "preheat-kv"  # a fresh machine: the directory does not exist yet
    printed: list[str] = []
    with running_up(kv_model, "--kv-l1", "1MiB", "--kv-l2", f"fs://{fresh}", lines=printed) as (up, *_):
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert fresh.is_dir()
    assert printed[-2] == f"KV: L1 1MiB up on 2/2 replicas, L2 fs://{fresh} up on 2/2 replicas"
    assert printed[-1].startswith("ready: ")  # the tiers' state comes just before it


def test_up_warns_of_a_tier_that_is_down_and_its_dashboard_is_not_ok(kv_model: Path, tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on: the replicas' Redis L2 is down from the start
        closed.bind(("127.0.0.1", 0))
        l2 = f"redis://:hunter2@127.0.0.1:{closed.getsockname()[1]}/0"
    printed: list[str] = []
    log = tmp_path / "up.stderr"
    with running_up(kv_model, "--kv-l1", "1MiB", "--kv-l2", l2, lines=printed, stderr=log) as (up, router, *_):
        state = Client(router).get("/dashboard/api/state").json()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    shown = l2.replace(":hunter2@", "")  # never the password
    assert f"KV: L1 1MiB up on 2/2 replicas, L2 {shown} DOWN on 2/2 replicas" in printed
    warning = f"preheat up: WARNING: KV L2 {shown} is DOWN on replica 1, replica 2"
    assert any(line.startswith(warning) for line in log.read_text().splitlines()), log.read_text()
    assert "hunter2" not in "\n".join(printed) + log.read_text()
    assert state["status"] == "degraded"  # the header's first word: "ok" only when every tier is up
    assert [t["text"] for t in state["tiers"]] == ["L1 up", "L2 down on 2/2 replicas"]


def test_up_keeps_standby_replicas_that_its_router_activates(tiny_servable_model: Path) -> None:
    with running_up(tiny_servable_model, "--replicas", "0", "--standby", "1") as (up, router, pids, replicas):
        assert len(pids) == 2  # the standby and the router
        client = Client(router)
        assert client.get("/health").json()["status"] == "cold"
        reply = client.post("/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 2})
        assert reply.status == 200, reply.body
        assert reply.headers["X-Preheat-Replica"] == replicas[0]
        assert client.metric("preheat_router_activations_total", replica=replicas[0], outcome="ok") == 1
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert wait_gone(pids) == []
