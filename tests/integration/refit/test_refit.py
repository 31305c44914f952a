"""Live weight updates (``preheat.refit``): a real trainer process publishes random perturbations of a tiny Llama
from memory; engines that follow it compute bitwise what a fresh engine loaded from a checkpoint of the same version
computes, move only the tensors that changed, and stay on the version they serve whenever a new one cannot be had.

The engines here are in-process (the swap runs at once: ``run_now``); test_refit_serve.py runs the same
protocol through ``preheat serve --follow`` replicas.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from artifactkit import make_keypair
from holders import LyingHolder
from hostile import DEEP_JSON, ScriptedServer, always
from preheat.core.errors import RefitError
from preheat.engine import Engine, SamplingParams
from preheat.kv.build import build_tiers
from preheat.kv.settings import KVSettings
from preheat.peer.registry import FileRegistry, PeerEntry
from preheat.refit.follower import Follower
from preheat.refit.protocol import TensorEntry, VersionManifest, head_identity, head_name, stripe, to_fetch
from preheat.refit.publisher import Publisher, tensor_view
from preheat.refit.server import INFO_ROUTE, RefitServer
from preheat.refit.swap import swap
from preheat.server.following import base_digests
from refit_trainer import NAME, Trainer

PROMPT = torch.arange(3, 40)  # token ids inside the tiny vocabulary


@pytest.fixture
def registry(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'registry'}"


@pytest.fixture(scope="module")
def shared_registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"file://{tmp_path_factory.mktemp('registry')}"


@pytest.fixture(scope="module")
def trainer(kv_model: Path, shared_registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    """One trainer for the module (a process start costs seconds): each test follows it from where it is."""
    process = Trainer(kv_model, shared_registry, tmp_path_factory.mktemp("versions"))
    yield process
    process.close()


@pytest.fixture
def own_trainer(kv_model: Path, registry: str, tmp_path: Path) -> Iterator[Trainer]:
    """A trainer this test may kill."""
    process = Trainer(kv_model, registry, tmp_path / "versions")
    yield process
    process.close()


def follower(model: Path, registry: str, **options: object) -> Follower:
    engine = Engine.from_checkpoint(str(model))
    return Follower(NAME, engine, registry=registry, base_digests=base_digests(str(model)), poll_s=0.1, **options)  # type: ignore[arg-type]


def logits(engine: Engine, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    model, cache = engine.model, engine.kv_cache
    assert model is not None
    assert cache is not None
    seq = cache.new_sequence()
    try:
        with torch.inference_mode():
            out: torch.Tensor = model.forward(ids, 0, cache, seq, all_logits=True)
    finally:
        cache.release(seq)
    return out


def test_follower_computes_bitwise_what_a_fresh_replica_of_the_version_computes(
    trainer: Trainer, kv_model: Path, shared_registry: str
) -> None:
    replica = follower(kv_model, shared_registry)
    try:
        for _ in range(2):
            version, _, _ = trainer.publish(0.1)
            assert replica.step()
            assert replica.version == version
            fresh = Engine.from_checkpoint(str(trainer.reference(version)))
            assert torch.equal(logits(replica.engine), logits(fresh))
            greedy = SamplingParams(max_tokens=8, temperature=0)
            ours = [s.token_id for s in replica.engine.generate(PROMPT.tolist(), greedy)]
            assert ours == [s.token_id for s in fresh.generate(PROMPT.tolist(), greedy)]
    finally:
        replica.stop()


def test_only_changed_tensors_move(trainer: Trainer, kv_model: Path, shared_registry: str) -> None:
    replica = follower(kv_model, shared_registry)
    try:
        trainer.publish(0.1)
        assert replica.step()  # on version N-1 now
        version, changed_bytes, total = trainer.publish(0.1)
        assert replica.step()
        last = replica.last
        assert last is not None
        assert last.version == version
        assert last.nbytes == changed_bytes  # the base checkpoint's digests told it what it already holds
        assert last.nbytes <= 0.2 * total
        assert last.model_bytes == total
    finally:
        replica.stop()


def test_a_replica_that_finished_serves_the_version_when_the_trainer_dies(
    own_trainer: Trainer, kv_model: Path, registry: str
) -> None:
    trainer = own_trainer
    first, second = follower(kv_model, registry), follower(kv_model, registry)
    try:
        for replica in (first, second):
            replica._heartbeat.start()  # type: ignore[union-attr]  # announce, as start() does, without its thread
        version, changed_bytes, _ = trainer.publish(0.1)
        assert first.step()
        trainer.kill()  # its registry entry stays behind: the dead trainer must cost a refused connection, no more
        assert second.step()
        assert second.version == version
        assert second.last is not None
        assert second.last.sources == {first.server.address: changed_bytes}  # type: ignore[union-attr]
        assert torch.equal(logits(second.engine), logits(Engine.from_checkpoint(str(trainer.reference(version)))))
    finally:
        first.stop()
        second.stop()


def announce(registry: str, address: str) -> None:
    FileRegistry(registry.removeprefix("file://")).announce(
        PeerEntry(head_identity(NAME), address, name=head_name(NAME)), ttl=60
    )


def test_a_version_that_fails_verification_is_not_served(kv_model: Path, registry: str) -> None:
    replica = follower(kv_model, registry)
    before = logits(replica.engine)
    weight = replica.engine.model.norm  # type: ignore[union-attr]
    entry = TensorEntry("model.norm.weight", "F32", tuple(weight.shape), weight.nbytes, "xxh3-128:" + "ab" * 16)
    with RefitServer(LyingHolder(VersionManifest(NAME, 1, (entry,)))) as liar:
        announce(registry, liar.address)
        try:
            assert not replica.step()
            status = replica.status()
            assert status["version"] is None  # still the loaded checkpoint
            assert status["failed"] == 1
            assert "does not match" in str(status["error"])
            assert torch.equal(logits(replica.engine), before)
            assert not replica.step()  # a failed version is not retried until asked or superseded
        finally:
            replica.stop()


class SlowHolder(LyingHolder):
    """Serves true bytes, slowly: a pull from it is still under way when the next version is published."""

    def __init__(self, manifest: VersionManifest, data: dict[str, torch.Tensor]) -> None:
        super().__init__(manifest)
        self.data = data

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        time.sleep(0.2)
        return tensor_view(self.data[tensor])


def test_a_version_published_during_a_pull_abandons_it(kv_model: Path, registry: str) -> None:
    from safetensors.torch import load_file

    weights = {n: t + 1 for n, t in load_file(str(kv_model / "model.safetensors")).items()}  # every tensor changed
    replica = follower(kv_model, registry)
    with Publisher(NAME, registry=registry) as publisher:
        old = publisher.publish(weights, 1)
        publisher.close()  # the old version stays only on the slow holder
        with RefitServer(SlowHolder(old, weights)) as slow:
            announce(registry, slow.address)
            with Publisher(NAME, registry=registry) as newer:
                newest = {n: t * 2 for n, t in weights.items()}

                def publish_soon() -> None:
                    time.sleep(0.5)
                    newer.publish(newest, 2)

                threading.Thread(target=publish_soon, daemon=True).start()
                try:
                    assert replica.step()
                    assert replica.version == 2
                    assert replica.abandoned == 1
                    assert torch.equal(replica.engine.model.norm, newest["model.norm.weight"])  # type: ignore[union-attr]
                finally:
                    replica.stop()


def test_a_pull_whose_holder_dies_midway_resumes_from_one_that_has_the_version(kv_model: Path, registry: str) -> None:
    from safetensors.torch import load_file

    weights = {n: t + 1 for n, t in load_file(str(kv_model / "model.safetensors")).items()}  # every tensor changed
    replica = follower(kv_model, registry)
    with Publisher(NAME, registry=registry) as publisher:
        manifest = publisher.publish(weights, 1)
    pulled: list[bool] = []
    slow = RefitServer(SlowHolder(manifest, weights)).start()
    announce(registry, slow.address)
    puller = threading.Thread(target=lambda: pulled.append(replica.step()), daemon=True)
    puller.start()
    time.sleep(0.5)
    slow.stop()  # dies mid-pull: its tensors not sent yet must come from elsewhere
    # A holder that has the whole version: the same epoch and version (a replica that finished it, say).
    with Publisher(NAME, registry=registry, epoch=manifest.epoch) as finished:
        finished.publish(weights, 1)
        puller.join(timeout=60)
        try:
            assert pulled == [True]
            assert replica.version == 1
            assert replica.last is not None
            assert set(replica.last.sources) == {slow.address, finished.server.address}
            assert torch.equal(replica.engine.model.norm, weights["model.norm.weight"])  # type: ignore[union-attr]
        finally:
            replica.stop()


def cut_short_holder(manifest: VersionManifest) -> tuple[str, threading.Thread]:
    """A holder that dies mid-tensor: it announces the whole length, sends half the bytes, and closes. Serves one
    request; returns its address and its thread."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                path = conn.recv(65536).split(b" ")[1].decode()
                entry = manifest.entry(path.rsplit("/", 1)[-1])
                nbytes = entry.nbytes if entry is not None else 0
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {nbytes}\r\nConnection: close\r\n\r\n"
                conn.sendall(head.encode() + bytes(nbytes // 2))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return address, thread


def test_a_holder_that_dies_mid_tensor_is_not_taken_for_a_liar(kv_model: Path, registry: str) -> None:
    from preheat.refit.pull import Discovery, Pull

    weights = perturbed(kv_model, 1.0)
    with Publisher(NAME, registry=registry) as publisher:
        manifest = publisher.publish(weights, 1)
    needed = [e for e in manifest.tensors if e.name == "model.norm.weight"]
    dying, thread = cut_short_holder(manifest)
    with Publisher(NAME, registry=registry, epoch=manifest.epoch) as finished:  # appears once the dying one is gone
        finished.publish(weights, 1)
        looks: list[int] = []

        def rediscover() -> Discovery:  # the registry lists only the dying holder for a while, then both
            looks.append(1)
            key = [manifest.key]
            return Discovery({dying: key} | ({finished.server.address: key} if len(looks) > 3 else {}))

        result = Pull(manifest, needed, rediscover, headers={}, poll_s=0.1).run([dying])
        thread.join(timeout=10)
    assert result.sources == {finished.server.address: needed[0].nbytes}
    assert bytes(result.data["model.norm.weight"]) == bytes(tensor_view(weights["model.norm.weight"]))


def test_with_no_holder_left_a_replica_keeps_its_version(own_trainer: Trainer, kv_model: Path, registry: str) -> None:
    replica = follower(kv_model, registry)
    try:
        own_trainer.publish(0.1)
        own_trainer.kill()  # published, then gone before anyone pulled: its entry stays until it expires
        assert not replica.step()
        assert replica.version is None
        assert torch.equal(logits(replica.engine), logits(Engine.from_checkpoint(str(kv_model))))
    finally:
        replica.stop()


def test_a_holder_answering_deep_json_is_skipped_and_following_goes_on(kv_model: Path, registry: str) -> None:
    """A registered holder answering 64 KiB of "[" once raised RecursionError in the follower thread, which ended it
    (issue 27): the replica never followed again. That holder is skipped; versions from honest ones still apply."""
    with ScriptedServer(always(DEEP_JSON)) as hostile:
        announce(registry, hostile.url.removeprefix("http://"))
        replica = follower(kv_model, registry).start()
        try:
            with Publisher(NAME, registry=registry) as publisher:
                publisher.publish(perturbed(kv_model, 1.0), 1)
                assert replica.wait_for(1, timeout=60)
                publisher.publish(perturbed(kv_model, 2.0), 2)
                assert replica.wait_for(2, timeout=60)  # the same thread, still following
            assert ("GET", INFO_ROUTE) in hostile.requests  # it was asked, every look
            assert replica.status()["error"] is None  # a holder skipped is no failed version
        finally:
            replica.stop()


def test_refit_status_of_a_server_answering_deep_json_is_a_clear_error() -> None:
    """``preheat refit status URL`` once died in a RecursionError traceback on an answer like this (issue 27)."""
    with ScriptedServer(always(b'{"refit": ' + DEEP_JSON)) as hostile:
        done = subprocess.run([sys.executable, "-m", "preheat", "refit", "status", hostile.url],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"preheat: error: {hostile.url}/health: HTTP 200, not a preheat replica's health answer" in done.stderr
    assert "nested deeper than 64 levels" in done.stderr


def test_kv_chunks_are_never_reused_across_versions(trainer: Trainer, kv_model: Path, shared_registry: str) -> None:
    replica = follower(kv_model, shared_registry)
    engine = replica.engine
    spec = engine.kv_spec()
    assert spec is not None
    engine.attach_kv_tiers(build_tiers(spec, KVSettings(l1="16MB", chunk_tokens=16)))
    prompt, greedy = PROMPT.tolist(), SamplingParams(max_tokens=2, temperature=0)

    def cached() -> int:
        steps = list(engine.generate(prompt, greedy))  # the whole generation: its chunks are stored as it ends
        return steps[0].cached_tokens

    try:
        cached()
        assert cached() > 0  # same version, same prompt: its chunks are reused
        trainer.publish(0.1)
        assert replica.step()
        assert cached() == 0  # new weights: the old version's chunks are never looked up
        assert cached() > 0
    finally:
        replica.stop()


def perturbed(model: Path, delta: float) -> dict[str, torch.Tensor]:
    """The model's weights with the final norm changed by ``delta``: a version where one tensor moved."""
    from safetensors.torch import load_file

    weights = dict(load_file(str(model / "model.safetensors")))
    weights["model.norm.weight"] = weights["model.norm.weight"] + delta
    return weights


def test_asking_for_a_served_or_unpublished_version_does_not_stop_the_following(kv_model: Path, registry: str) -> None:
    replica = follower(kv_model, registry)
    with Publisher(NAME, registry=registry) as publisher:
        try:
            publisher.publish(perturbed(kv_model, 1.0), 1)
            assert replica.step()
            replica.request(1)  # POST /v1/preheat/refit {"version": 1} on a replica that serves it already
            assert not replica.step()
            publisher.publish(perturbed(kv_model, 2.0), 2)
            assert replica.step()  # it still follows what is published next
            assert replica.version == 2
            replica.request(3)  # asked for before the trainer published it
            assert not replica.step()
            assert replica.status()["failed"] is None  # not published yet is not a failure
            publisher.publish(perturbed(kv_model, 3.0), 3)
            assert replica.step()
            assert replica.version == 3
        finally:
            replica.stop()


def test_a_swap_that_runs_out_of_memory_leaves_the_replica_on_its_version(kv_model: Path, registry: str) -> None:
    def out_of_memory(swap_in: object) -> object:  # the generation thread's allocation fails during the swap
        raise torch.OutOfMemoryError("CUDA out of memory (the test's)")

    replica = follower(kv_model, registry, run_between=out_of_memory)
    before = logits(replica.engine)
    with Publisher(NAME, registry=registry) as publisher:
        try:
            publisher.publish(perturbed(kv_model, 1.0), 1)
            assert not replica.step()  # reported, not raised: the follower's thread keeps following
            status = replica.status()
            assert (status["version"], status["failed"]) == (None, 1)
            assert "out of memory" in str(status["error"])
            assert torch.equal(logits(replica.engine), before)
        finally:
            replica.stop()


def test_a_version_of_another_shape_is_refused_before_any_tensor_moves(kv_model: Path, registry: str) -> None:
    weights = perturbed(kv_model, 1.0)
    weights["model.norm.weight"] = torch.ones(3)  # another model published under the same name
    replica = follower(kv_model, registry)
    with Publisher(NAME, registry=registry) as publisher:
        try:
            publisher.publish(weights, 1)
            assert not replica.step()
            assert "shape" in str(replica.status()["error"])
            assert publisher.server.bytes_served == 0
        finally:
            replica.stop()


def test_replicas_of_a_tied_model_serve_a_version_whose_state_dict_lists_lm_head(
    kv_model: Path, registry: str, tmp_path: Path
) -> None:
    import json
    import shutil

    from safetensors.torch import save_file

    tied = tmp_path / "tied"
    shutil.copytree(kv_model, tied, ignore=shutil.ignore_patterns("preheat.json"))
    config = json.loads((tied / "config.json").read_text())
    weights = perturbed(kv_model, 0.0)
    weights.pop("lm_head.weight", None)
    save_file(weights, str(tied / "model.safetensors"), {"format": "pt"})
    (tied / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    state_dict = perturbed(tied, 1.0)
    state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]  # what a tied model's state_dict() lists
    first, second = follower(tied, registry, deadline_s=10.0), follower(tied, registry, deadline_s=10.0)
    try:
        for replica in (first, second):
            replica._heartbeat.start()  # type: ignore[union-attr]  # announce, as start() does, without its thread
        with Publisher(NAME, registry=registry) as publisher:
            publisher.publish(state_dict, 1)
            assert first.step()
        assert second.step()  # the trainer is gone: everything it needs comes from the first replica
        assert second.version == 1
        assert torch.equal(logits(second.engine), logits(first.engine))
    finally:
        first.stop()
        second.stop()


def test_inplace_swap_rolls_back_when_a_write_fails(trainer: Trainer, kv_model: Path, shared_registry: str) -> None:
    replica = follower(kv_model, shared_registry)
    try:
        trainer.publish(1.0)  # every tensor: all of them are then the model's own memory
        assert replica.step()
        model = replica.engine.model
        assert model is not None
        before = logits(replica.engine)
        new = {"model.norm.weight": model.norm + 1, "model.embed_tokens.weight": model.embed + 1}

        def fail_second(k: int) -> None:
            if k == 1:
                raise MemoryError("the second write fails")

        with pytest.raises(MemoryError):
            swap(model, new, inplace=True, owned=replica.owned, fail_after=fail_second)
        assert torch.equal(logits(replica.engine), before)  # the first write was rolled back
        report = swap(model, new, inplace=True, owned=replica.owned)
        assert report.mode == "inplace"
        assert torch.equal(model.norm, new["model.norm.weight"])
    finally:
        replica.stop()


def test_inplace_swap_refuses_the_read_only_mapped_checkpoint(kv_model: Path) -> None:
    engine = Engine.from_checkpoint(str(kv_model))
    assert engine.model is not None
    with pytest.raises(RefitError, match="read-only"):
        swap(engine.model, {"model.norm.weight": engine.model.norm + 1}, inplace=True)


def test_a_refit_cannot_change_the_architecture(kv_model: Path) -> None:
    engine = Engine.from_checkpoint(str(kv_model))
    assert engine.model is not None
    with pytest.raises(RefitError, match="shape"):
        swap(engine.model, {"model.norm.weight": torch.zeros(3)})
    with pytest.raises(RefitError, match="not one the model uses"):
        swap(engine.model, {"model.extra.weight": torch.zeros(3)})


def test_manifests_from_the_network_are_checked() -> None:
    good = VersionManifest(NAME, 4, (TensorEntry("w", "BF16", (2, 3), 12, "xxh3-128:" + 32 * "0"),))
    assert VersionManifest.from_json(good.to_json(), where="http://h/x") == good
    for bad in (b"[]", b"{", good.to_json().replace(b'"nbytes":12', b'"nbytes":13'),
                good.to_json().replace(b'"w"', b'"../w"'), good.to_json().replace(b'"BF16"', b'"F4"')):  # fmt: skip
        with pytest.raises(RefitError, match="http://h/x"):
            VersionManifest.from_json(bad, where="http://h/x")
    assert good.identity != VersionManifest(NAME, 5, good.tensors).identity  # never one identity for two versions
    assert good.identity != VersionManifest(NAME, 4, good.tensors, epoch=1).identity  # nor for two epochs


def test_a_replica_two_versions_behind_fetches_every_tensor_it_lacks() -> None:
    zero, one = "xxh3-128:" + 32 * "0", "xxh3-128:" + 32 * "1"
    a, b = TensorEntry("a", "U8", (4,), 4, one, changed=False), TensorEntry("b", "U8", (4,), 4, zero, changed=True)
    # "a" changed in the version before: unchanged now, but this replica never had it.
    assert [e.name for e in to_fetch({"a": zero, "b": one}, VersionManifest(NAME, 3, (a, b)))] == ["a", "b"]
    plan = stripe([a, b], ["x", "y"])
    assert sorted(len(v) for v in plan.values()) == [1, 1]


def test_publishing_an_older_version_is_refused(registry: str) -> None:
    with Publisher(NAME, registry=registry) as publisher:
        publisher.publish({"w": torch.zeros(2)}, 3)
        with pytest.raises(RefitError, match="not newer"):
            publisher.publish({"w": torch.ones(2)}, 3)
        manifest = publisher.publish({"w": torch.zeros(2), "v": torch.ones(2)}, dtype=torch.bfloat16)
        assert manifest.version == 4
        assert {t.name: (t.dtype, t.changed) for t in manifest.tensors} == {"w": ("BF16", True), "v": ("BF16", True)}
        again = publisher.publish({"w": torch.zeros(2), "v": torch.ones(2) * 2}, dtype=torch.bfloat16)
        assert {t.name: t.changed for t in again.tensors} == {"w": False, "v": True}
        with pytest.raises(RefitError, match="not a dotted identifier"):
            publisher.publish({"../w": torch.zeros(2)})


def test_a_publisher_or_follower_refused_at_construction_leaves_no_server_behind(kv_model: Path, registry: str) -> None:
    from preheat.core.errors import ConfigError

    def servers() -> int:
        return sum(t.name == RefitServer.thread_name for t in threading.enumerate())

    before = servers()
    with pytest.raises(ConfigError, match="ttl"):
        Publisher(NAME, registry=registry, ttl=0)
    with pytest.raises(ConfigError, match="ttl"):
        follower(kv_model, registry, ttl=0)
    assert servers() == before


def test_the_follower_needs_the_builtin_engine_and_a_valid_name(kv_model: Path, registry: str) -> None:
    engine = Engine.from_checkpoint(str(kv_model))
    with pytest.raises(RefitError, match="refit name"):
        Follower("../x", engine, registry=registry, serve=False)


def test_refit_publish_serves_a_checkpoint_on_disk(kv_model: Path, registry: str) -> None:
    command = [sys.executable, "-m", "preheat", "refit", "publish", str(kv_model), "--name", NAME,
               "--registry", registry, "--version", "7"]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as publisher:
        try:
            assert publisher.stdout is not None
            line = publisher.stdout.readline()
            assert "serving version 7 of tiny" in line, line
            replica = follower(kv_model, registry)
            try:
                assert replica.step()
                assert replica.version == 7
                assert replica.last is not None
                assert replica.last.nbytes == 0  # the same weights as the loaded checkpoint: nothing moves
            finally:
                replica.stop()
        finally:
            publisher.send_signal(signal.SIGINT)
            publisher.wait(timeout=30)


def test_refit_publish_asks_for_the_version(kv_model: Path, registry: str) -> None:
    command = [sys.executable, "-m", "preheat", "refit", "publish", str(kv_model), "--name", NAME,
               "--registry", registry]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--version" in done.stderr


def test_refit_publish_names_a_directory_without_weights(tmp_path: Path, registry: str) -> None:
    command = [sys.executable, "-m", "preheat", "refit", "publish", str(tmp_path), "--name", NAME,
               "--registry", registry, "--version", "1"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert str(tmp_path) in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_both_swaps_give_the_fresh_replicas_logits(trainer: Trainer, kv_model: Path, registry: str) -> None:
    engine = Engine.from_checkpoint(str(kv_model), device="cuda")
    assert engine.model is not None
    version, _, _ = trainer.publish(0.5)
    fresh = Engine.from_checkpoint(str(trainer.reference(version)), device="cuda")
    want = logits(fresh, PROMPT.cuda())
    from safetensors.torch import load_file

    new = load_file(str(trainer.reference(version) / "model.safetensors"))
    assert swap(engine.model, new, inplace=True).mode == "inplace"  # the model's own device memory, overwritten
    assert torch.equal(logits(engine, PROMPT.cuda()), want)
    engine = Engine.from_checkpoint(str(kv_model), device="cuda")
    assert engine.model is not None
    assert swap(engine.model, new).mode == "double_buffer"
    assert torch.equal(logits(engine, PROMPT.cuda()), want)


def test_serve_settings_for_following(kv_model: Path, registry: str, tmp_path: Path) -> None:
    from preheat.core.errors import ConfigError
    from preheat.server.settings import ServeSettings

    with pytest.raises(ConfigError, match="--registry"):
        ServeSettings.resolve({"model": str(kv_model), "follow": True}, {})
    with pytest.raises(ConfigError, match="--max-staleness"):
        ServeSettings.resolve({"model": str(kv_model), "max_staleness": 1}, {})
    env = {"PREHEAT_FOLLOW": "1", "PREHEAT_MAX_STALENESS": "2", "PREHEAT_REGISTRY": registry}
    settings = ServeSettings.resolve({"model": str(kv_model), "served_model_name": "policy"}, env)
    assert (settings.follow, settings.max_staleness, settings.refit_name) == (True, 2, "policy")
    assert settings.refit_deadline == 120.0
    env["PREHEAT_REFIT_DEADLINE"] = "30"
    assert ServeSettings.resolve({"model": str(kv_model)}, env).refit_deadline == 30.0
    with pytest.raises(ConfigError, match="--refit-deadline"):
        ServeSettings.resolve({"model": str(kv_model), "refit_deadline": 0.0}, env)
    assert ServeSettings.resolve({"model": "preheat://policy-7b"}, {}).refit_name == "policy-7b"
    with pytest.raises(ConfigError, match="--compile"):
        ServeSettings.resolve({"model": str(kv_model), "follow": True, "registry": registry, "compile": True}, {})
    with pytest.raises(ConfigError, match="PREHEAT_PEER_TOKEN"):  # not a replica that loads, then cannot follow
        ServeSettings.resolve({"model": str(kv_model), "follow": True, "registry": registry, "host": "0.0.0.0"}, {})
    with pytest.raises(ConfigError, match="--refit-trust-key"):  # a fleet beyond this machine: versions are signed
        ServeSettings.resolve({"model": str(kv_model), "follow": True, "registry": registry, "host": "0.0.0.0",
                               "peer_token": "s3cret"}, {})  # fmt: skip
    key = make_keypair(tmp_path / "keys", "trainer")
    shared = ServeSettings.resolve({"model": str(kv_model), "follow": True, "registry": registry, "host": "0.0.0.0",
                                    "peer_token": "s3cret", "refit_trust_key": [str(key.public)]}, {})  # fmt: skip
    assert shared.follow
    assert (shared.refit_trust_key, shared.refit_max_jump) == ((str(key.public),), 1_000_000)
    env = {"PREHEAT_REFIT_TRUST_KEY": str(key.public), "PREHEAT_REFIT_MAX_JUMP": "10"}
    loopback = ServeSettings.resolve({"model": str(kv_model), "follow": True, "registry": registry}, env)
    assert (loopback.refit_trust_key, loopback.refit_max_jump) == ((str(key.public),), 10)
    with pytest.raises(ConfigError, match="private key"):  # the trainer's half, given by mistake
        ServeSettings.resolve({"model": str(kv_model), "follow": True, "registry": registry,
                               "refit_trust_key": [str(key.private)]}, {})  # fmt: skip
    with pytest.raises(ConfigError, match="--refit-max-jump"):
        ServeSettings.resolve({"model": str(kv_model), "refit_max_jump": 0}, {})
