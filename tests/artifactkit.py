"""Compiled-artifact fixtures: a key, an Inductor-shaped directory, key pairs, raw tar payloads, and a peer serving
whatever blob file it is given (as an old or malicious replica would)."""

from __future__ import annotations

import contextlib
import io
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from preheat.artifacts.blobs import ArtifactKey
from preheat.artifacts.signing import SigningKey, TrustedKeys, generate, read_public_key
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.peer.registry import FileRegistry, PeerEntry
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
TOKEN = "peer-token"


def make_inductor_dir(root: Path) -> Path:
    """A directory shaped like an Inductor cache: nested files, plus a locks dir that must not travel."""
    (root / "fxgraph" / "ab").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100)
    (root / "aa").mkdir()
    (root / "aa" / "kernel.so").write_bytes(bytes(range(256)) * 8)
    (root / "locks").mkdir()
    (root / "locks" / "x.lock").write_bytes(b"")
    return root


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path

    @property
    def signer(self) -> SigningKey:
        return SigningKey.read(str(self.private))

    @property
    def trusted(self) -> TrustedKeys:
        return TrustedKeys(frozenset({read_public_key(str(self.public))}))


def make_keypair(directory: Path, name: str) -> KeyPair:
    """A real key pair written the way ``preheat artifacts keygen`` writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    private, public, _ = generate(str(directory / name))
    return KeyPair(Path(private), Path(public))


def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    """A tar payload of exactly these members (for payloads ``pack`` would never make)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, *, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


@contextlib.contextmanager
def peer_serving_file(model: Path, blob: Path, registry: Path, *, identity: str = KEY.identity) -> Iterator[PeerServer]:
    """A peer server that answers every artifact key with ``blob``'s bytes (no checks: an old or hostile replica),
    announced in a ``file://`` registry under ``identity``."""
    manifest = Manifest.from_json((model / MANIFEST_NAME).read_bytes(), where=str(model))
    with PeerServer(model, manifest, token=TOKEN, artifacts=lambda _key: str(blob)) as peer:
        FileRegistry(str(registry)).announce(PeerEntry(identity=identity, address=peer.address), ttl=600)
        yield peer
