"""Compiled-artifact blobs: packed under a key, checksummed, served by peers, and never installed under another key."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.checkpoint.digest import digest_bytes
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.errors import PeerError
from preheat.peer import artifacts
from preheat.peer.artifacts import ArtifactKey, ArtifactStore
from preheat.peer.server import PeerServer

KEY = ArtifactKey(
    torch="2.13.0",
    triton=None,
    preheat="0.1.0",
    device="cpu",
    arch="x86_64+avx2",
    identity="xxh3-128:" + "cd" * 16,
    dtype="float32",
    max_model_len=2048,
)


@pytest.fixture
def inductor_dir(tmp_path: Path) -> Path:
    """A directory shaped like an Inductor cache: nested files, plus a locks dir that must not travel."""
    root = tmp_path / "inductor"
    (root / "fxgraph" / "ab").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100)
    (root / "aa").mkdir()
    (root / "aa" / "kernel.so").write_bytes(bytes(range(256)) * 8)
    (root / "locks").mkdir()
    (root / "locks" / "x.lock").write_bytes(b"")
    return root


def test_a_blob_installs_the_same_files_for_the_same_key(inductor_dir: Path, tmp_path: Path) -> None:
    blob = artifacts.pack(KEY, str(inductor_dir))
    target = tmp_path / "fresh"
    artifacts.install(blob, KEY, str(target), where="test")
    assert (target / "fxgraph" / "ab" / "entry").read_bytes() == b"graph" * 100
    assert (target / "aa" / "kernel.so").read_bytes() == bytes(range(256)) * 8
    assert not (target / "locks").exists()


@pytest.mark.parametrize(
    "change",
    [
        {"torch": "2.12.0"},
        {"triton": "3.4.0"},
        {"preheat": "0.2.0"},
        {"device": "cuda"},
        {"arch": "x86_64+avx2,avx512f"},
        {"identity": "xxh3-128:" + "ef" * 16},
        {"dtype": "bfloat16"},
        {"max_model_len": 4096},
    ],
)
def test_a_blob_for_another_key_is_never_installed(
    inductor_dir: Path, tmp_path: Path, change: dict[str, object]
) -> None:
    blob = artifacts.pack(dataclasses.replace(KEY, **change), str(inductor_dir))  # type: ignore[arg-type]
    target = tmp_path / "fresh"
    with pytest.raises(PeerError, match=f"differs in {next(iter(change))}"):
        artifacts.install(blob, KEY, str(target), where="peer x")
    assert not target.exists()


def test_a_corrupt_blob_is_refused(inductor_dir: Path, tmp_path: Path) -> None:
    blob = bytearray(artifacts.pack(KEY, str(inductor_dir)))
    blob[-100] ^= 0xFF
    with pytest.raises(PeerError, match="checksum"):
        artifacts.install(bytes(blob), KEY, str(tmp_path / "fresh"), where="peer x")
    with pytest.raises(PeerError, match="checksum"):
        artifacts.install(bytes(blob[:-10]), KEY, str(tmp_path / "fresh"), where="peer x")


def test_a_payload_escaping_its_directory_is_refused(tmp_path: Path) -> None:
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    data = payload.getvalue()
    header = json.dumps({"key": dataclasses.asdict(KEY), "checksum": digest_bytes(data), "size": len(data)}).encode()
    blob = artifacts.MAGIC + len(header).to_bytes(8, "little") + header + data
    with pytest.raises(PeerError, match="refused"):
        artifacts.install(blob, KEY, str(tmp_path / "a" / "b"), where="peer x")
    assert not (tmp_path / "escaped").exists()


def test_the_key_names_everything_compiled_code_depends_on() -> None:
    key = artifacts.artifact_key(identity=KEY.identity, device="cpu", dtype="float32", max_model_len=2048)
    assert key.device == "cpu"
    assert key.arch.startswith(("x86_64", "aarch64", "arm64"))
    assert key.hex != dataclasses.replace(key, max_model_len=4096).hex


@pytest.fixture
def serving_peer(tmp_path: Path, kv_model: Path, inductor_dir: Path) -> Iterator[tuple[PeerServer, ArtifactStore]]:
    store = ArtifactStore(str(tmp_path / "cache"))
    store.put(KEY, artifacts.pack(KEY, str(inductor_dir)))
    manifest = Manifest.from_json((kv_model / MANIFEST_NAME).read_bytes(), where=str(kv_model))
    with PeerServer(kv_model, manifest, token="t", artifacts=store.lookup) as peer:
        yield peer, store


def test_peers_serve_artifacts_by_key(serving_peer: tuple[PeerServer, ArtifactStore], tmp_path: Path) -> None:
    peer, store = serving_peer
    blob = artifacts.fetch(peer.address, KEY, token="t")
    assert blob == store.get(KEY)
    assert artifacts.fetch(peer.address, dataclasses.replace(KEY, dtype="bfloat16"), token="t") is None
    assert artifacts.fetch(peer.address, KEY, token="wrong") is None
    newcomer = ArtifactStore(str(tmp_path / "newcomer"))
    assert blob is not None
    newcomer.put(KEY, blob)
    assert newcomer.get(KEY) == blob
