"""Pulling preheat:// checkpoints from real peer processes: striping, and every way a peer can fail.

Peers are ``python -m preheat.peer`` children (the same server ``preheat serve --peer`` runs); the origin is a real
``FileServer``. Each test says which source ended up serving which bytes: a pull that survives a fault must still
publish exactly the manifest's bytes.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers import SeedPeer, copy_checkpoint, write_peer_checkpoint
from preheat.checkpoint.digest import file_digest
from preheat.checkpoint.manifest import Manifest
from preheat.core.errors import CacheError, SourceError, SourceNotFoundError
from preheat.peer.pull import PeerOptions, pull_from_peers
from preheat.peer.registry import FileRegistry, PeerEntry
from preheat.store.cache import ModelCache
from preheat.store.pull import PullResult, pull
from preheat.testing.fileserver import FileServer
from tmpfs import mounted_tmpfs

PIECE = 256 * 1024


@pytest.fixture(scope="module")
def plain_peer(checkpoint: Path) -> Iterator[SeedPeer]:
    """One peer without token or cap, shared by the tests that only send it requests."""
    with SeedPeer(checkpoint) as peer:
        yield peer


@pytest.fixture
def origin(checkpoint: Path) -> Iterator[FileServer]:
    with FileServer(checkpoint) as server:
        yield server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_published_intact(result: PullResult, manifest: Manifest) -> None:
    assert result.key == manifest.identity
    for f in (*manifest.files, *manifest.extra_files):
        assert file_digest(os.path.join(result.path, f.name)) == f.digest, f.name
    assert sum(result.sources.values()) + result.bytes_resumed == result.bytes_total
    assert not os.path.exists(os.path.join(result.path, ".peer-journal"))


def on_progress(fraction: float, action: object) -> object:
    """A progress callback that runs ``action()`` once, when ``fraction`` of the bytes have landed."""
    fired = threading.Event()

    def progress(done: int, total: int) -> None:
        if done >= fraction * total and not fired.is_set():
            fired.set()
            action()  # type: ignore[operator]

    return progress


def test_two_peers_share_the_pull_and_the_origin_sends_nothing(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache, plain_peer: SeedPeer
) -> None:
    with SeedPeer(checkpoint) as b:
        a = plain_peer
        options = PeerOptions(peers=(a.address, b.address), origin=origin.url, chunk_bytes=PIECE)
        result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert_published_intact(result, manifest)
    assert set(result.sources) == {f"peer {a.address}", f"peer {b.address}"}
    assert origin.stats.snapshot().bytes_sent < 1024  # the origin was never asked for weights


def test_a_published_entry_is_a_hit_and_moves_nothing(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache
) -> None:
    options = PeerOptions(origin=origin.url, chunk_bytes=PIECE)
    first = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    again = pull_from_peers(f"preheat://{manifest.identity}", cache, PeerOptions())  # no peer, no origin needed
    assert not first.hit
    assert again.hit
    assert again.path == first.path
    assert first.sources == {"origin": manifest.total_bytes + sum(f.size for f in manifest.extra_files)}


def test_a_peer_killed_mid_pull_has_its_pieces_moved(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache
) -> None:
    with SeedPeer(checkpoint, "--max-mbps", "2") as a, SeedPeer(checkpoint, "--max-mbps", "2") as b:
        options = PeerOptions(peers=(a.address, b.address), origin=origin.url, chunk_bytes=PIECE)
        result = pull_from_peers(
            f"preheat://{manifest.identity}",
            cache,
            options,
            progress=on_progress(0.2, a.kill),  # type: ignore[arg-type]
        )
    assert_published_intact(result, manifest)
    assert result.sources.get(f"peer {a.address}", 0) < result.bytes_total / 2
    assert result.sources[f"peer {b.address}"] > result.bytes_total / 2
    assert any(f"dropped peer {a.address}" in note for note in result.notes)


def test_a_frozen_peer_is_dropped_as_stalled_and_the_pull_completes(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache
) -> None:
    with SeedPeer(checkpoint, "--max-mbps", "2") as a, SeedPeer(checkpoint, "--max-mbps", "2") as b:
        options = PeerOptions(peers=(a.address, b.address), origin=origin.url, chunk_bytes=PIECE, stall_timeout=1.0)
        # SIGSTOP: the frozen peer's sockets stay open and the kernel still accepts connections, but no byte flows.
        result = pull_from_peers(
            f"preheat://{manifest.identity}",
            cache,
            options,
            progress=on_progress(0.2, a.freeze),  # type: ignore[arg-type]
        )
    assert_published_intact(result, manifest)
    assert result.sources[f"peer {b.address}"] > result.bytes_total / 2
    assert any(f"dropped peer {a.address}" in note and "timed out" in note.lower() for note in result.notes)


def test_a_peer_serving_wrong_bytes_is_dropped_and_its_pieces_fetched_elsewhere(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache, tmp_path: Path
) -> None:
    bad_root = copy_checkpoint(checkpoint, tmp_path / "bad")
    victim = max(manifest.tensors, key=lambda r: r.nbytes)
    with open(bad_root / victim.file, "r+b") as handle:  # a disk error on the peer's node, after it was verified
        handle.seek(victim.offset + victim.nbytes // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with SeedPeer(bad_root) as liar:
        options = PeerOptions(peers=(liar.address,), origin=origin.url, chunk_bytes=PIECE)
        result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert_published_intact(result, manifest)
    assert result.sources["origin"] > 0
    assert any(f"dropped peer {liar.address}" in n and victim.name in n for n in result.notes)


def test_a_registry_entry_whose_peer_is_gone_falls_back_to_the_origin(
    manifest: Manifest, origin: FileServer, cache: ModelCache, tmp_path: Path
) -> None:
    registry = FileRegistry(str(tmp_path / "registry"))
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there any more
    registry.announce(PeerEntry(identity=manifest.identity, address=gone, name="tiny", origin=origin.url), ttl=60)
    options = PeerOptions(registry=registry.url, origin=origin.url, chunk_bytes=PIECE)  # only ever the operator's
    result = pull_from_peers("preheat://tiny", cache, options)
    assert_published_intact(result, manifest)
    assert set(result.sources) == {"origin"}
    assert any(gone in note for note in result.notes)


def test_redis_registry_down_falls_back_to_the_origin_with_a_warning(
    manifest: Manifest, origin: FileServer, cache: ModelCache, caplog: pytest.LogCaptureFixture
) -> None:
    options = PeerOptions(registry=f"redis://127.0.0.1:{free_port()}/0", origin=origin.url, chunk_bytes=PIECE)
    with caplog.at_level(logging.WARNING, logger="preheat.peer"):
        result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert_published_intact(result, manifest)
    assert set(result.sources) == {"origin"}
    assert any("registry" in r.getMessage() for r in caplog.records)


def test_a_wrong_token_is_refused_and_the_origin_serves(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache
) -> None:
    with SeedPeer(checkpoint, token="right") as peer:
        host, port = peer.address.rsplit(":", 1)
        statuses = {}
        for given in (None, "wrong", "right"):
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            headers = {"Authorization": f"Bearer {given}"} if given else {}
            conn.request("HEAD", f"/peer/v1/files/{manifest.files[0].name}", headers=headers)
            statuses[given] = conn.getresponse().status
            conn.close()
        options = PeerOptions(peers=(peer.address,), origin=origin.url, token="wrong", chunk_bytes=PIECE)
        result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert statuses == {None: 401, "wrong": 403, "right": 200}
    assert_published_intact(result, manifest)
    assert set(result.sources) == {"origin"}


@pytest.mark.parametrize(
    "target",
    [
        "/peer/v1/files/../../../../etc/passwd",
        "/peer/v1/files/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/peer/v1/files//etc/passwd",
        "/peer/v1/files/config.json/../../secret",
        "/peer/v1/files/.preheat-cache.json",
    ],
)
def test_a_path_outside_the_checkpoint_is_refused(plain_peer: SeedPeer, target: str) -> None:
    host, port = plain_peer.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("GET", target)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 403
    assert b"root:" not in body


def test_a_peer_answers_ranges_of_checkpoint_files(plain_peer: SeedPeer, checkpoint: Path, manifest: Manifest) -> None:
    name = manifest.files[0].name
    host, port = plain_peer.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("GET", f"/peer/v1/files/{name}", headers={"Range": "bytes=8-15"})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 206
    assert body == (checkpoint / name).read_bytes()[8:16]


def test_a_peer_holding_another_checkpoint_is_skipped(
    manifest: Manifest, origin: FileServer, cache: ModelCache, tmp_path: Path
) -> None:
    other = write_peer_checkpoint(tmp_path / "other", seed=1)
    with SeedPeer(other) as stranger:
        options = PeerOptions(peers=(stranger.address,), origin=origin.url, chunk_bytes=PIECE)
        result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert_published_intact(result, manifest)
    assert set(result.sources) == {"origin"}


def test_no_peer_and_no_origin_is_a_clear_error(cache: ModelCache) -> None:
    with pytest.raises(SourceNotFoundError, match="--origin"):
        pull_from_peers("preheat://nobody-serves-this", cache, PeerOptions())


def test_preheat_pull_cli_reports_its_sources(
    manifest: Manifest, origin: FileServer, plain_peer: SeedPeer, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "preheat", "pull", f"preheat://{manifest.identity}", "--origin", origin.url]
    command += ["--cache-dir", str(tmp_path / "cache"), "--json"]
    env = {**os.environ, "PREHEAT_PEERS": plain_peer.address}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["key"] == manifest.identity
    assert result["sources"] == {f"peer {plain_peer.address}": result["bytes_total"]}


def test_wrong_bytes_outside_any_tensor_are_caught_by_the_file_digest(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache, tmp_path: Path
) -> None:
    bad_root = copy_checkpoint(checkpoint, tmp_path / "bad-header")
    name = manifest.files[0].name
    data = bytearray((bad_root / name).read_bytes())
    data[20] = ord(" ") if data[20] != ord(" ") else ord("\t")  # inside the safetensors header's JSON
    (bad_root / name).write_bytes(bytes(data))
    with SeedPeer(bad_root) as liar:
        options = PeerOptions(peers=(liar.address,), origin=origin.url, chunk_bytes=PIECE)
        result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert_published_intact(result, manifest)
    assert 0 < result.sources["origin"] < result.bytes_total  # only the header's piece came from the origin


def test_a_pull_left_without_sources_fails_and_the_next_one_resumes(
    checkpoint: Path, manifest: Manifest, origin: FileServer, cache: ModelCache
) -> None:
    with SeedPeer(checkpoint, "--max-mbps", "4") as only:
        options = PeerOptions(peers=(only.address,), chunk_bytes=PIECE)  # no origin to fall back to
        with pytest.raises(SourceError, match="no source left"):
            pull_from_peers(
                f"preheat://{manifest.identity}",
                cache,
                options,
                progress=on_progress(0.3, only.kill),  # type: ignore[arg-type]
            )
    result = pull_from_peers(f"preheat://{manifest.identity}", cache, PeerOptions(origin=origin.url, chunk_bytes=PIECE))
    assert_published_intact(result, manifest)
    assert result.bytes_resumed >= 0.3 * result.bytes_total
    assert result.sources["origin"] == result.bytes_total - result.bytes_resumed


def test_a_peer_pull_resumes_what_an_interrupted_plain_pull_left(
    manifest: Manifest, origin: FileServer, cache: ModelCache, plain_peer: SeedPeer
) -> None:
    stop = RuntimeError("interrupted")

    def interrupt(done: int, total: int) -> None:
        if done >= total / 2:
            raise stop

    with pytest.raises(RuntimeError, match="interrupted"):
        pull(origin.url, cache, threads=1, chunk_bytes=PIECE, progress=interrupt)
    options = PeerOptions(peers=(plain_peer.address,), origin=origin.url, chunk_bytes=PIECE)
    result = pull_from_peers(f"preheat://{manifest.identity}", cache, options)
    assert_published_intact(result, manifest)
    assert result.bytes_resumed >= result.bytes_total * 0.45  # one journal: the plain pull's ranges count here too
    assert set(result.sources) == {f"peer {plain_peer.address}"}


def test_a_full_disk_is_the_cache_error_every_pull_gives(
    manifest: Manifest, origin: FileServer, plain_peer: SeedPeer, tmp_path: Path
) -> None:
    small = tmp_path / "small"
    with mounted_tmpfs(small, "size=256k"):
        cache = ModelCache(small / "cache")
        options = PeerOptions(peers=(plain_peer.address,), origin=origin.url, chunk_bytes=PIECE)
        with pytest.raises(CacheError, match=r"disk full.*preheat cache gc"):
            pull_from_peers(f"preheat://{manifest.identity}", cache, options)
        assert not any((small / "cache" / "partial").iterdir())
