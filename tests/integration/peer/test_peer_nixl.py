"""Choosing the peer transport: NIXL only when nixl imports, this replica loads onto CUDA and the peer offers it.

These run on CPU (and without nixl, the usual case): the peer server must not offer NIXL, its ``/peer/v1/nixl`` route
answers 404 (behind the token like every route), and a puller that would load onto CUDA still pulls over TCP.
The NIXL transfers themselves are in tests/integration/peer/test_gpu_nixl.py (a GPU and nixl needed).
"""

from __future__ import annotations

import http.client
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hostile import DEEP_JSON, ScriptedServer, always
from preheat.checkpoint.digest import file_digest
from preheat.checkpoint.manifest import Manifest
from preheat.core.errors import NixlError
from preheat.peer.nixl import (
    NIXL_ROUTE,
    Advert,
    RemoteTensor,
    choose_transport,
    cut_spans,
    export_weights,
    fetch_advert,
    nixl_api,
)
from preheat.peer.pull import PeerOptions, pull_from_peers
from preheat.peer.server import PeerServer
from preheat.store.cache import ModelCache

NO_NIXL = importlib.util.find_spec("nixl") is None
TOKEN = "s3cret"


@pytest.fixture
def cpu_peer(checkpoint: Path, manifest: Manifest) -> Iterator[PeerServer]:
    """A real peer server holding the checkpoint on CPU (files only), behind a token."""
    with PeerServer(checkpoint, manifest, token=TOKEN) as server:
        yield server


def get(address: str, path: str, token: str | None) -> tuple[int, bytes]:
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("importable", "device", "advertised", "expected"),
    [
        (True, "cuda", True, "nixl"),
        (True, "cuda:1", True, "nixl"),
        (False, "cuda", True, "tcp"),  # nixl not installed here
        (True, "cpu", True, "tcp"),  # this replica loads onto CPU: nothing to receive on a GPU
        (True, "cuda", False, "tcp"),  # the peer holds weights on CPU, or has no nixl
    ],
)
def test_nixl_is_chosen_only_when_both_ends_can(importable: bool, device: str, advertised: bool, expected: str) -> None:
    assert choose_transport(nixl_importable=importable, device=device, advertised=advertised) == expected


@pytest.mark.skipif(not NO_NIXL, reason="nixl is installed here")
def test_without_nixl_nothing_is_exported(manifest: Manifest) -> None:
    assert nixl_api() is None
    weights = {r.name: torch.zeros(r.shape) for r in manifest.tensors[:2]}
    assert export_weights(weights, manifest) is None


def test_a_cpu_peer_does_not_advertise_nixl(cpu_peer: PeerServer) -> None:
    status, body = get(cpu_peer.address, NIXL_ROUTE, TOKEN)
    assert status == 404
    assert b"no GPU transport" in body
    assert fetch_advert(cpu_peer.address, TOKEN) is None
    status, body = get(cpu_peer.address, "/peer/v1/info", TOKEN)
    assert status == 200
    assert b'"nixl": false' in body


def test_the_nixl_route_needs_the_token(cpu_peer: PeerServer) -> None:
    assert get(cpu_peer.address, NIXL_ROUTE, None)[0] == 401
    assert get(cpu_peer.address, NIXL_ROUTE, "wrong")[0] == 403
    assert fetch_advert(cpu_peer.address, "wrong") is None  # refused: the puller goes on over TCP


def test_a_cuda_puller_without_nixl_pulls_over_tcp(cpu_peer: PeerServer, manifest: Manifest, tmp_path: Path) -> None:
    """device=cuda only makes a puller ask; with nixl absent (or a CPU peer) every byte comes over TCP, verified."""
    options = PeerOptions(peers=(cpu_peer.address,), token=TOKEN, device="cuda", chunk_bytes=256 * 1024)
    result = pull_from_peers(f"preheat://{manifest.identity}", ModelCache(tmp_path / "cache"), options)
    assert result.sources == {f"peer {cpu_peer.address}": result.bytes_total}
    assert not any("NIXL" in note for note in result.notes)
    for f in manifest.files:
        assert file_digest(str(Path(result.path) / f.name)) == f.digest


def test_a_deeply_nested_advert_leaves_the_pull_on_tcp() -> None:
    """64 KiB of "[" as an advert raised RecursionError, past fetch_advert's NixlError fallback, and failed the pull
    (issue 27); it is a malformed advert now: no advert, so the pull goes over TCP."""
    with ScriptedServer(always(DEEP_JSON)) as peer:
        assert fetch_advert(peer.url.removeprefix("http://"), TOKEN) is None
        assert peer.requests == [("GET", NIXL_ROUTE)]
    with pytest.raises(NixlError, match="malformed NIXL advert: nested deeper"):
        Advert.from_json(DEEP_JSON, where="test")


def test_a_piece_is_cut_at_tensor_boundaries() -> None:
    """Bytes inside advertised tensors may go over NIXL; headers and gaps between tensors must go over HTTP."""
    a = RemoteTensor("model.safetensors", 100, 50, 0x1000, 0)
    b = RemoteTensor("model.safetensors", 150, 30, 0x2000, 0)
    c = RemoteTensor("model.safetensors", 300, 10, 0x3000, 0)
    spans = cut_spans([c, a, b], 0, 305)
    assert spans == [(0, 100, None), (100, 50, a), (150, 30, b), (180, 120, None), (300, 5, c)]
    assert sum(n for _, n, _ in spans) == 305
    assert cut_spans([a], 120, 10) == [(120, 10, a)]  # inside one tensor: one NIXL read at the right offset
    assert cut_spans([], 0, 8) == [(0, 8, None)]


def test_an_advert_round_trips_and_a_malformed_one_is_refused() -> None:
    advert = Advert("peer-1", b"\x00metadata\xff", (RemoteTensor("m.safetensors", 8, 16, 0x7F00, 1),))
    assert Advert.from_json(advert.to_json(), where="test") == advert
    with pytest.raises(NixlError, match="malformed NIXL advert"):
        Advert.from_json(b'{"agent": "x", "metadata": "not base64!", "tensors": []}', where="test")
    with pytest.raises(NixlError, match="malformed NIXL advert"):
        Advert.from_json(b'{"agent": "x"}', where="test")


def test_a_served_cpu_replica_offers_no_gpu_tensors(kv_model: Path) -> None:
    # preheat serve --peer offers NIXL only for weights bound zero-copy on a GPU; on CPU the files go over TCP.
    from preheat.engine import Engine

    assert Engine.from_checkpoint(str(kv_model)).loaded_weights is None
