"""``preheat serve --follow``: two real replicas follow a real trainer process over HTTP; each answer says the
version it was computed on, and stays equal to what a fresh engine loaded from a checkpoint of that version says;
a replica that cannot verify a version stays on its own, reports it, and (``--max-staleness 0``) refuses requests
until it catches up."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from artifactkit import make_keypair
from preheat.peer.registry import FileRegistry, PeerEntry
from preheat.refit.protocol import TensorEntry, VersionManifest, head_identity, head_name
from preheat.refit.server import RefitServer
from preheat.router.cluster import ServerProcess
from refit_trainer import COMPLETION, NAME, Trainer, refit
from routing import running_router, wait_until
from serving import Client

pytestmark = pytest.mark.slow  # four processes (a trainer, three replicas) on a 2-core machine: ~45 s


Fleet = tuple[Trainer, list[Client], str, str]


@pytest.fixture(scope="module")
def fleet(kv_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A trainer, two replicas following it (``--max-staleness 0``), and one plain replica that follows nothing."""
    registry = f"file://{tmp_path_factory.mktemp('registry')}"
    trainer = Trainer(kv_model, registry, tmp_path_factory.mktemp("versions"))
    flags = ("--served-model-name", NAME, "--follow", "--registry", registry, "--max-staleness", "0")
    replicas = [ServerProcess(str(kv_model), *flags, "--max-model-len", "256") for _ in range(2)]
    replicas.append(ServerProcess(str(kv_model), "--served-model-name", NAME, "--max-model-len", "256"))
    try:
        for replica in replicas:
            replica.wait_ready(timeout=120)
        yield trainer, [Client(r.url) for r in replicas[:2]], registry, replicas[2].url
    finally:
        for replica in replicas:
            replica.stop()
        trainer.close()


def test_replicas_serve_each_published_version_and_say_so(fleet: Fleet) -> None:
    trainer, clients, _, _ = fleet
    for client in clients:
        assert client.get("/health").json()["version"] == 0
        assert client.post("/v1/completions", COMPLETION).headers["X-Preheat-Version"] == "0"
    version, _, _ = trainer.publish(0.1)
    want = trainer.answer(version)
    for client in clients:
        status = refit(client, version)
        assert status["version"] == version
        health = client.get("/health").json()
        assert health["version"] == version
        assert client.get("/v1/models").json()["data"][0]["version"] == version
        answer = client.post("/v1/completions", COMPLETION)
        assert answer.status == 200
        assert answer.headers["X-Preheat-Version"] == str(version)
        assert answer.json()["choices"][0]["text"] == want
        assert client.metric("preheat_refit_version") == version
    refused = clients[0].post("/v1/preheat/sleep", {})
    assert refused.status == 409  # a wake would reload the checkpoint and lose the version
    url = f"http://{clients[0].host}:{clients[0].port}"
    shown = subprocess.run([sys.executable, "-m", "preheat", "refit", "status", url, "--json"],
                           capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert json.loads(shown.stdout)["version"] == version


def test_a_replica_that_cannot_verify_a_version_stays_and_refuses_when_too_stale(fleet: Fleet) -> None:
    trainer, clients, registry, _ = fleet
    version, _, _ = trainer.publish(0.1)
    for client in clients:
        refit(client, version)
    bogus = TensorEntry("model.norm.weight", "F32", (64,), 256, "xxh3-128:" + "ab" * 16)
    liar_manifest = VersionManifest(NAME, version + 1, (bogus,), epoch=trainer.epoch)

    class Liar:
        name = NAME

        def versions(self) -> list[int]:
            return [version + 1]

        def manifest(self, wanted: int) -> VersionManifest | None:
            return liar_manifest if wanted == version + 1 else None

        def tensor_bytes(self, wanted: int, tensor: str) -> memoryview | None:
            return memoryview(bytes(256))  # not the promised bytes

    files = FileRegistry(registry.removeprefix("file://"))
    with RefitServer(Liar()) as liar:
        entry = PeerEntry(head_identity(NAME), liar.address, name=head_name(NAME))
        files.announce(entry, ttl=60)
        for client in clients:
            answer = client.post("/v1/preheat/refit", {"version": version + 1, "wait": True, "timeout": 10})
            assert answer.status == 504  # not served: verification failed
            health = client.get("/health").json()
            assert health["version"] == version
            assert health["refit"]["failed"] == version + 1
            assert "does not match" in health["refit"]["error"]
            refused = client.post("/v1/completions", COMPLETION)
            assert refused.status == 503
            assert refused.json()["error"]["code"] == "stale_weights"
        files.withdraw(entry)
    trainer.publish(0.1)
    newest, _, _ = trainer.publish(0.1)  # past the version that failed
    for client in clients:
        status = refit(client, newest)
        assert status["version"] == newest
        assert (status["failed"], status["error"]) == (None, None)  # superseded: /health no longer reports it
        answer = client.post("/v1/completions", COMPLETION)
        assert answer.status == 200
        assert answer.headers["X-Preheat-Version"] == str(newest)


def test_the_router_can_send_requests_only_to_replicas_on_the_newest_version(fleet: Fleet) -> None:
    trainer, clients, _, plain = fleet
    version, _, _ = trainer.publish(0.1)
    for client in clients:
        refit(client, version)
    followers = {f"http://{c.host}:{c.port}" for c in clients}
    with running_router([*followers, plain], newest_version=True) as router:
        via = Client(router.url)
        wait_until(lambda: all(r.version == version for r in router.router.replicas if r.url in followers),
                   "the router to read the versions from /health")  # fmt: skip
        answered = {via.post("/v1/completions", COMPLETION).headers["X-Preheat-Replica"] for _ in range(6)}
        assert answered == followers  # never the replica that reports no version
        assert all(via.post("/v1/completions", COMPLETION).headers["X-Preheat-Version"] == str(version)
                   for _ in range(2))  # fmt: skip
    with running_router([*followers, plain]) as router:
        wait_until(lambda: all(r.healthy for r in router.router.replicas), "every replica in rotation")
        answered = {Client(router.url).post("/v1/completions", COMPLETION).headers["X-Preheat-Replica"]
                    for _ in range(6)}  # fmt: skip
        assert plain in answered  # without the option, every healthy replica takes requests


def test_a_replica_whose_refit_server_cannot_bind_still_serves(kv_model: Path, tmp_path: Path) -> None:
    key = make_keypair(tmp_path / "keys", "trainer")  # a refit server beyond loopback: versions must be signed
    flags = ("--follow", "--registry", f"file://{tmp_path}", "--peer-host", "192.0.2.1", "--peer-token", "s3cret",
             "--refit-trust-key", str(key.public))  # fmt: skip
    replica = ServerProcess(str(kv_model), "--served-model-name", NAME, "--max-model-len", "256", *flags)
    try:
        replica.wait_ready(timeout=120)  # 192.0.2.1 (TEST-NET) is no address of this machine: the bind fails
        client = Client(replica.url)
        health = client.get("/health").json()
        assert health["status"] == "ok"
        assert "refit" not in health  # not following, and /health says so
        assert client.post("/v1/completions", COMPLETION).status == 200
    finally:
        replica.stop()
