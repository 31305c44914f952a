"""Compiled-artifact blobs: packed under a key, checked, served by peers, never installed under another key, and
never extracted outside their directory or as anything but plain files and directories."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from artifactkit import KEY, TOKEN, KeyPair, make_inductor_dir, member, tar_of
from preheat.artifacts import blobs as artifacts
from preheat.artifacts.store import ArtifactStore, fetch
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.core.errors import PeerError
from preheat.peer.server import PeerServer


@pytest.fixture
def inductor_dir(tmp_path: Path) -> Path:
    return make_inductor_dir(tmp_path / "inductor")


def test_a_blob_installs_the_same_files_for_the_same_key(inductor_dir: Path, tmp_path: Path) -> None:
    blob = artifacts.built_here(KEY, artifacts.pack(KEY, str(inductor_dir)))
    target = tmp_path / "fresh"
    artifacts.install(blob, str(target), where="test")
    assert (target / "fxgraph" / "ab" / "entry").read_bytes() == b"graph" * 100
    assert (target / "aa" / "kernel.so").read_bytes() == bytes(range(256)) * 8
    assert not (target / "locks").exists()


def test_packing_leaves_out_symlinks(inductor_dir: Path) -> None:
    (inductor_dir / "aa" / "link").symlink_to("/etc/passwd")
    verified = artifacts.built_here(KEY, artifacts.pack(KEY, str(inductor_dir)))
    assert artifacts.check_payload(verified.payload, where="test") == 5  # fxgraph, fxgraph/ab, entry, aa, kernel.so


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
    inductor_dir: Path, fleet_key: KeyPair, change: dict[str, object]
) -> None:
    other = dataclasses.replace(KEY, **change)  # type: ignore[arg-type]
    blob = artifacts.sign(artifacts.pack(other, str(inductor_dir)), fleet_key.signer, where="test")
    with pytest.raises(PeerError, match=f"differs in {next(iter(change))}"):
        artifacts.verify(blob, KEY, fleet_key.trusted, where="peer x")


def test_a_corrupt_or_truncated_blob_is_refused(inductor_dir: Path, fleet_key: KeyPair) -> None:
    good = artifacts.sign(artifacts.pack(KEY, str(inductor_dir)), fleet_key.signer, where="test")
    flipped = bytearray(good)
    flipped[-200] ^= 0xFF  # inside the payload
    with pytest.raises(PeerError, match="checksum mismatch"):
        artifacts.verify(bytes(flipped), KEY, fleet_key.trusted, where="peer x")
    unsigned_len = len(good) - (len(artifacts.SIGNATURE_MAGIC) + 96)
    with pytest.raises(PeerError, match="truncated"):
        artifacts.verify(good[: unsigned_len - 10], KEY, fleet_key.trusted, where="peer x")
    with pytest.raises(PeerError, match="unexpected bytes after the artifact payload"):
        artifacts.verify(good[:-10], KEY, fleet_key.trusted, where="peer x")


def test_a_blob_of_the_unsigned_format_1_is_refused(inductor_dir: Path) -> None:
    old = b"PREHEAT-ARTIFACT 1\n" + artifacts.pack(KEY, str(inductor_dir))[len(artifacts.MAGIC) :]
    with pytest.raises(PeerError, match="another format version"):
        artifacts.parse(old, where="peer x")


def _signed(payload: bytes, key: KeyPair) -> bytes:
    return artifacts.sign(artifacts.encode(KEY, payload), key.signer, where="test")


@pytest.mark.parametrize(
    ("members", "reason"),
    [
        ([(member("../../escaped"), b"evil")], "not a relative name"),
        ([(member("a/../../escaped"), b"evil")], "not a relative name"),
        ([(member("/tmp/escaped"), b"evil")], "not a relative name"),
        ([(member("link", tarfile.SYMTYPE, link="/etc/passwd"), b"")], "links and devices"),
        ([(member("link", tarfile.SYMTYPE, link="inside"), b"")], "links and devices"),
        ([(member("a"), b"x"), (member("hard", tarfile.LNKTYPE, link="a"), b"")], "links and devices"),
        ([(member("dev", tarfile.CHRTYPE), b"")], "links and devices"),
        ([(member("pipe", tarfile.FIFOTYPE), b"")], "links and devices"),
        ([(member("a"), b"x"), (member("a"), b"y")], "appears twice"),
        ([(member("a"), b"x"), (member("a/b"), b"y")], "under a file"),
        ([(member("a/b"), b"x"), (member("a"), b"y")], "a file where other members need a directory"),
        ([(member("a", tarfile.DIRTYPE), b""), (member("a/", tarfile.DIRTYPE), b"")], "appears twice"),
    ],
)
def test_a_signed_payload_with_a_dangerous_member_is_refused(
    tmp_path: Path, fleet_key: KeyPair, members: list[tuple[tarfile.TarInfo, bytes]], reason: str
) -> None:
    blob = _signed(tar_of(*members), fleet_key)
    with pytest.raises(PeerError, match=reason):
        artifacts.verify(blob, KEY, fleet_key.trusted, where="peer x")
    assert not (tmp_path / "escaped").exists()


def test_a_directory_may_follow_the_members_under_it(tmp_path: Path, fleet_key: KeyPair) -> None:
    payload = tar_of((member("a/b"), b"x"), (member("a", tarfile.DIRTYPE), b""))
    verified = artifacts.verify(_signed(payload, fleet_key), KEY, fleet_key.trusted, where="peer x")
    artifacts.install(verified, str(tmp_path / "dir"), where="peer x")
    assert (tmp_path / "dir" / "a" / "b").read_bytes() == b"x"


@pytest.mark.parametrize(
    "pax",
    [
        {"GNU.sparse.map": "x,y", "GNU.sparse.offset": "1"},  # tarfile raises ValueError parsing these
        {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"},
    ],
)
def test_malformed_sparse_headers_are_refused_not_crashed_on(fleet_key: KeyPair, pax: dict[str, str]) -> None:
    info = member("a")
    info.pax_headers = pax
    with pytest.raises(PeerError, match="refused"):
        artifacts.verify(_signed(tar_of((info, b"zz\n")), fleet_key), KEY, fleet_key.trusted, where="peer x")


def test_a_member_claiming_more_bytes_than_the_payload_holds_is_refused(fleet_key: KeyPair) -> None:
    claimed = tarfile.TarInfo("big")
    claimed.size = 10**9  # the header says 1 GB; 1 KiB follows
    payload = claimed.tobuf(tarfile.USTAR_FORMAT) + b"x" * 1024 + b"\0" * 1024
    with pytest.raises(PeerError, match="past the end"):
        artifacts.verify(_signed(payload, fleet_key), KEY, fleet_key.trusted, where="peer x")


def test_a_compressed_payload_is_never_decompressed(fleet_key: KeyPair) -> None:
    import gzip

    bomb = gzip.compress(tar_of((member("zeros"), b"\0" * (1 << 20))))
    with pytest.raises(PeerError, match="refused"):
        artifacts.verify(_signed(bomb, fleet_key), KEY, fleet_key.trusted, where="peer x")


def test_installed_files_are_plain_files_with_safe_modes(tmp_path: Path, fleet_key: KeyPair) -> None:
    info = member("tool")
    info.mode = 0o6777  # setuid, setgid, world-writable
    verified = artifacts.verify(_signed(tar_of((info, b"#!")), fleet_key), KEY, fleet_key.trusted, where="peer x")
    artifacts.install(verified, str(tmp_path / "dir"), where="peer x")
    mode = os.stat(tmp_path / "dir" / "tool").st_mode
    assert not mode & 0o6000
    assert not mode & 0o002


def test_the_signature_covers_the_header_and_payload(inductor_dir: Path, fleet_key: KeyPair) -> None:
    blob = artifacts.sign(artifacts.pack(KEY, str(inductor_dir)), fleet_key.signer, where="test")
    parsed = artifacts.parse(blob, where="test")
    assert parsed.body_sha256 == hashlib.sha256(blob[: parsed.body_end]).hexdigest()
    assert parsed.signer is not None
    assert blob[parsed.body_end :].startswith(artifacts.SIGNATURE_MAGIC)
    header_len = int.from_bytes(blob[len(artifacts.MAGIC) : len(artifacts.MAGIC) + 8], "little")
    header = json.loads(blob[len(artifacts.MAGIC) + 8 : len(artifacts.MAGIC) + 8 + header_len])
    assert set(header) == {"key", "size", "sha256"}


def test_the_key_names_everything_compiled_code_depends_on() -> None:
    key = artifacts.artifact_key(identity=KEY.identity, device="cpu", dtype="float32", max_model_len=2048)
    assert key.device == "cpu"
    assert key.arch.startswith(("x86_64", "aarch64", "arm64"))
    assert key.hex != dataclasses.replace(key, max_model_len=4096).hex


@pytest.fixture
def serving_peer(tmp_path: Path, kv_model: Path, inductor_dir: Path) -> Iterator[tuple[PeerServer, ArtifactStore]]:
    store = ArtifactStore(str(tmp_path / "cache"))
    store.put(artifacts.built_here(KEY, artifacts.pack(KEY, str(inductor_dir))))
    manifest = Manifest.from_json((kv_model / MANIFEST_NAME).read_bytes(), where=str(kv_model))
    with PeerServer(kv_model, manifest, token=TOKEN, artifacts=store.lookup) as peer:
        yield peer, store


def test_peers_serve_the_artifacts_they_built_by_key(serving_peer: tuple[PeerServer, ArtifactStore]) -> None:
    peer, store = serving_peer
    blob = fetch(peer.address, KEY, token=TOKEN)
    stored = store.load(KEY)
    assert stored is not None
    assert blob == stored.blob
    assert fetch(peer.address, dataclasses.replace(KEY, dtype="bfloat16"), token=TOKEN) is None
    assert fetch(peer.address, KEY, token="wrong") is None
