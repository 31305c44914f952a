"""What a peer exposes and whom a puller trusts (docs/peer.md, "Trust").

- A peer server binds beyond loopback only with a token, and serves nothing outside its checkpoint directory.
- A puller takes its origin only from its operator (``--origin``/``PREHEAT_ORIGIN``), never from a registry entry;
  the origin's credentials go only to that origin and the peer token only to peers.

Servers are real: seed peers are ``python -m preheat.peer`` children or ``PeerServer``s, the origin a ``FileServer``,
and the ``RecordingServer``s (tests/recording.py) record the ``Authorization`` header of every request.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers import SeedPeer, copy_checkpoint
from preheat.checkpoint.manifest import Manifest
from preheat.core.errors import ConfigError, PreheatError, SourceNotFoundError
from preheat.peer.access import is_loopback
from preheat.peer.pull import PeerOptions, pull_from_peers
from preheat.peer.registry import FileRegistry, PeerEntry
from preheat.peer.server import PeerServer
from preheat.server.settings import ServeSettings
from preheat.store.cache import ModelCache
from preheat.testing.fileserver import FileServer
from recording import RecordingServer

PIECE = 256 * 1024
PEER_TOKEN = "peer-secret"
ORIGIN_TOKEN = "origin-secret"


@pytest.fixture
def recorder() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        yield server


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PREHEAT_HTTP_TOKEN", "PREHEAT_PEER_TOKEN", "PREHEAT_ORIGIN", "PREHEAT_REGISTRY", "PREHEAT_PEERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN_HOSTS", "127.0.0.1")  # the origin token is for this host's origins


def get(address: str, target: str, token: str | None = None) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=10)
    try:
        conn.request("GET", target, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# -- the peer server: token beyond loopback --------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "peer.internal"])
def test_a_peer_server_beyond_loopback_without_a_token_refuses_to_start(
    checkpoint: Path, manifest: Manifest, host: str
) -> None:
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match=r"PREHEAT_PEER_TOKEN.*--peer-host 127\.0\.0\.1"):
        PeerServer(checkpoint, manifest, host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_loopback_peer_server_needs_no_token(host: str) -> None:
    assert is_loopback(host)


def test_a_peer_server_on_every_interface_serves_only_with_the_token(checkpoint: Path, manifest: Manifest) -> None:
    with PeerServer(checkpoint, manifest, host="0.0.0.0", token=PEER_TOKEN) as peer:
        address = f"127.0.0.1:{peer.port}"
        name = manifest.files[0].name
        assert get(address, f"/peer/v1/files/{name}")[0] == 401
        assert get(address, f"/peer/v1/files/{name}", "guess")[0] == 403
        status, body = get(address, f"/peer/v1/files/{name}", PEER_TOKEN)
    assert status == 200
    assert body == (checkpoint / name).read_bytes()


def test_the_seed_peer_refuses_a_public_address_without_a_token(checkpoint: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREHEAT_PEER_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "preheat.peer", str(checkpoint), "--host", "0.0.0.0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "PREHEAT_PEER_TOKEN" in done.stderr
    assert "--host 127.0.0.1" in done.stderr


def test_serve_refuses_a_public_peer_without_a_token_before_loading(checkpoint: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREHEAT_")}
    done = subprocess.run(
        [sys.executable, "-m", "preheat", "serve", str(checkpoint), "--host", "0.0.0.0", "--port", "0", "--peer"],
        env={**env, "PREHEAT_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "PREHEAT_PEER_TOKEN (or --peer-token)" in done.stderr
    assert "--peer-host 127.0.0.1" in done.stderr
    assert "listening on" not in done.stdout  # refused before the bind, not after a model load


def test_the_peer_listener_follows_peer_host_not_the_apis_host(checkpoint: Path) -> None:
    public_api = ServeSettings.resolve(
        {"model": str(checkpoint), "host": "0.0.0.0", "peer": True}, env={"PREHEAT_PEER_HOST": "127.0.0.1"}
    )
    assert public_api.peer_bind_host == "127.0.0.1"  # the API on the network, the weights on loopback only
    assert ServeSettings.resolve({"model": str(checkpoint), "peer": True}, env={}).peer_bind_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="--peer-host"):
        ServeSettings.resolve({"model": str(checkpoint), "peer": True, "peer_host": "0.0.0.0"}, env={})
    with_token = ServeSettings.resolve(
        {"model": str(checkpoint), "peer": True, "peer_host": "0.0.0.0"}, env={"PREHEAT_PEER_TOKEN": PEER_TOKEN}
    )
    assert with_token.peer_bind_host == "0.0.0.0"


# -- the peer server: nothing outside the checkpoint -----------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/peer/v1/files/../../../../etc/passwd",
        "/peer/v1/files/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/peer/v1/files/%2E%2E%2F%2E%2E%2Fetc%2Fpasswd",
        "/peer/v1/files/..%2f..%2f..%2fetc%2fpasswd",
        "/peer/v1/files//etc/passwd",
        "/peer/v1/files/%2Fetc%2Fpasswd",
        "/peer/v1/files/outside.txt",  # a symlink in the directory, not in the manifest
        "/peer/v1/files/config.json/../outside.txt",
    ],
)
def test_no_request_reaches_a_file_outside_the_checkpoint(
    checkpoint: Path, manifest: Manifest, tmp_path: Path, target: str
) -> None:
    root = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"root:x:0:0:the secret\n")
    (root / "outside.txt").symlink_to(secret)
    with PeerServer(root, manifest) as peer:
        status, body = get(f"127.0.0.1:{peer.port}", target)
    assert status == 403
    assert b"secret" not in body
    assert b"root:" not in body


def test_a_manifest_file_that_is_a_symlink_leading_outside_is_not_served(
    checkpoint: Path, manifest: Manifest, tmp_path: Path
) -> None:
    root = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = manifest.extra_files[0].name if manifest.extra_files else manifest.files[0].name
    (root / victim).rename(outside / victim)  # same bytes, but now outside the checkpoint directory
    (root / victim).symlink_to(outside / victim)
    with PeerServer(root, manifest) as peer:
        address = f"127.0.0.1:{peer.port}"
        status, _ = get(address, f"/peer/v1/files/{victim}")
        others = [get(address, f"/peer/v1/files/{f.name}")[0] for f in manifest.files if f.name != victim]
    assert status == 403
    assert set(others) <= {200}


def test_a_symlink_or_fifo_planted_after_start_is_not_followed(
    checkpoint: Path, manifest: Manifest, tmp_path: Path
) -> None:
    root = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"the secret" * 1000)
    first, second = manifest.files[0].name, (manifest.extra_files[0].name if manifest.extra_files else None)
    with PeerServer(root, manifest) as peer:
        (root / first).unlink()
        (root / first).symlink_to(secret)
        status, body = get(f"127.0.0.1:{peer.port}", f"/peer/v1/files/{first}")
        assert status == 404
        assert b"secret" not in body
        if second is not None:
            (root / second).unlink()
            os.mkfifo(root / second)  # opening it for reading would wait for a writer forever
            assert get(f"127.0.0.1:{peer.port}", f"/peer/v1/files/{second}")[0] == 403


# -- the puller: origins and credentials -----------------------------------------------------------------------------


def announce_gone_peer(tmp_path: Path, manifest: Manifest, origin: str) -> FileRegistry:
    """A registry entry naming ``origin``, for a peer that no longer answers."""
    registry = FileRegistry(str(tmp_path / "registry"))
    with FileServer(tmp_path) as gone:  # bound, then closed: nothing listens on its port any more
        address = f"127.0.0.1:{gone.port}"
    registry.announce(PeerEntry(identity=manifest.identity, address=address, name="tiny", origin=origin), ttl=600)
    return registry


def test_an_origin_named_only_by_a_registry_entry_is_never_contacted(
    manifest: Manifest, cache: ModelCache, tmp_path: Path, recorder: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", ORIGIN_TOKEN)  # the node's credential for its real origin
    planted = f"http://127.0.0.1:{recorder.port}/models/tiny"
    registry = announce_gone_peer(tmp_path, manifest, planted)
    with pytest.raises(SourceNotFoundError, match="--origin") as caught:
        pull_from_peers("preheat://tiny", cache, PeerOptions(registry=registry.url, chunk_bytes=PIECE))
    assert recorder.seen == []  # not a request, let alone one carrying the node's token
    assert planted in str(caught.value)  # the operator is told which origin was offered, and ignored


def test_a_registry_entry_cannot_name_a_local_directory_as_the_origin(
    checkpoint: Path, manifest: Manifest, cache: ModelCache, tmp_path: Path
) -> None:
    registry = announce_gone_peer(tmp_path, manifest, str(checkpoint))  # a path on the puller's own disk
    with pytest.raises(SourceNotFoundError, match="--origin"):
        pull_from_peers("preheat://tiny", cache, PeerOptions(registry=registry.url, chunk_bytes=PIECE))
    assert cache.lookup(manifest.identity) is None


def test_the_operators_origin_is_used_and_the_announced_one_ignored(
    checkpoint: Path, manifest: Manifest, cache: ModelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", ORIGIN_TOKEN)
    with RecordingServer() as planted, FileServer(checkpoint, token=ORIGIN_TOKEN) as origin:
        registry = announce_gone_peer(tmp_path, manifest, f"http://127.0.0.1:{planted.port}/models/tiny")
        options = PeerOptions(registry=registry.url, origin=origin.url, chunk_bytes=PIECE)
        result = pull_from_peers("preheat://tiny", cache, options)
        statuses = origin.stats.snapshot().statuses
    assert result.key == manifest.identity
    assert set(result.sources) == {"origin"}
    assert planted.seen == []
    assert any("ignored the origin peers announce" in note for note in result.notes)
    assert 401 not in statuses
    assert 403 not in statuses  # the origin only ever got its own token


def test_the_peer_token_goes_to_peers_and_the_origin_token_to_the_origin(
    manifest: Manifest, cache: ModelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", ORIGIN_TOKEN)
    with RecordingServer() as fake_peer, RecordingServer() as fake_origin:
        options = PeerOptions(
            peers=(f"127.0.0.1:{fake_peer.port}",),
            origin=f"http://127.0.0.1:{fake_origin.port}/models/tiny",
            token=PEER_TOKEN,
            chunk_bytes=PIECE,
        )
        with pytest.raises(PreheatError):  # neither serves a checkpoint: only what they were sent matters here
            pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert fake_peer.seen
    assert fake_origin.seen
    assert {s.authorization for s in fake_peer.seen} == {f"Bearer {PEER_TOKEN}"}
    assert {s.authorization for s in fake_origin.seen} == {f"Bearer {ORIGIN_TOKEN}"}


def test_a_peer_gets_no_authorization_header_when_no_peer_token_is_set(
    manifest: Manifest, cache: ModelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", ORIGIN_TOKEN)  # must not be offered to peers in its place
    with RecordingServer() as fake_peer:
        options = PeerOptions(peers=(f"127.0.0.1:{fake_peer.port}",), chunk_bytes=PIECE)
        with pytest.raises(SourceNotFoundError):
            pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert fake_peer.seen
    assert {s.authorization for s in fake_peer.seen} == {None}


def test_a_pull_from_token_peers_and_a_token_origin_delivers_from_both(
    checkpoint: Path, manifest: Manifest, cache: ModelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad_root = copy_checkpoint(checkpoint, tmp_path / "bad")
    victim = max(manifest.tensors, key=lambda r: r.nbytes)
    data = bytearray((bad_root / victim.file).read_bytes())
    data[victim.offset] ^= 0xFF  # one tensor the origin must send instead
    (bad_root / victim.file).write_bytes(bytes(data))
    monkeypatch.setenv("PREHEAT_HTTP_TOKEN", ORIGIN_TOKEN)
    with SeedPeer(bad_root, token=PEER_TOKEN) as peer, FileServer(checkpoint, token=ORIGIN_TOKEN) as origin:
        options = PeerOptions(peers=(peer.address,), origin=origin.url, token=PEER_TOKEN, chunk_bytes=PIECE)
        result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
        statuses = origin.stats.snapshot().statuses
    assert result.sources[f"peer {peer.address}"] > 0  # the peer accepted the peer token
    assert result.sources["origin"] > 0  # the origin accepted its own token
    assert 401 not in statuses
    assert 403 not in statuses


def test_explicit_peers_must_be_host_and_port() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        PeerOptions.from_env({"PREHEAT_PEERS": "10.0.0.1:9000,evil.example/steal#"})
