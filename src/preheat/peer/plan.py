"""The pure part of peer transfer: the plan of pieces a striped pull fetches (``preheat.store.pieces`` holds the
plan's types; ``preheat.store.fetch`` fetches it; ``preheat.sources.peer_uri`` parses the ``preheat://`` names).

A checkpoint's files are cut into pieces of about ``chunk_bytes``, preferably at tensor boundaries, so that most
tensors lie inside one piece and can be verified against their manifest digest as soon as that piece lands; a tensor
larger than a piece spans several and is verified when the last of them lands. Bytes outside every tensor (the
safetensors header, small extra files) are covered by the whole-file digest checked before publishing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from preheat.checkpoint import manifest as mf
from preheat.core.errors import ConfigError
from preheat.store.pieces import Piece, PiecePlan, manifest_files


def plan_pieces(manifest: mf.Manifest, chunk_bytes: int) -> PiecePlan:
    """Cut every file of ``manifest`` (weights and extra files) into pieces of at most ``chunk_bytes``, cutting at a
    tensor's start whenever the tensor would not fit in the current piece, so small tensors never straddle two."""
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    files = (*manifest.files, *manifest.extra_files)
    by_file: dict[str, list[mf.TensorRecord]] = {}
    for record in manifest.tensors:
        by_file.setdefault(record.file, []).append(record)
    pieces: list[Piece] = []
    for f in files:
        for start, end in _spans(f.size, by_file.get(f.name, []), chunk_bytes):
            pieces.append(Piece(len(pieces), f.name, start, end - start))
    tensor_pieces: dict[str, tuple[int, ...]] = {}
    piece_tensors: dict[int, list[mf.TensorRecord]] = {}
    starts = _index_by_file(pieces)
    for record in manifest.tensors:
        covering = tuple(_overlapping(starts.get(record.file, []), record.offset, record.nbytes))
        tensor_pieces[record.name] = covering
        for index in covering:
            piece_tensors.setdefault(index, []).append(record)
    return PiecePlan(
        tuple(pieces), tuple(manifest_files(manifest)), tensor_pieces, {k: tuple(v) for k, v in piece_tensors.items()}
    )


def _spans(size: int, tensors: Iterable[mf.TensorRecord], chunk: int) -> list[tuple[int, int]]:
    cuts = {0, size}
    start = 0  # where the current piece begins
    for record in sorted(tensors, key=lambda r: r.offset):
        end = record.offset + record.nbytes
        if end - start <= chunk:
            continue
        if record.offset > start:
            start = record.offset
            cuts.add(start)
        while end - start > chunk:
            start += chunk
            cuts.add(start)
    while size - start > chunk:  # trailing bytes after the last tensor (or a file without tensors)
        start += chunk
        cuts.add(start)
    ordered = sorted(c for c in cuts if 0 <= c <= size)
    return [(a, b) for a, b in itertools.pairwise(ordered) if b > a]


def _index_by_file(pieces: list[Piece]) -> dict[str, list[Piece]]:
    out: dict[str, list[Piece]] = {}
    for piece in pieces:
        out.setdefault(piece.file, []).append(piece)
    return out


def _overlapping(pieces: list[Piece], offset: int, nbytes: int) -> Iterable[int]:
    end = offset + max(nbytes, 1)  # a zero-byte tensor still belongs to the piece its offset falls in
    for piece in pieces:
        if piece.offset < end and offset < piece.offset + piece.length:
            yield piece.index
