"""Signed weights versions (``preheat.refit.trust``, issue 29): a follower that trusts the trainer's key applies,
counts and advertises only versions the trainer signed, whoever else writes the registry; a holder that lies is
reported and not asked for a while; a restarted trainer moves its followers forward; and ``--follow`` beyond this
machine without a trusted key does not start.

The first tests follow real publishers (``preheat.refit.Publisher``, each with its own refit server) with in-process
engines; the last ones run the same through ``preheat serve --follow`` replicas and a trainer process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from artifactkit import KeyPair, make_keypair
from hostile import Answer, ScriptedServer
from preheat.artifacts.signing import TrustedKeys
from preheat.engine import Engine
from preheat.peer.registry import FileRegistry, PeerEntry
from preheat.refit.follower import Follower
from preheat.refit.protocol import head_identity, head_name
from preheat.refit.publisher import Publisher
from preheat.router.cluster import ServerProcess
from preheat.server.following import base_digests
from refit_trainer import COMPLETION, NAME, Trainer, refit
from routing import running_router, wait_until
from serving import Client

HUGE = 10**17  # the version the rogue publisher used
ANNOUNCED = 2**61  # the version a holder announced and never served


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[KeyPair, KeyPair]:
    """The trainer's key pair and a rogue's, as `preheat artifacts keygen` writes them."""
    root = tmp_path_factory.mktemp("keys")
    return make_keypair(root, "trainer"), make_keypair(root, "rogue")


@pytest.fixture
def registry(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'registry'}"


def follower(model: Path, registry: str, trusted: TrustedKeys, **options: object) -> Follower:
    engine = Engine.from_checkpoint(str(model))
    return Follower(NAME, engine, registry=registry, base_digests=base_digests(str(model)), poll_s=0.1,
                    trusted=trusted, **options)  # type: ignore[arg-type]  # fmt: skip


def weights(model: Path, delta: float) -> dict[str, torch.Tensor]:
    """The model's weights with the final norm moved by ``delta``: an honest version."""
    out = dict(load_file(str(model / "model.safetensors")))
    out["model.norm.weight"] = out["model.norm.weight"] + delta
    return out


def zeroed(model: Path) -> dict[str, torch.Tensor]:
    """The issue's rogue version: the first layer's q_proj zeroed (and the final norm, which the tests look at)."""
    out = dict(load_file(str(model / "model.safetensors")))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        out[name] = torch.zeros_like(out[name])
    return out


def norm(replica: Follower) -> torch.Tensor:
    model = replica.engine.model
    assert model is not None
    return model.norm


def announce(registry: str, address: str) -> PeerEntry:
    entry = PeerEntry(head_identity(NAME), address, name=head_name(NAME))
    FileRegistry(registry.removeprefix("file://")).announce(entry, ttl=60)
    return entry


def announcer(epoch: int, version: int) -> ScriptedServer:
    """A holder that announces ``version`` and serves nothing: every other request is a 404."""

    def script(method: str, path: str, headers: dict[str, str]) -> Answer:
        if path == "/refit/v1/info":
            body = json.dumps({"name": NAME, "epoch": epoch, "versions": [version], "latest": version}).encode()
            return 200, {"Content-Length": str(len(body)), "Content-Type": "application/json"}, [body]
        return 404, {"Content-Length": "0"}, [b""]

    return ScriptedServer(script)


def test_a_rogue_publisher_under_the_same_name_publishes_nothing(
    kv_model: Path, registry: str, keys: tuple[KeyPair, KeyPair]
) -> None:
    """The issue's rogue: version 10**17 with a zeroed q_proj, signed by a key nobody trusts (and unsigned). The
    follower applies the trainer's version 2, never counts the rogue's, and names the rogue as a liar."""
    trainer_key, rogue_key = keys
    replica = follower(kv_model, registry, trainer_key.trusted)
    honest = weights(kv_model, 1.0)
    with (
        Publisher(NAME, registry=registry, signing_key=trainer_key.signer) as trainer,
        Publisher(NAME, registry=registry, signing_key=rogue_key.signer) as rogue,
        Publisher(NAME, registry=registry) as unsigned,
    ):
        try:
            trainer.publish(weights(kv_model, 0.5), 1)
            trainer.publish(honest, 2)
            rogue.publish(zeroed(kv_model), HUGE)
            unsigned.publish(zeroed(kv_model), HUGE + 1)
            assert replica.step()
            status = replica.status()
            assert (status["version"], status["epoch"], status["newest"], status["behind"]) == (2, trainer.epoch, 2, 0)
            assert torch.equal(norm(replica), honest["model.norm.weight"])
            lies = replica.liars()
            assert set(lies) == {rogue.server.address, unsigned.server.address}
            assert rogue.server.tensors_served == unsigned.server.tensors_served == 0  # refused from the manifest
            assert not replica.step()  # the liars are not asked again for a while
            assert replica.liars() == lies
            # The replica serves the trainer's signed version to the next replica, which verifies it.
            replica._heartbeat.start()  # type: ignore[union-attr]  # announce, as start() does, without its thread
            second = follower(kv_model, registry, trainer_key.trusted, serve=False)
            trainer.close()
            try:
                assert second.step()
                assert second.version == 2
                assert second.last is not None
                assert set(second.last.sources) == {replica.server.address}  # type: ignore[union-attr]
            finally:
                second.stop()
        finally:
            replica.stop()


