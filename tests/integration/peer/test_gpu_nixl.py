"""The NIXL GPU transport between real peers. Skipped without a CUDA device and nixl; scripts/device_check.sh runs it
on a lent GPU machine (nixl from a wheel carried in .whl/)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import preheat
from peers import SeedPeer, copy_checkpoint
from preheat.checkpoint.digest import file_digest
from preheat.checkpoint.manifest import Manifest
from preheat.peer.nixl import Advert, NixlExport
from preheat.peer.pull import PeerOptions, pull_from_peers
from preheat.peer.server import PeerServer
from preheat.store.cache import ModelCache
from preheat.store.pull import PullResult

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="needs nixl"),
]
TOKEN = "gpu-peers"
SPLIT = re.compile(r"(\d+) bytes over NIXL, (\d+) over TCP")


def assert_intact(result: PullResult, manifest: Manifest) -> None:
    for f in (*manifest.files, *manifest.extra_files):
        assert file_digest(str(Path(result.path) / f.name)) == f.digest, f.name


def nixl_split(result: PullResult) -> tuple[int, int]:
    """Bytes over NIXL and over TCP, summed over the pull's per-peer NIXL notes."""
    found = [SPLIT.search(note) for note in result.notes]
    pairs = [(int(m.group(1)), int(m.group(2))) for m in found if m is not None]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def test_two_gpu_peers_send_every_tensor_over_nixl(checkpoint: Path, manifest: Manifest, tmp_path: Path) -> None:
    second = copy_checkpoint(checkpoint, tmp_path / "second")
    with (
        SeedPeer(checkpoint, "--device", "cuda", token=TOKEN) as a,
        SeedPeer(second, "--device", "cuda", token=TOKEN) as b,
    ):
        options = PeerOptions(peers=(a.address, b.address), token=TOKEN, device="cuda", chunk_bytes=256 * 1024)
        result = pull_from_peers(f"preheat://{manifest.identity}", ModelCache(tmp_path / "cache"), options)
    assert_intact(result, manifest)
    assert set(result.sources) <= {f"peer {a.address} (nixl)", f"peer {b.address} (nixl)"}
    assert sum(result.sources.values()) == result.bytes_total
    over_nixl, over_tcp = nixl_split(result)
    assert not any("NIXL failed" in note for note in result.notes), result.notes
    assert over_nixl == sum(r.nbytes for r in manifest.tensors)  # every tensor byte device-to-device
    assert over_nixl + over_tcp == result.bytes_total  # only headers and extra files over TCP
    loaded = preheat.load(result.path, "cuda")
    original = preheat.load(checkpoint, "cpu")
    for name, tensor in original.items():
        assert torch.equal(loaded[name].cpu(), tensor), name


class _MisdirectedExport:
    """A real export whose advert points every tensor at memory the peer never registered: each READ must fail."""

    def __init__(self, export: NixlExport) -> None:
        self.export = export
        real = Advert.from_json(export.advert(), where="test")
        moved = tuple(dataclasses.replace(t, addr=t.addr + (1 << 40)) for t in real.tensors)
        self._advert = dataclasses.replace(real, tensors=moved).to_json()

    def advert(self) -> bytes:
        return self._advert

    def close(self) -> None:
        self.export.close()


@pytest.fixture
def misdirected_peer(checkpoint: Path, manifest: Manifest) -> Iterator[PeerServer]:
    export = NixlExport(preheat.load(checkpoint, "cuda"), manifest)
    with PeerServer(checkpoint, manifest, token=TOKEN, nixl=_MisdirectedExport(export)) as server:  # type: ignore[arg-type]
        yield server


def test_a_failing_nixl_read_falls_back_to_tcp_and_the_pull_completes(
    misdirected_peer: PeerServer, manifest: Manifest, tmp_path: Path
) -> None:
    options = PeerOptions(peers=(misdirected_peer.address,), token=TOKEN, device="cuda", chunk_bytes=256 * 1024)
    result = pull_from_peers(f"preheat://{manifest.identity}", ModelCache(tmp_path / "cache"), options)
    assert_intact(result, manifest)
    assert any("NIXL failed, rest over TCP" in note for note in result.notes), result.notes
    over_nixl, over_tcp = nixl_split(result)
    assert over_nixl == 0
    assert over_tcp == result.bytes_total
