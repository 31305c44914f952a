"""The ``preheat.json`` manifest: what a preheat checkpoint holds, byte for byte, and its identity.

Pure code over values, plus the few helpers that hash files (``digest_bytes``, ``file_digest``, ``hash_file``) and
``build_manifest``, which hashes an existing directory. The format is specified in docs/checkpoint-format.md; in short:

- every weights file with its size and whole-file digest, every extra file (config, tokenizer) likewise;
- every tensor with its file, absolute byte offset, byte count, dtype, shape and digest of its bytes;
- for a tensor-parallel checkpoint, each tensor's split (dim, rank, world size); for a quantized one, its scale tensor;
- ``identity``: the digest of the manifest's canonical JSON, the checkpoint's name in caches, peer registries and KV
  fingerprints. Same bytes and same metadata give the same identity on every machine; any change gives another.

>>> manifest = Manifest.from_json(open("ckpt/preheat.json", "rb").read(), where="ckpt/preheat.json")  # doctest: +SKIP
>>> manifest.identity                                                                            # doctest: +SKIP
'xxh3-128:5f0c...'
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from preheat.checkpoint import dtypes
from preheat.checkpoint.digest import DIGEST_PREFIX, digest_bytes, file_digest, hash_file
from preheat.checkpoint.header import read_header
from preheat.checkpoint.jsonfile import read_config
from preheat.checkpoint.safetensors import MAX_DIMS, MAX_INT, SafetensorsHeader, brief
from preheat.checkpoint.tp import split_dim
from preheat.core.errors import CheckpointError, ConfigError, JSONInputError
from preheat.core.jsonsafe import MAX_DEPTH, loads_bounded
from preheat.sources.base import READ_BYTES_LIMIT, check_name

# The digest helpers are part of this module's API (callers hash with ``manifest.digest_bytes``), hence re-exported.
__all__ = [
    "DIGEST_PREFIX",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "QUANT_METHODS",
    "FileRecord",
    "Manifest",
    "QuantInfo",
    "TPInfo",
    "TensorRecord",
    "build_manifest",
    "canonical_json",
    "digest_bytes",
    "file_digest",
    "hash_file",
    "rank_dir",
    "read_config",
]

MANIFEST_NAME = "preheat.json"
FORMAT_VERSION = 1
QUANT_METHODS = {"int8": "I8", "fp8": "F8_E4M3"}  # method -> the dtype its quantized weights are stored in
RANK_DIR = re.compile(r"^rank-(\d{5})-of-(\d{5})/")
_DIGEST = re.compile(r"^xxh3-128:[0-9a-f]{32}$")


def rank_dir(rank: int, world_size: int) -> str:
    """The directory holding rank ``rank``'s files in a checkpoint pre-sharded for ``world_size`` ranks."""
    return f"rank-{rank:05d}-of-{world_size:05d}"


@dataclass(frozen=True)
class TPInfo:
    """How a tensor of a pre-sharded checkpoint was split: along ``dim`` (None: replicated) for rank of world size."""

    dim: int | None
    rank: int
    world_size: int


@dataclass(frozen=True)
class QuantInfo:
    """A weight-only quantized tensor: ``method`` (``int8``/``fp8``), its ``scale`` tensor's name, the dtype
    (safetensors name, e.g. ``BF16``) it is restored to by ``dequantize``, and ``group``: how many input columns share
    a scale (the scale is ``[out, in / group]``), or None for one scale per output row (``[out]``)."""

    method: str
    scale: str
    compute_dtype: str
    group: int | None = None


