"""Find the safetensors files of a checkpoint and read their headers.

A source is one of: a ``.safetensors`` file; a Hugging Face directory with ``model.safetensors.index.json`` (shards)
or ``model.safetensors``; or any directory of ``*.safetensors`` files (a preheat checkpoint is one, plus its manifest).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from preheat.checkpoint.safetensors import PREFIX_BYTES, SafetensorsHeader, TensorEntry, header_length, parse_header
from preheat.errors import CheckpointError
from preheat.io.files import read_exact

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class CheckpointFile:
    """One weights file: where it is, how big it was when planned, and its parsed header."""

    path: str
    size: int
    header: SafetensorsHeader


@dataclass(frozen=True)
class Checkpoint:
    """The files of one checkpoint, in load order, with every tensor name unique across them."""

    root: str
    files: tuple[CheckpointFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.header.data_end - f.header.data_start for f in self.files)

    def entries(self) -> Iterator[tuple[CheckpointFile, TensorEntry]]:
        for file in self.files:
            for entry in file.header.tensors:
                yield file, entry

    def names(self) -> list[str]:
        return [entry.name for _, entry in self.entries()]


def read_header(path: str) -> CheckpointFile:
    """Open ``path``, read and validate its safetensors header."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found", path=path) from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a safetensors file", path=path) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open: {exc.strerror}", path=path) from None
    try:
        if hasattr(os, "posix_fadvise"):
            # Readahead after a header read would pull megabytes that a TP rank may never need.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            # Linux opens a directory read-only without complaint; only the first read fails (EISDIR).
            raise CheckpointError(f"{path}: is not a regular file, so it cannot be a safetensors file", path=path)
        size = info.st_size
        prefix = read_exact(fd, 0, min(PREFIX_BYTES, size), path=path)
        length = header_length(prefix, path=path, file_size=size)
        raw = read_exact(fd, PREFIX_BYTES, length, path=path)
        return CheckpointFile(path, size, parse_header(raw, path=path, file_size=size))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the header: {exc.strerror}", path=path) from None
    finally:
        os.close(fd)


def resolve_files(source: str) -> list[str]:
    """The safetensors files that make up ``source``, in a stable order."""
    if os.path.isfile(source):
        return [source]
    if not os.path.exists(source):
        raise CheckpointError(f"{source}: no such file or directory", path=source)
    if not os.path.isdir(source):
        raise CheckpointError(f"{source}: not a regular file or directory", path=source)
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
        with open(index, encoding="utf-8") as handle:
            doc = json.load(handle)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc})", path=index) from None
    files: list[str] = []
    for shard in weight_map.values():
        if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.split("/"):
            raise CheckpointError(f"{index}: shard name {shard!r} is not a plain relative file name", path=index)
        path = os.path.join(root, shard)
        if path not in files:
            files.append(path)
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: shard named in {INDEX_NAME} is missing", path=path)
    return files


def open_checkpoint(source: str | os.PathLike[str]) -> Checkpoint:
    """Resolve ``source`` and parse every header; raises ``CheckpointError`` naming the first problem."""
    root = os.fspath(source)
    files = tuple(read_header(path) for path in resolve_files(root))
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
    index = os.path.join(root, INDEX_NAME)
    if os.path.isdir(root) and os.path.isfile(index):
        _check_index_names(index, root, seen)
    return Checkpoint(root, files)


def _check_index_names(index: str, root: str, seen: dict[str, str]) -> None:
    with open(index, encoding="utf-8") as handle:
        weight_map: dict[str, str] = json.load(handle)["weight_map"]
    for name, shard in weight_map.items():
        where = seen.get(name)
        if where is None:
            raise CheckpointError(
                f"{index}: tensor {name!r} is mapped to {shard} but no shard contains it", path=index, tensor=name
            )
        if os.path.normpath(where) != os.path.normpath(os.path.join(root, shard)):
            raise CheckpointError(
                f"{index}: tensor {name!r} is mapped to {shard} but found in {where}", path=index, tensor=name
            )
