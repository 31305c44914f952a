"""``preheat router --workers N``: N router processes on one port (router/workers.py), each a whole router, started
and stopped by one parent; real processes, real sockets, fake replicas."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from preheat.core.procs import Child
from preheat.testing.fakereplica import FakeReplica
from routing import wait_until
from serving import Client

KEY = "sesame"


def workers_of(parent: int) -> list[int]:
    """The router worker processes of ``parent`` (its children but multiprocessing's resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry))
    return sorted(found)


def sockets_held(pid: int) -> int:
    try:
        return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def router_args(replicas: list[FakeReplica], *extra: str) -> list[str]:
    args = ["router", "--port", "0", "--workers", "2", "--policy", "round-robin", *extra]
    for replica in replicas:
        args += ["--replica", replica.url]
    return args


def test_two_workers_share_the_port_and_each_serves_connections() -> None:
    replicas = [FakeReplica(), FakeReplica()]
    with replicas[0], replicas[1], Child("preheat router", router_args(replicas), merge_stderr=True) as router:
        url = router.wait_address(120.0)
        port = int(url.rsplit(":", 1)[1])
        workers = workers_of(router.pid)
        before = {pid: sockets_held(pid) for pid in workers}
        # The kernel spreads connections across the workers' sockets by their addresses: 64 held open land on
        # both (all on one: a chance of 2 ** -63).
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(64)]
        try:
            wait_until(lambda: sum(sockets_held(p) for p in workers) >= sum(before.values()) + 64, "all accepted")
            gained = {pid: sockets_held(pid) - before[pid] for pid in workers}
        finally:
            for sock in held:
                sock.close()
        answers = [Client(url).post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
                   for _ in range(20)]  # fmt: skip
        line = "\n".join(router.lines)
    assert len(workers) == 2
    assert all(n > 0 for n in gained.values()), gained
    assert [r.status for r in answers] == [200] * 20
    assert "2 workers" in line


def test_a_dashboard_login_holds_on_every_worker() -> None:
    with FakeReplica() as replica:
        env = {**os.environ, "PREHEAT_ROUTER_API_KEY": KEY}
        with Child("preheat router", router_args([replica]), merge_stderr=True, env=env) as router:
            url = router.wait_address(120.0)
            form = {"Content-Type": "application/x-www-form-urlencoded"}
            login = Client(url).request("POST", "/dashboard", f"key={KEY}".encode(), form)
            cookie = login.headers["Set-Cookie"].split(";", 1)[0]
            # Each request on a connection of its own: they land on both workers, the login made on one of them.
            states = [Client(url).request("GET", "/dashboard/api/state", headers={"Cookie": cookie})
                      for _ in range(24)]  # fmt: skip
            # The signature is hex: its last digit changed to another (a fixed "0" left it as it was 1 time in 16).
            forged_cookie = cookie[:-1] + ("1" if cookie.endswith("0") else "0")
            forged = Client(url).request("GET", "/dashboard/api/state", headers={"Cookie": forged_cookie})
    assert login.status in (200, 303)
    assert [s.status for s in states] == [200] * 24
    assert forged.status == 401


def test_a_worker_that_dies_is_replaced_and_sigterm_stops_them_all() -> None:
    with FakeReplica() as replica, Child("preheat router", router_args([replica]), merge_stderr=True) as router:
        url = router.wait_address(120.0)
        first = workers_of(router.pid)
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: len(set(workers_of(router.pid)) - set(first)) == 1, "a new worker", 60.0)
        replaced = workers_of(router.pid)
        wait_until(lambda: Client(url).get("/health").status == 200, "the new worker serving", 60.0)
        answers = [Client(url).post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
                   for _ in range(10)]  # fmt: skip
        os.kill(router.pid, signal.SIGTERM)
        router.reap(30.0)
        code = router.proc.poll()
        output = "\n".join(router.lines)
    assert [r.status for r in answers] == [200] * 10
    assert len(replaced) == 2
    assert first[1] in replaced
    assert "starting another" in output
    assert code == 0
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in replaced)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("count", ["0", "257"])
def test_a_worker_count_out_of_range_is_refused_before_anything_starts(count: str) -> None:
    args = ["router", "--replica", "http://127.0.0.1:9", "--workers", count]
    with Child("preheat router", args, merge_stderr=True) as router:
        router.reap(60.0)
        router.close()
        code = router.proc.poll()
        output = "\n".join(router.lines)
    assert code != 0
    assert f"--workers {count}" in output


def test_a_worker_that_cannot_start_stops_the_router_with_its_error(tmp_path: Path) -> None:
    # The settings pass the parent's checks; the tokenizer is read in each worker, and there is none here.
    args = ["router", "--replica", "http://127.0.0.1:9", "--workers", "2", "--policy", "kv", "--model", str(tmp_path)]
    with Child("preheat router", args, merge_stderr=True) as router:
        router.reap(120.0)
        router.close()
        code = router.proc.poll()
        output = "\n".join(router.lines)
    assert code == 1
    assert "cannot read its tokenizer" in output
    assert "before serving" in output
    assert "Traceback" not in output
