"""The routers the router benchmarks compare, and how each is started: preheat's own (one per policy), vLLM's
``vllm-router`` and SGLang's gateway ``smg``, both Rust, both ``--policy cache_aware``.

The peers live in a venv of their own (``.venv-routers``, made on first use from the package index, as
bench/load.py's peers are installed beside it). Used by bench/router_capacity.py (an instant upstream) and
bench/router.py (``preheat serve`` replicas).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from preheat.core.errors import HTTPClientError
from preheat.http.client import Timeouts, request
from preheat.testing.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = ROOT / ".venv-routers"
PEERS = ("vllm-router==0.1.17", "sglang-router==0.3.2")


def ensure_peers() -> Path:
    """The peers' venv's ``bin``, made on first use (the loader benchmark installs its peers the same way)."""
    if not (PEERS_VENV / "bin" / "smg").exists() or not (PEERS_VENV / "bin" / "vllm-router").exists():
        print(f"installing {', '.join(PEERS)} into {PEERS_VENV} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run([str(PEERS_VENV / "bin" / "pip"), "install", "-q", *PEERS], check=True)
    return PEERS_VENV / "bin"


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers 200; ``RuntimeError`` when ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}: {err}")
        try:
            if request(url, timeouts=Timeouts.within(1.0)).status == 200:
                return
        except HTTPClientError:  # not listening yet
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout:g} s")


def router_command(
    name: str, port: int, upstreams: Sequence[str], peers: Path, tokenizer: str, *, preheat_args: Sequence[str] = ()
) -> list[str]:
    """The command line of contender ``name``: ``preheat <policy>``, ``vllm-router cache_aware`` or ``smg
    cache_aware``, listening on ``port`` in front of ``upstreams``. ``tokenizer`` is preheat's ``--model`` for the
    policies that tokenize; ``preheat_args`` go to preheat's router only."""
    if name.startswith("preheat "):
        # "preheat POLICY [xN] [--flag ...]": N router processes (--workers N), and flags of preheat's router
        words = name.split()
        policy = words[1]
        cmd = [str(ROOT / ".venv" / "bin" / "preheat"), "router", "--port", str(port), "--policy", policy]
        for word in words[2:]:
            cmd += ["--workers", word[1:]] if word.startswith("x") else [word]
        for url in upstreams:
            cmd += ["--replica", url]
        if policy == "kv":  # prefix reads prompts as text
            cmd += ["--model", tokenizer]
        return [*cmd, *preheat_args]
    if name.startswith("vllm-router"):
        return [str(peers / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                "--worker-urls", *upstreams, "--log-level", "warning"]  # fmt: skip
    return [str(peers / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
            "--worker-urls", *upstreams, "--log-level", "warn"]  # fmt: skip


@contextlib.contextmanager
def running_router(
    name: str,
    upstreams: Sequence[str],
    peers: Path,
    tokenizer: str,
    log_path: Path,
    *,
    preheat_args: Sequence[str] = (),
    settle: float = 1.0,
    usage: dict[str, float] | None = None,
) -> Iterator[str]:
    """Contender ``name`` started in front of ``upstreams`` (its output in ``log_path``); yields its URL once its
    ``/health`` answers and ``settle`` seconds passed (its first health checks of the replicas), stops it after.
    ``usage["cpu_s"]``, when given: the CPU seconds it used while it was yielded (its start-up left out: a tokenizer
    loads before the first request), its worker processes included; it shares the cores it routes to."""
    port = free_port()
    with open(log_path, "wb") as log:
        command = router_command(name, port, upstreams, peers, tokenizer, preheat_args=preheat_args)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", proc)
            time.sleep(settle)
            began = tree_cpu_seconds(proc.pid)
            yield url
            if usage is not None:
                usage["cpu_s"] = tree_cpu_seconds(proc.pid) - began
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def tree_cpu_seconds(pid: int) -> float:
    """The CPU seconds process ``pid`` and its live descendants (``--workers N``) have used so far (Linux /proc)."""
    ticks, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", encoding="ascii") as children:
                    pending += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited meanwhile
    return ticks / os.sysconf("SC_CLK_TCK")