def test_a_holder_that_only_announces_a_huge_version_moves_nothing(
    kv_model: Path, registry: str, keys: tuple[KeyPair, KeyPair]
) -> None:
    trainer_key, _ = keys
    replica = follower(kv_model, registry, trainer_key.trusted)
    with Publisher(NAME, registry=registry, signing_key=trainer_key.signer) as trainer, announcer(
        trainer.epoch, ANNOUNCED
    ) as liar:  # fmt: skip
        address = liar.url.removeprefix("http://")
        announce(registry, address)
        try:
            trainer.publish(weights(kv_model, 1.0), 1)
            assert replica.step()
            status = replica.status()
            assert (status["version"], status["newest"], status["behind"]) == (1, 1, 0)
            assert replica.liars() == {address: 1}
            asked = len(liar.requests)
            replica.step()
            assert len(liar.requests) == asked  # shunned: not asked again for a while
            assert replica.status()["behind"] == 0
        finally:
            replica.stop()


def test_a_restarted_trainer_moves_its_followers_forward(
    kv_model: Path, registry: str, keys: tuple[KeyPair, KeyPair]
) -> None:
    trainer_key, _ = keys
    replica = follower(kv_model, registry, trainer_key.trusted)
    try:
        with Publisher(NAME, registry=registry, signing_key=trainer_key.signer) as first:
            first.publish(weights(kv_model, 1.0), 1)
            first.publish(weights(kv_model, 2.0), 2)
            assert replica.step()
            identity = replica.engine.identity
        restarted = weights(kv_model, 3.0)
        with Publisher(NAME, registry=registry, signing_key=trainer_key.signer) as second:
            assert second.epoch > first.epoch
            second.publish(restarted, 1)  # counting from 1 again
            assert replica.step()
            assert (replica.version, replica.epoch) == (1, second.epoch)
            assert torch.equal(norm(replica), restarted["model.norm.weight"])
            assert replica.engine.identity != identity
    finally:
        replica.stop()


@pytest.mark.parametrize("rogue_signs", [True, False])
def test_at_equal_versions_the_rogue_loses(
    kv_model: Path, registry: str, keys: tuple[KeyPair, KeyPair], rogue_signs: bool
) -> None:
    """The same epoch and version from a rogue (once it won: holders were taken in address order)."""
    trainer_key, rogue_key = keys
    honest = weights(kv_model, 1.0)
    replica = follower(kv_model, registry, trainer_key.trusted)
    with Publisher(NAME, registry=registry, signing_key=trainer_key.signer) as trainer, Publisher(
        NAME, registry=registry, signing_key=rogue_key.signer if rogue_signs else None, epoch=trainer.epoch
    ) as rogue:  # fmt: skip
        try:
            rogue.publish(zeroed(kv_model), 1)
            trainer.publish(honest, 1)
            assert replica.step()
            assert replica.version == 1
            assert torch.equal(norm(replica), honest["model.norm.weight"])
            assert replica.last is not None
            assert rogue.server.address not in replica.last.sources
        finally:
            replica.stop()


def test_a_signed_version_too_far_ahead_is_refused(
    kv_model: Path, registry: str, keys: tuple[KeyPair, KeyPair]
) -> None:
    trainer_key, _ = keys
    replica = follower(kv_model, registry, trainer_key.trusted, max_jump=1000)
    with Publisher(NAME, registry=registry, signing_key=trainer_key.signer) as trainer:
        try:
            trainer.publish(weights(kv_model, 1.0), 1)
            assert replica.step()
            trainer.publish(weights(kv_model, 2.0), 1 + 1001)  # a mistyped number, signed all the same
            assert not replica.step()
            status = replica.status()
            assert (status["version"], status["newest"], status["behind"]) == (1, 1, 0)
            assert "more than --refit-max-jump 1000" in str(status["error"])
            assert replica.liars() == {}  # the trainer signed it: refused, not a lie
        finally:
            replica.stop()


