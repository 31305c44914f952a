"""Find the safetensors files of a checkpoint and read their headers (one local file's: ``preheat.checkpoint.header``).

A source is one of: a ``.safetensors`` file; a Hugging Face directory with ``model.safetensors.index.json`` (shards)
or ``model.safetensors``; or any directory of ``*.safetensors`` files (a preheat checkpoint is one, plus its manifest).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from preheat.checkpoint.header import CheckpointFile, read_header
from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.checkpoint.safetensors import PREFIX_BYTES, TensorEntry, header_length, parse_header
from preheat.core.errors import CheckpointError, ConfigError
from preheat.core.jsonsafe import loads_bounded, read_bounded, read_head
from preheat.io.reads import read_at_least
from preheat.sources.base import READ_BYTES_LIMIT, Origin, Source, check_name, is_uri
from preheat.sources.open import open_origin

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """The files of one checkpoint, in load order, with every tensor name unique across them.

    ``manifest`` is the checkpoint's ``preheat.json`` when it has one; ``files`` are then the files the requested TP
    rank loads, and ``presharded`` says they already hold that rank's slices (the loader must not slice again).
    """

    root: str
    files: tuple[CheckpointFile, ...]
    manifest: Manifest | None = None

    @property
    def presharded(self) -> bool:
        return self.manifest is not None and self.manifest.tp_world_size > 1

    @property
    def total_bytes(self) -> int:
        return sum(f.header.data_end - f.header.data_start for f in self.files)

    def entries(self) -> Iterator[tuple[CheckpointFile, TensorEntry]]:
        for file in self.files:
            for entry in file.header.tensors:
                yield file, entry

    def names(self) -> list[str]:
        return [entry.name for _, entry in self.entries()]


def resolve_files(source: str, *, rank: int = 0, world_size: int = 1) -> list[str]:
    """The safetensors files that make up ``source``, in a stable order (for a preheat checkpoint: the manifest's
    files that rank ``rank`` of ``world_size`` loads)."""
    if os.path.isfile(source):
        return [source]
    if not os.path.exists(source):
        raise CheckpointError(f"{source}: no such file or directory", path=source)
    if not os.path.isdir(source):
        raise CheckpointError(f"{source}: not a regular file or directory", path=source)
    manifest = read_manifest(source)
    if manifest is not None:
        return [os.path.join(source, f.name) for f in manifest.files_for_rank(rank, world_size)]
    index = os.path.join(source, INDEX_NAME)
    if os.path.isfile(index):
        return _files_from_index(source, index)
    single = os.path.join(source, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    found = sorted(os.path.join(source, name) for name in os.listdir(source) if name.endswith(".safetensors"))
    if not found:
        raise CheckpointError(
            f"{source}: no weights here (expected {INDEX_NAME}, {SINGLE_NAME} or *.safetensors files)", path=source
        )
    return found


def _files_from_index(root: str, index: str) -> list[str]:
    try:
        weight_map = _weight_map(read_bounded(index, max_bytes=READ_BYTES_LIMIT))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})", path=index) from None
    files: dict[str, None] = {}  # ordered and deduplicated in one pass (an index names a shard once per tensor)
    for shard in weight_map.values():
        if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.split("/"):
            raise CheckpointError(f"{index}: shard name {shard!r} is not a plain relative file name", path=index)
        files[os.path.join(root, shard)] = None
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: shard named in {INDEX_NAME} is missing", path=path)
    return list(files)


def _weight_map(doc: object) -> dict[str, object]:
    """The ``weight_map`` of a parsed index (``KeyError``/``TypeError`` if there is none)."""
    weight_map = doc["weight_map"] if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise TypeError("weight_map is not an object")
    return weight_map


def open_checkpoint(source: str | os.PathLike[str], *, rank: int = 0, world_size: int = 1) -> Checkpoint:
    """Resolve ``source`` (a path or an ``http(s)://``/``s3://`` prefix) and parse every header; raises
    ``CheckpointError`` naming the first problem. A preheat checkpoint's files come from its manifest (for a
    pre-sharded one, only rank ``rank``'s) and are checked against it."""
    root = os.fspath(source)
    if is_uri(root):
        origin = open_origin(root)
        manifest = read_remote_manifest(origin)
        names = (
            [f.name for f in manifest.files_for_rank(rank, world_size)]
            if manifest is not None
            else resolve_remote_names(origin)
        )
        remote = tuple(read_remote_header(origin, name) for name in names)
        _check_unique(remote)
        _check_manifest(manifest, remote, rank, world_size)
        return Checkpoint(root, remote, manifest)
    manifest = read_manifest(root) if os.path.isdir(root) else None
    if manifest is not None:
        paths = [os.path.join(root, f.name) for f in manifest.files_for_rank(rank, world_size)]
        files = tuple(_read_listed_header(path, root) for path in paths)
    else:
        files = tuple(read_header(path) for path in resolve_files(root))
    _check_unique(files)
    _check_manifest(manifest, files, rank, world_size)
    index = os.path.join(root, INDEX_NAME)
    if os.path.isdir(root) and os.path.isfile(index):
        _check_index_names(index, root, {e.name: f.path for f in files for e in f.header.tensors})
    return Checkpoint(root, files, manifest)


def read_manifest(root: str) -> Manifest | None:
    """The validated ``preheat.json`` of directory ``root``, or None when it has none."""
    path = os.path.join(root, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        data = read_head(path, READ_BYTES_LIMIT)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}", path=path) from None
    return Manifest.from_json(data, where=path)


def read_remote_manifest(origin: Origin) -> Manifest | None:
    """The validated ``preheat.json`` at a remote origin, or None when it has none."""
    if not origin.exists(MANIFEST_NAME):
        return None
    return Manifest.from_json(origin.read_bytes(MANIFEST_NAME), where=origin.join(MANIFEST_NAME))


def _read_listed_header(path: str, root: str) -> CheckpointFile:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: listed in {os.path.join(root, MANIFEST_NAME)} but missing", path=path)
    return read_header(path)


def _check_manifest(manifest: Manifest | None, files: tuple[CheckpointFile, ...], rank: int, world_size: int) -> None:
    """Each file's size and header must be what the manifest says (no data is read: digests are `preheat verify`'s).
    ``files`` were resolved from the same manifest, rank and world size, so they line up with its records."""
    if manifest is None:
        return
    for file, record in zip(files, manifest.files_for_rank(rank, world_size), strict=True):
        manifest.check_header(record, file.size, file.header)


def _check_unique(files: tuple[CheckpointFile, ...]) -> None:
    seen: dict[str, str] = {}
    for file in files:
        for entry in file.header.tensors:
            if entry.name in seen:
                raise CheckpointError(
                    f"{file.path}: tensor {entry.name!r} also appears in {seen[entry.name]}",
                    path=file.path,
                    tensor=entry.name,
                )
            seen[entry.name] = file.path


def _check_index_names(index: str, root: str, seen: dict[str, str]) -> None:
    try:  # read again: a checkpoint with a manifest never went through _files_from_index
        weight_map = _weight_map(read_bounded(index, max_bytes=READ_BYTES_LIMIT))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})", path=index) from None
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: shard name {shard!r} is not a string", path=index, tensor=name)
        where = seen.get(name)
        if where is None:
            raise CheckpointError(
                f"{index}: tensor {name!r} is mapped to {shard} but no shard contains it", path=index, tensor=name
            )
        if os.path.normpath(where) != os.path.normpath(os.path.join(root, shard)):
            raise CheckpointError(
                f"{index}: tensor {name!r} is mapped to {shard} but found in {where}", path=index, tensor=name
            )


