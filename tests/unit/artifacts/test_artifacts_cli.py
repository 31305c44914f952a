"""``preheat artifacts keygen|sign|verify`` and ``preheat serve --trust-key``, as an operator types them."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from artifactkit import KEY, make_inductor_dir, make_keypair
from preheat.artifacts import blobs as artifacts
from preheat.artifacts.signing import fingerprint, read_public_key
from preheat.artifacts.store import ArtifactStore
from preheat.cli.main import main
from preheat.core.errors import ConfigError
from preheat.server.settings import ServeSettings


def test_keygen_writes_a_private_key_only_its_owner_reads_and_a_public_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["artifacts", "keygen", str(tmp_path / "fleet.key")]) == 0
    assert stat.S_IMODE(os.stat(tmp_path / "fleet.key").st_mode) == 0o600
    assert (tmp_path / "fleet.key").read_text().startswith("-----BEGIN PRIVATE KEY-----")
    public = read_public_key(str(tmp_path / "fleet.key.pub"))
    out = capsys.readouterr().out
    assert fingerprint(public) in out
    assert f"--trust-key {tmp_path / 'fleet.key.pub'}" in out


def test_keygen_never_replaces_a_key_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "fleet.key")
    assert main(["artifacts", "keygen", out]) == 0
    before = (tmp_path / "fleet.key.pub").read_bytes()
    assert main(["artifacts", "keygen", out]) == 1
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "fleet.key.pub").read_bytes() == before
    assert main(["artifacts", "keygen", out, "--force"]) == 0
    assert (tmp_path / "fleet.key.pub").read_bytes() != before


def test_a_signed_blob_verifies_only_against_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = make_keypair(tmp_path / "keys", "fleet.key")
    other = make_keypair(tmp_path / "keys", "other.key")
    blob = tmp_path / "a.blob"
    blob.write_bytes(artifacts.pack(KEY, str(make_inductor_dir(tmp_path / "built"))))
    assert main(["artifacts", "verify", str(blob), "--trust-key", str(keys.public)]) == 1
    assert "not signed" in capsys.readouterr().out
    assert main(["artifacts", "sign", str(blob), "--key", str(keys.private)]) == 0
    capsys.readouterr()
    assert main(["artifacts", "verify", str(blob), "--trust-key", str(keys.public)]) == 0
    assert "signed by ed25519:" in capsys.readouterr().out
    assert main(["artifacts", "verify", str(blob), "--trust-key", str(other.public)]) == 1
    assert "not a trusted key" in capsys.readouterr().out


def test_signing_the_node_cache_signs_only_what_this_node_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = make_keypair(tmp_path / "keys", "fleet.key")
    builder = make_keypair(tmp_path / "keys", "builder.key")
    cache = tmp_path / "cache"
    store = ArtifactStore(str(cache), builder.trusted)
    built = artifacts.pack(KEY, str(make_inductor_dir(tmp_path / "built")))
    store.put(artifacts.built_here(KEY, built))
    other_key = dataclasses.replace(KEY, dtype="bfloat16")
    received = artifacts.sign(artifacts.pack(other_key, str(tmp_path / "built")), builder.signer, where="test")
    store.put(artifacts.verify(received, other_key, builder.trusted, where="peer"))

    assert main(["artifacts", "sign", "--key", str(keys.private), "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"signed {store.blob_path(KEY.hex)}" in out
    assert f"skipped {store.blob_path(other_key.hex)}: not built on this node" in out
    assert Path(store.blob_path(other_key.hex)).read_bytes() == received  # keeps its builder's signature
    newcomer = ArtifactStore(str(cache), keys.trusted)
    found = newcomer.load(KEY)
    assert found is not None
    assert found.local  # still this node's own build
    signed = Path(store.blob_path(KEY.hex)).read_bytes()
    assert artifacts.verify(signed, KEY, keys.trusted, where="peer").provenance.startswith("signed by")


def test_serve_takes_trust_keys_from_flags_and_the_environment(tmp_path: Path) -> None:
    a = make_keypair(tmp_path, "a.key")
    b = make_keypair(tmp_path, "b.key")
    model = str(tmp_path)
    flags = ServeSettings.resolve({"model": model, "trust_key": [str(a.public)]}, {})
    assert flags.trust_key == (str(a.public),)
    env = ServeSettings.resolve({"model": model}, {"PREHEAT_TRUST_KEY": f"{a.public}, {b.public}"})
    assert env.trust_key == (str(a.public), str(b.public))
    assert ServeSettings.resolve({"model": model}, {}).trust_key == ()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("private", "this is a private key; trust the public key beside it"),
        ("not a key\n", "not a PEM public key"),
        ("-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n-----END PUBLIC KEY-----\n", "not an Ed25519 public key"),
    ],
)
def test_serve_refuses_a_trust_key_that_is_not_an_ed25519_public_key(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "key.pub"
    if content == "private":
        path = make_keypair(tmp_path, "fleet.key").private
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        ServeSettings.resolve({"model": str(tmp_path), "trust_key": [str(path)]}, {})
