"""The pure part of peer transfer: preheat:// names and piece plans (no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peers import write_peer_checkpoint
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.core.errors import ConfigError
from preheat.peer.plan import plan_pieces
from preheat.sources.peer_uri import parse_peer_uri


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    root = write_peer_checkpoint(tmp_path_factory.mktemp("plan"))
    return Manifest.from_json((root / MANIFEST_NAME).read_bytes(), where=str(root))


def test_identity_names_are_told_from_served_names() -> None:
    assert parse_peer_uri("preheat://xxh3-128:" + "0" * 32).is_identity
    assert not parse_peer_uri("preheat://llama-3-8b").is_identity


@pytest.mark.parametrize("uri", ["preheat://", "preheat://a/b", "preheat://../x", "http://x", "preheat://a b"])
def test_malformed_names_are_refused(uri: str) -> None:
    with pytest.raises(ConfigError):
        parse_peer_uri(uri)


@pytest.mark.parametrize("chunk", [4096, 100_000, 1 << 20, 1 << 30])
def test_pieces_cover_every_byte_once(manifest: Manifest, chunk: int) -> None:
    plan = plan_pieces(manifest, chunk)
    for f in (*manifest.files, *manifest.extra_files):
        spans = sorted((p.offset, p.length) for p in plan.pieces if p.file == f.name)
        position = 0
        for offset, length in spans:
            assert offset == position
            assert 0 < length <= chunk
            position += length
        assert position == f.size


def test_tensors_smaller_than_a_piece_never_straddle_two(manifest: Manifest) -> None:
    chunk = 1 << 20
    plan = plan_pieces(manifest, chunk)
    for record in manifest.tensors:
        if record.nbytes <= chunk:
            assert len(plan.tensor_pieces[record.name]) == 1, record.name


def test_a_large_tensor_spans_several_pieces_and_is_checked_after_the_last(manifest: Manifest) -> None:
    plan = plan_pieces(manifest, 100_000)
    big = max(manifest.tensors, key=lambda r: r.nbytes)
    covering = plan.tensor_pieces[big.name]
    assert len(covering) > 1
    assert all(big in plan.piece_tensors[i] for i in covering)


def test_a_path_like_name_is_no_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        parse_peer_uri("preheat://" + str(tmp_path))