@dataclass(frozen=True)
class TensorRecord:
    """One tensor: where its bytes are (``offset`` is absolute in ``file``), what they are, and their digest."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    digest: str
    tp: TPInfo | None = None
    quant: QuantInfo | None = None


@dataclass(frozen=True)
class FileRecord:
    """One file of the checkpoint, by relative path (``/`` separated), with its size and whole-file digest."""

    name: str
    size: int
    digest: str


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest. Build one with ``build_manifest``; read one with ``Manifest.from_json``."""

    format_version: int
    config: dict[str, object]
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]
    tp_world_size: int = 1
    extra_files: tuple[FileRecord, ...] = field(default=())

    @cached_property
    def identity(self) -> str:
        """``xxh3-128:...`` of the canonical JSON of every field: the checkpoint's identity everywhere."""
        return digest_bytes(canonical_json(self.to_dict()))

    @property
    def total_bytes(self) -> int:
        """Bytes of all weights files."""
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, object]:
        """The manifest as JSON-ready values, without ``identity`` (which is computed from this)."""
        return {
            "format_version": self.format_version,
            "config": self.config,
            "tp_world_size": self.tp_world_size,
            "files": [_file_dict(f) for f in self.files],
            "extra_files": [_file_dict(f) for f in self.extra_files],
            "tensors": [_tensor_dict(t) for t in self.tensors],
        }

    def to_json(self) -> bytes:
        """The ``preheat.json`` bytes: sorted keys, indented for people and diffs, and ``identity`` included so that
        a reader sees the checkpoint's name without computing it (and a manifest edited afterwards is caught)."""
        doc = {**self.to_dict(), "identity": self.identity}
        return (json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate manifest bytes; ``CheckpointError`` naming ``where`` on any problem.

        Bounded for manifests from anywhere: at most ``READ_BYTES_LIMIT`` bytes, JSON nested at most
        ``jsonsafe.MAX_DEPTH`` deep, integers below 2**63, and time about linear in the number of records.
        """
        try:
            doc = loads_bounded(data, max_bytes=READ_BYTES_LIMIT, max_depth=MAX_DEPTH)
        except JSONInputError as exc:
            raise CheckpointError(f"{where}: not a preheat manifest ({exc})", path=where) from None
        return _Parser(where).manifest(doc)

    def files_for_rank(self, rank: int, world_size: int) -> list[FileRecord]:
        """The weights files rank ``rank`` of ``world_size`` loads: all of them for an unsharded checkpoint (the
        loader slices), only the rank's own directory for a pre-sharded one (whose world size must match)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not within world size {world_size}")
        if self.tp_world_size == 1:
            return list(self.files)
        if world_size != self.tp_world_size:
            raise CheckpointError(
                f"this checkpoint is pre-sharded for tensor parallelism over {self.tp_world_size} ranks; load it "
                f"with world_size={self.tp_world_size} and rank 0..{self.tp_world_size - 1} (asked for rank {rank} "
                f"of {world_size}), or convert the unsharded source again with --tp {world_size}"
            )
        prefix = rank_dir(rank, world_size) + "/"
        return [f for f in self.files if f.name.startswith(prefix)]

    def tensors_in(self, file: str) -> list[TensorRecord]:
        """The tensors stored in weights file ``file``, in manifest order."""
        return list(self._tensors_by_file.get(file, ()))

    @cached_property
    def _tensors_by_file(self) -> dict[str, list[TensorRecord]]:
        # Checking every file of a checkpoint asks this once per file: one pass, not one pass per file.
        by_file: dict[str, list[TensorRecord]] = {}
        for record in self.tensors:
            by_file.setdefault(record.file, []).append(record)
        return by_file

    def check_header(self, file: FileRecord, size: int, header: SafetensorsHeader) -> None:
        """Check that a weights file as found (size and parsed header) is the one the manifest describes.

        Cheap (no data is read): it catches a replaced or truncated file, or a manifest edited to fit another one.
        """
        path = header.path
        if size != file.size:
            raise CheckpointError(
                f"{path}: is {size} bytes but {MANIFEST_NAME} says {file.size} (replaced or truncated file?)", path=path
            )
        found = {e.name: e for e in header.tensors}
        records = self.tensors_in(file.name)
        if len(found) != len(records):
            raise CheckpointError(
                f"{path}: holds {len(found)} tensors but {MANIFEST_NAME} lists {len(records)} for it", path=path
            )
        for record in records:
            entry = found.get(record.name)
            if entry is None:
                raise CheckpointError(
                    f"{path}: tensor {record.name!r} listed in {MANIFEST_NAME} is not in this file",
                    path=path,
                    tensor=record.name,
                )
            if (entry.start, entry.nbytes, entry.dtype, entry.shape) != (
                record.offset,
                record.nbytes,
                record.dtype,
                record.shape,
            ):
                raise CheckpointError(
                    f"{path}: tensor {record.name!r} is {entry.dtype}{list(entry.shape)} at byte {entry.start} but "
                    f"{MANIFEST_NAME} says {record.dtype}{list(record.shape)} at byte {record.offset}",
                    path=path,
                    tensor=record.name,
                )


def canonical_json(value: object) -> bytes:
    """The bytes identities are computed over: sorted keys, no whitespace, ASCII only (``\\uXXXX`` escapes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _file_dict(record: FileRecord) -> dict[str, object]:
    return {"name": record.name, "size": record.size, "digest": record.digest}


def _tensor_dict(record: TensorRecord) -> dict[str, object]:
    return {
        "name": record.name,
        "file": record.file,
        "offset": record.offset,
        "nbytes": record.nbytes,
        "dtype": record.dtype,
        "shape": list(record.shape),
        "digest": record.digest,
        "tp": None
        if record.tp is None
        else {"dim": record.tp.dim, "rank": record.tp.rank, "world_size": record.tp.world_size},
        "quant": None if record.quant is None else _quant_dict(record.quant),
    }


def _quant_dict(info: QuantInfo) -> dict[str, object]:
    doc: dict[str, object] = {"method": info.method, "scale": info.scale, "compute_dtype": info.compute_dtype}
    if info.group is not None:  # absent means per row, so manifests written before groups keep their identity
        doc["group"] = info.group
    return doc


class _Parser:
    """Validates a decoded manifest field by field; every failure names the manifest and the record at fault."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, message: str, *, tensor: str | None = None) -> CheckpointError:
        return CheckpointError(f"{self.where}: {message}", path=self.where, tensor=tensor)

    def manifest(self, doc: object) -> Manifest:
        obj = self.obj(doc, "the manifest")
        version = obj.get("format_version")
        if version != FORMAT_VERSION:
            raise self.fail(
                f"format_version {version!r} is not one this preheat reads ({FORMAT_VERSION}); "
                "upgrade preheat, or convert the checkpoint again"
            )
        config = self.obj(self.key(obj, "config"), "config")
        world = self.int(self.key(obj, "tp_world_size"), "tp_world_size", low=1)
        files = tuple(self.file(f, "files") for f in self.list(self.key(obj, "files"), "files"))
        extra = tuple(self.file(f, "extra_files") for f in self.list(self.key(obj, "extra_files"), "extra_files"))
        by_name = {f.name: f for f in files}
        names: set[str] = set()
        for record in (*files, *extra):  # a set, not names.count(): 20,000 files would take seconds
            if record.name in names:
                raise self.fail(f"file {record.name!r} is listed more than once")
            names.add(record.name)
        if MANIFEST_NAME in names:
            raise self.fail(f"{MANIFEST_NAME} cannot list itself")
        tensors = tuple(self.tensor(t, by_name, world) for t in self.list(self.key(obj, "tensors"), "tensors"))
        manifest = Manifest(FORMAT_VERSION, config, files, tensors, world, extra)
        self.check_layout(manifest)
        claimed = obj.get("identity")
        if claimed is not None and claimed != manifest.identity:
            raise self.fail(
                f"identity {claimed!r} does not match the content ({manifest.identity}): the manifest was edited "
                "after it was written; do not trust this checkpoint (convert it again)"
            )
        return manifest

    def check_layout(self, manifest: Manifest) -> None:
        world = manifest.tp_world_size
        seen: set[tuple[str, int]] = set()
        ranks: set[int] = set()
        for file in manifest.files:
            match = RANK_DIR.match(file.name)
            if world > 1 and (match is None or int(match.group(2)) != world or int(match.group(1)) >= world):
                raise self.fail(f"file {file.name!r} is not inside a rank-RRRRR-of-{world:05d}/ directory")
            if match is not None:
                ranks.add(int(match.group(1)))
        for rank in range(world if world > 1 else 0):  # world <= 99999: the files' names were matched above
            if rank not in ranks:
                raise self.fail(f"rank {rank} of {world} has no files (expected {rank_dir(rank, world)}/...)")
        for record in manifest.tensors:
            rank = 0 if record.tp is None else record.tp.rank
            if (record.name, rank) in seen:
                raise self.fail(f"tensor {record.name!r} is listed twice for rank {rank}", tensor=record.name)
            seen.add((record.name, rank))
            if world > 1:
                if record.tp is None:
                    raise self.fail(f"tensor {record.name!r} has no tp entry in a --tp checkpoint", tensor=record.name)
                if not record.file.startswith(rank_dir(record.tp.rank, world) + "/"):
                    raise self.fail(
                        f"tensor {record.name!r} of rank {record.tp.rank} is stored in {record.file!r}, outside "
                        f"{rank_dir(record.tp.rank, world)}/",
                        tensor=record.name,
                    )
        for record in manifest.tensors:
            if record.quant is not None:
                rank = 0 if record.tp is None else record.tp.rank
                if (record.quant.scale, rank) not in seen:
                    raise self.fail(
                        f"tensor {record.name!r} names scale tensor {record.quant.scale!r}, which is not listed",
                        tensor=record.name,
                    )

    def file(self, value: object, what: str) -> FileRecord:
        obj = self.obj(value, f"an entry of {what}")
        name = self.name(self.key(obj, "name"), what)
        size = self.int(self.key(obj, "size"), f"size of {name!r}", low=0)
        return FileRecord(name, size, self.digest(self.key(obj, "digest"), f"digest of {name!r}"))

    def tensor(self, value: object, files: Mapping[str, FileRecord], world: int) -> TensorRecord:
        obj = self.obj(value, "an entry of tensors")
        name = self.key(obj, "name")
        if not isinstance(name, str) or not name:
            raise self.fail(f"tensor name {name!r} is not a non-empty string")
        file = self.key(obj, "file")
        if not isinstance(file, str) or file not in files:
            raise self.fail(f"tensor {name!r} is in file {file!r}, which is not listed in files", tensor=name)
        offset = self.int(self.key(obj, "offset"), f"offset of tensor {name!r}", low=0)
        nbytes = self.int(self.key(obj, "nbytes"), f"nbytes of tensor {name!r}", low=0)
        dtype = self.key(obj, "dtype")
        if not isinstance(dtype, str) or not dtypes.is_known(dtype):
            raise self.fail(f"tensor {name!r} has unknown dtype {dtype!r}", tensor=name)
        raw_shape = self.list(self.key(obj, "shape"), f"shape of tensor {name!r}")
        if len(raw_shape) > MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {len(raw_shape)} dimensions, more than {MAX_DIMS}", tensor=name)
        shape = tuple(self.int(d, f"shape of tensor {name!r}", low=0) for d in raw_shape)
        if math.prod(shape) * dtypes.itemsize(dtype) != nbytes:
            raise self.fail(f"tensor {name!r}: {dtype}{list(shape)} cannot span {nbytes} bytes", tensor=name)
        if offset + nbytes > files[file].size:
            raise self.fail(
                f"tensor {name!r} ends at byte {offset + nbytes}, past the end of {file!r} ({files[file].size} bytes)",
                tensor=name,
            )
        digest = self.digest(self.key(obj, "digest"), f"digest of tensor {name!r}")
        tp = None if obj.get("tp") is None else self.tp(obj["tp"], name, world)
        quant = None if obj.get("quant") is None else self.quant(obj["quant"], name, dtype)
        return TensorRecord(name, file, offset, nbytes, dtype, shape, digest, tp, quant)

    def tp(self, value: object, tensor: str, world: int) -> TPInfo:
        obj = self.obj(value, f"tp of tensor {tensor!r}")
        dim = obj.get("dim")
        if dim is not None and not (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0):
            raise self.fail(f"tp.dim of tensor {tensor!r} must be a dimension index or null", tensor=tensor)
        size = self.int(self.key(obj, "world_size"), f"tp.world_size of tensor {tensor!r}", low=1)
        rank = self.int(self.key(obj, "rank"), f"tp.rank of tensor {tensor!r}", low=0)
        if size != world or rank >= size:
            raise self.fail(
                f"tensor {tensor!r} is rank {rank} of {size}, but the checkpoint has tp_world_size {world}",
                tensor=tensor,
            )
        return TPInfo(dim, rank, size)

    def quant(self, value: object, tensor: str, dtype: str) -> QuantInfo:
        obj = self.obj(value, f"quant of tensor {tensor!r}")
        method = self.key(obj, "method")
        if not isinstance(method, str) or method not in QUANT_METHODS:  # a list would not even hash
            raise self.fail(f"tensor {tensor!r} has unknown quantization method {brief(method)}", tensor=tensor)
        if QUANT_METHODS[str(method)] != dtype:
            raise self.fail(
                f"tensor {tensor!r} is {dtype}, but {method} weights are stored as {QUANT_METHODS[str(method)]}"
            )
        scale = self.key(obj, "scale")
        compute = self.key(obj, "compute_dtype")
        if not isinstance(scale, str) or not scale:
            raise self.fail(f"quant.scale of tensor {tensor!r} must name a tensor", tensor=tensor)
        if not isinstance(compute, str) or not dtypes.is_known(compute):
            raise self.fail(f"tensor {tensor!r} has unknown compute dtype {compute!r}", tensor=tensor)
        if "group" in obj and obj["group"] is None:
            raise self.fail(f"quant.group of tensor {tensor!r} must be omitted for per-row scales, not null")
        group = self.int(obj["group"], f"quant.group of tensor {tensor!r}", low=1) if "group" in obj else None
        return QuantInfo(str(method), scale, compute, group)

    def obj(self, value: object, what: str) -> dict[str, object]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be a JSON object")
        return value

    def list(self, value: object, what: str) -> list[object]:
        if not isinstance(value, list):
            raise self.fail(f"{what} must be a JSON array")
        return value

    def key(self, obj: Mapping[str, object], key: str) -> object:
        if key not in obj:
            raise self.fail(f"missing key {key!r}")
        return obj[key]

    def int(self, value: object, what: str, *, low: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_INT:
            raise self.fail(f"{what} must be an integer in [{low}, 2**63), got {brief(value)}")
        return value

    def name(self, value: object, what: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"a name in {what} is not a string: {value!r}")
        try:
            check_name(value)
        except ConfigError as exc:
            raise self.fail(str(exc)) from None
        # Reserved: a pull keeps its journal (".journal") and temporary files under such names beside the files, so
        # such a checkpoint could never be pulled whole; and no preheat server sends a dot-file.
        if any(part.startswith(".") for part in value.split("/")):
            raise self.fail(
                f"file {value!r} in {what}: names starting with '.' (files or directories) are reserved for preheat's "
                "own files such as '.journal': rename it, or leave it out of the checkpoint"
            )
        return value

    def digest(self, value: object, what: str) -> str:
        if not isinstance(value, str) or not _DIGEST.match(value):
            raise self.fail(f"{what} must look like 'xxh3-128:<32 hex digits>', got {value!r}")
        return value


# Building a manifest from files on disk.


def build_manifest(
    directory: str,
    *,
    config: Mapping[str, object] | None = None,
    tp_dims: Mapping[str, int | None] | None = None,
    quant: Mapping[str, QuantInfo] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Hash an existing directory of safetensors files (and the other files beside them) into a manifest.

    ``config`` defaults to the directory's ``config.json`` (or ``{}``). Files under ``rank-RRRRR-of-WWWWW/``
    directories make a pre-sharded checkpoint; each tensor's split dim comes from ``tp_dims`` (by tensor name), else
    from the loader's built-in plan. ``quant`` maps quantized weight names to their ``QuantInfo``. Every byte of every
    file is read once; ``progress(nbytes)`` is called as it goes.
    """
    root = os.fspath(directory)
    weights, extras = _walk(root)
    if not weights:
        raise CheckpointError(f"{root}: no *.safetensors files to describe", path=root)
    world = _world_size(root, weights)
    if config is None:
        config = read_config(root)
    file_records: list[FileRecord] = []
    tensor_records: list[TensorRecord] = []
    for name in weights:
        path = os.path.join(root, name)
        header = read_header(path).header
        entries = sorted(header.tensors, key=lambda e: e.start)
        whole, digests = hash_file(path, [(e.start, e.nbytes) for e in entries], progress=progress)
        file_records.append(FileRecord(name, os.path.getsize(path), whole))
        rank = 0 if world == 1 else int(name[5:10])
        for entry, digest in zip(entries, digests, strict=True):
            tp = None
            if world > 1:
                dim = (
                    tp_dims[entry.name]
                    if tp_dims is not None and entry.name in tp_dims
                    else split_dim(entry.name, "auto", ndim=len(entry.shape))
                )
                tp = TPInfo(dim, rank, world)
            info = quant.get(entry.name) if quant is not None else None
            tensor_records.append(
                TensorRecord(entry.name, name, entry.start, entry.nbytes, entry.dtype, entry.shape, digest, tp, info)
            )
    extra_records = [
        FileRecord(n, os.path.getsize(os.path.join(root, n)), file_digest(os.path.join(root, n))) for n in extras
    ]
    manifest = Manifest(
        FORMAT_VERSION, dict(config), tuple(file_records), tuple(tensor_records), world, tuple(extra_records)
    )
    # Round-trip through the parser so a manifest that could not be read back is never written.
    return Manifest.from_json(manifest.to_json(), where=os.path.join(root, MANIFEST_NAME))


def _walk(root: str) -> tuple[list[str], list[str]]:
    """Relative names of weights files and of other files under ``root`` (sorted; the manifest itself and
    dot-files such as temporary files excluded)."""
    weights: list[str] = []
    extras: list[str] = []
    for current, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            rel = os.path.relpath(os.path.join(current, name), root).replace(os.sep, "/")
            if name.startswith(".") or rel == MANIFEST_NAME or ".tmp-" in name:
                continue
            if not os.path.isfile(os.path.join(current, name)):
                continue
            (weights if name.endswith(".safetensors") else extras).append(rel)
    return sorted(weights), sorted(extras)


def _world_size(root: str, weights: Iterable[str]) -> int:
    worlds = set()
    for name in weights:
        match = RANK_DIR.match(name)
        worlds.add(int(match.group(2)) if match else 1)
    if len(worlds) != 1:
        raise CheckpointError(
            f"{root}: mixes files inside and outside rank-RRRRR-of-WWWWW/ directories (or several world sizes)",
            path=root,
        )
    return worlds.pop()
