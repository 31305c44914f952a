"""Fixtures of the peer tests: one checkpoint worth striping (tests/peers.py), with its manifest, shared read-only by
the session (a test that changes files copies it first: ``peers.copy_checkpoint``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peers import write_peer_checkpoint
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~6.6 MB float32 checkpoint with a ``preheat.json`` (an identity peers can announce)."""
    return write_peer_checkpoint(tmp_path_factory.mktemp("peer-ckpt"))


@pytest.fixture(scope="session")
def manifest(checkpoint: Path) -> Manifest:
    return Manifest.from_json((checkpoint / MANIFEST_NAME).read_bytes(), where=str(checkpoint))
