"""What a pull fetches, as values: the files (``RemoteFile``) and the plan of pieces cut from them (pure, no I/O).

Every downloader (a plain pull from an origin, a striped pull from peers, a load's write-through) hands the one
fetcher in ``preheat.store.fetch`` a ``PiecePlan``; how the files are cut is the caller's choice: ``plan_chunks``
cuts fixed ``chunk_bytes`` ranges (a plain pull, which checks whole files at the end),
``preheat.peer.plan.plan_pieces`` cuts at tensor boundaries so each tensor is checked as soon as its pieces land.

>>> [(p.offset, p.length) for p in plan_chunks([RemoteFile("a", 10, None)], 4).pieces]
[(0, 4), (4, 4), (8, 2)]
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from preheat.checkpoint import manifest as mf
from preheat.core.errors import ConfigError
from preheat.sources.base import Validator
from preheat.store import journal


@dataclass(frozen=True)
class RemoteFile:
    """A file to fetch: its relative name, size, expected digest (None when the origin has no manifest) and, without a
    manifest, the version of it the origin named when the pull planned it."""

    name: str
    size: int
    digest: str | None
    validator: Validator | None = None

    def pin(self) -> journal.Pin | None:
        """What the journal pins this file's pieces to; None when nothing can tell its versions apart."""
        if self.digest is not None:
            return {"digest": self.digest, "size": self.size}
        if self.validator is None or self.validator.weak:
            return None
        return self.validator.to_json()


def manifest_files(manifest: mf.Manifest) -> list[RemoteFile]:
    """Every file a manifest names (weights, then extra files), each with its digest."""
    return [RemoteFile(f.name, f.size, f.digest) for f in (*manifest.files, *manifest.extra_files)]


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of checkpoint file ``file``; ``index`` is its position in the plan."""

    index: int
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class PiecePlan:
    """Every piece of the files to fetch, and which tensors each piece overlaps (and the reverse; both empty when the
    plan checks whole files only)."""

    pieces: tuple[Piece, ...]
    files: tuple[RemoteFile, ...]
    tensor_pieces: dict[str, tuple[int, ...]] = field(default_factory=dict)
    piece_tensors: dict[int, tuple[mf.TensorRecord, ...]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(p.length for p in self.pieces)


def plan_chunks(
    files: Sequence[RemoteFile], chunk_bytes: int, cuts: Mapping[str, Sequence[int]] | None = None
) -> PiecePlan:
    """Cut every file into ``chunk_bytes`` pieces, also cutting at the offsets ``cuts`` names for it (so a source
    holding only part of a file, like a load's buffers, holds whole pieces), with no tensor checks."""
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    pieces: list[Piece] = []
    for f in files:
        bounds = sorted({0, f.size, *(c for c in (cuts or {}).get(f.name, ()) if 0 < c < f.size)})
        for start, end in itertools.pairwise(bounds):
            for offset in range(start, end, chunk_bytes):
                pieces.append(Piece(len(pieces), f.name, offset, min(chunk_bytes, end - offset)))
    return PiecePlan(tuple(pieces), tuple(files))