# Remote origins: the same layouts, discovered by asking for the well-known names instead of listing a directory.
_FIRST_READ = 64 * 1024  # one request usually holds the length prefix and the whole header


def resolve_remote_names(origin: Origin, *, rank: int = 0, world_size: int = 1) -> list[str]:
    """The safetensors files of a checkpoint at a URL prefix: its manifest's (for a pre-sharded checkpoint, rank
    ``rank``'s), its index's shards, or ``model.safetensors``."""
    manifest = read_remote_manifest(origin)
    if manifest is not None:
        return [f.name for f in manifest.files_for_rank(rank, world_size)]
    try:
        if origin.exists(INDEX_NAME):
            names: dict[str, None] = {}  # ordered and deduplicated in one pass
            index = loads_bounded(origin.read_bytes(INDEX_NAME), max_bytes=READ_BYTES_LIMIT)
            for shard in _weight_map(index).values():
                if not isinstance(shard, str):
                    raise TypeError(f"shard name {shard!r} is not a string")
                names[check_name(shard)] = None
            return list(names)
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        where = origin.join(INDEX_NAME)
        raise CheckpointError(f"{where}: not a valid safetensors index ({exc})", path=where) from None
    if origin.exists(SINGLE_NAME):
        return [SINGLE_NAME]
    raise CheckpointError(f"{origin.uri}: no weights here (expected {INDEX_NAME} or {SINGLE_NAME})", path=origin.uri)


def read_remote_header(origin: Origin, name: str) -> CheckpointFile:
    """Fetch and validate the header of remote file ``name`` (one request for typical headers)."""
    where = origin.join(name)
    source = origin.open(name)
    try:
        size = source.size()
        head = _read_range(source, 0, min(size, _FIRST_READ), where)
        length = header_length(head[:PREFIX_BYTES], path=where, file_size=size)
        end = PREFIX_BYTES + length
        raw = (
            head[PREFIX_BYTES:end]
            if end <= len(head)
            else head[PREFIX_BYTES:] + _read_range(source, len(head), end - len(head), where)
        )
        return CheckpointFile(where, size, parse_header(raw, path=where, file_size=size), origin, name)
    finally:
        source.close()


def _read_range(source: Source, offset: int, n: int, where: str) -> bytes:
    buf = bytearray(n)
    read_at_least(source, memoryview(buf), offset, n, path=where)
    return bytes(buf)