def test_without_a_trusted_key_only_holders_on_this_machine_are_asked(
    kv_model: Path, registry: str, caplog: pytest.LogCaptureFixture
) -> None:
    replica = follower(kv_model, registry, TrustedKeys())
    announce(registry, "192.0.2.1:9")  # TEST-NET: a holder on another machine
    with Publisher(NAME, registry=registry) as trainer:
        try:
            trainer.publish(weights(kv_model, 1.0), 1)
            with caplog.at_level("WARNING", logger="preheat.refit"):
                assert replica.step()
            assert replica.version == 1
            assert "192.0.2.1:9 is beyond this machine and no --refit-trust-key is given" in caplog.text
        finally:
            replica.stop()


def test_follow_beyond_loopback_without_a_trust_key_does_not_start(kv_model: Path, tmp_path: Path) -> None:
    for flags in (["--registry", "redis://10.0.0.9:6379"],
                  ["--registry", f"file://{tmp_path}", "--host", "0.0.0.0", "--peer-token", "s3cret"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "preheat", "serve", str(kv_model), "--follow", *flags],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert done.returncode != 0
        assert "no --refit-trust-key" in done.stderr
        assert "preheat artifacts keygen" in done.stderr  # says how to make a key
        assert "Traceback" not in done.stderr


# -- the same through `preheat serve --follow` replicas -------------------------------------------------------------


class Fleet:
    def __init__(self, trainer: Trainer, clients: list[Client], registry: str, keys: tuple[KeyPair, KeyPair]) -> None:
        self.trainer, self.clients, self.registry, self.keys = trainer, clients, registry, keys


@pytest.fixture(scope="module")
def fleet(kv_model: Path, keys: tuple[KeyPair, KeyPair], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A signing trainer process and two replicas that trust only its key and refuse requests when behind."""
    registry = f"file://{tmp_path_factory.mktemp('registry')}"
    trainer = Trainer(kv_model, registry, tmp_path_factory.mktemp("versions"), signing_key=keys[0].private)
    flags = ("--served-model-name", NAME, "--follow", "--registry", registry, "--max-staleness", "0",
             "--refit-trust-key", str(keys[0].public), "--max-model-len", "256")  # fmt: skip
    replicas = [ServerProcess(str(kv_model), *flags) for _ in range(2)]
    state = Fleet(trainer, [Client(r.url) for r in replicas], registry, keys)
    try:
        for replica in replicas:
            replica.wait_ready(timeout=120)
        yield state
    finally:
        for replica in replicas:
            replica.stop()
        state.trainer.close()


def answers_as(client: Client, version: int, want: str) -> None:
    answer = client.post("/v1/completions", COMPLETION)
    assert answer.status == 200, answer.body
    assert answer.headers["X-Preheat-Version"] == str(version)
    assert answer.json()["choices"][0]["text"] == want


@pytest.mark.slow  # a trainer and two replicas on a 2-core machine: ~40 s for the module
def test_replicas_serve_the_trainers_versions_and_report_the_rogue(kv_model: Path, fleet: Fleet) -> None:
    trainer, (_, rogue_key) = fleet.trainer, fleet.keys
    with Publisher(NAME, registry=fleet.registry, signing_key=rogue_key.signer) as rogue:
        rogue.publish(zeroed(kv_model), HUGE)
        version, _, _ = trainer.publish(0.1)
        want = trainer.answer(version)
        for client in fleet.clients:
            status = refit(client, version, trainer.epoch)
            assert (status["version"], status["newest"], status["behind"]) == (version, version, 0)
            health = client.get("/health").json()
            assert (health["version"], health["epoch"]) == (version, trainer.epoch)
            answers_as(client, version, want)
            assert client.metric("preheat_refit_lies_total", holder=rogue.server.address) >= 1
            assert client.metric("preheat_refit_newest_version") == version


@pytest.mark.slow
def test_an_announced_version_no_one_serves_leaves_max_staleness_replicas_serving(fleet: Fleet) -> None:
    trainer = fleet.trainer
    version, _, _ = trainer.publish(0.1)
    for client in fleet.clients:
        refit(client, version, trainer.epoch)
    with announcer(trainer.epoch, ANNOUNCED) as liar:
        address = liar.url.removeprefix("http://")
        entry = announce(fleet.registry, address)
        try:
            for client in fleet.clients:
                wait_until(lambda c=client: c.metric("preheat_refit_lies_total", holder=address) >= 1,
                           "the replica to ask the announcer for its manifest, and report it")  # fmt: skip
                for _ in range(3):
                    assert client.post("/v1/completions", COMPLETION).status == 200  # --max-staleness 0 holds
                health = client.get("/health").json()["refit"]
                assert (health["version"], health["newest"], health["behind"]) == (version, version, 0)
                assert client.metric("preheat_refit_behind") == 0
        finally:
            FileRegistry(fleet.registry.removeprefix("file://")).withdraw(entry)


@pytest.mark.slow
def test_at_equal_versions_the_replicas_take_the_trainers(kv_model: Path, fleet: Fleet) -> None:
    trainer, (_, rogue_key) = fleet.trainer, fleet.keys
    with Publisher(NAME, registry=fleet.registry, signing_key=rogue_key.signer, epoch=trainer.epoch) as rogue:
        next_version = int(fleet.clients[0].get("/health").json()["version"]) + 1
        rogue.publish(zeroed(kv_model), next_version)  # first: it is in the registry before the trainer's
        version, _, _ = trainer.publish(0.1)
        assert version == next_version
        want = trainer.answer(version)
        for client in fleet.clients:
            refit(client, version, trainer.epoch)
            answers_as(client, version, want)


@pytest.mark.slow
def test_replicas_follow_a_restarted_trainer_that_counts_from_one(
    kv_model: Path, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    old = fleet.trainer
    old.publish(0.1)
    old.close()
    fleet.trainer = new = Trainer(kv_model, fleet.registry, tmp_path_factory.mktemp("restarted"),
                                  signing_key=fleet.keys[0].private)  # fmt: skip
    assert new.epoch > old.epoch
    version, _, _ = new.publish(0.3)
    assert version == 1
    want = new.answer(version)
    for client in fleet.clients:
        status = refit(client, version, new.epoch)
        assert (status["version"], status["epoch"], status["behind"]) == (1, new.epoch, 0)
        answers_as(client, 1, want)


def test_liars_are_counted_by_address_up_to_a_bound(registry: str) -> None:
    """The lie counter is a metrics label: a registry full of liars cannot grow it without end."""
    from preheat.refit.lookout import MAX_LIARS, OTHER_HOLDERS, Lookout

    lookout = Lookout(NAME, FileRegistry(registry.removeprefix("file://")), headers={}, trusted=TrustedKeys(),
                      max_jump=10, shun_s=60, own=lambda: None, on_believed=lambda m: None,
                      on_refused=lambda k, why: None)  # fmt: skip
    for i in range(MAX_LIARS + 10):
        lookout.lie(f"127.0.0.{1 + i // 200}:{1000 + i}", "a test's lie")
    lookout.lie("127.0.0.1:1000", "again")
    lies = lookout.liars()
    assert len(lies) == MAX_LIARS + 1
    assert (lies[OTHER_HOLDERS], lies["127.0.0.1:1000"]) == (10, 2)


def scripted_replica(version: int, epoch: int) -> ScriptedServer:
    """A replica as the router sees it: ``/health`` with a weights version and epoch, completions answered 200."""

    def script(method: str, path: str, headers: dict[str, str]) -> Answer:
        doc = {"status": "ok", "version": version, "epoch": epoch} if path == "/health" else {"choices": []}
        body = json.dumps(doc).encode()
        return 200, {"Content-Length": str(len(body)), "Content-Type": "application/json"}, [body]

    return ScriptedServer(script)


def test_the_newest_version_router_orders_versions_by_epoch() -> None:
    """After a trainer restart, replicas already on its version 1 are newer than those still on the old epoch's 50."""
    with (
        scripted_replica(50, 1_000) as old,
        scripted_replica(1, 2_000) as restarted,
        running_router([old.url, restarted.url], newest_version=True) as router,
    ):
        wait_until(lambda: all(r.version is not None for r in router.router.replicas), "versions read")
        via = Client(router.url)
        answered = {via.post("/v1/completions", COMPLETION).headers["X-Preheat-Replica"] for _ in range(4)}
    assert answered == {restarted.url}
