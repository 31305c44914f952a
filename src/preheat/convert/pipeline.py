"""``preheat convert``: Hugging Face / safetensors / GGUF in, a verified preheat checkpoint out.

The output is a directory of plain safetensors files (any tool can read them), ``config.json``, the tokenizer files,
and ``preheat.json`` (docs/checkpoint-format.md). It is never visible half-written:

1. plan: every output tensor's dtype, rank slice and file is decided (and every TP split checked) before a byte is
   written, so a checkpoint that cannot be sharded fails at once;
2. write: into ``DST.tmp-<pid>`` beside DST, one file of at most ~2 GiB at a time (each file written atomically,
   fsynced), remembering the digest of every tensor as it was in memory;
3. verify: every file is read back from disk and hashed into the manifest; each tensor's digest must equal the one
   computed in memory, and the manifest must parse back to the same identity;
4. publish: ``os.replace`` into DST (an existing DST only with ``force``, swapped out and then removed).
Any failure removes the temporary directory; a process killed outright leaves only ``DST.tmp-<pid>``, which no reader
mistakes for a checkpoint and the next conversion to DST removes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from preheat.checkpoint import dtypes, torch_dtypes
from preheat.checkpoint.digest import digest_bytes
from preheat.checkpoint.layout import read_manifest
from preheat.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    QuantInfo,
    build_manifest,
    rank_dir,
)
from preheat.checkpoint.publish import publish_dir, remove_stale_temps, write_bytes
from preheat.checkpoint.quant import (
    check_split,
    compute_scales,
    group_size,
    is_quantizable,
    quantize_with,
    scale_name,
    scale_shape,
    stored_dtype,
)
from preheat.checkpoint.safetensors import TensorEntry
from preheat.checkpoint.tp import rank_slice, split_dim
from preheat.checkpoint.writer import save_file
from preheat.convert.inputs import Progress, SourceModel, read_source
from preheat.core.errors import CheckpointError, ConfigError

DTYPES = ("keep", "bf16", "fp16", "fp8", "int8")
DEFAULT_SHARD_BYTES = 2 * 1024**3
_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion produced: where, its identity, and how big."""

    source: str
    destination: str
    source_format: str
    identity: str
    dtype: str
    tp: int
    files: int
    tensors: int
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of one output file: which source tensor it comes from, how it is converted and sliced."""

    name: str
    source: str
    role: str  # "plain" (cast or kept), "weight" (quantized values) or "scale" (its per-row or per-group scales)
    dtype: torch.dtype
    shape: tuple[int, ...]  # as stored: this rank's slice
    dim: int | None  # the dim sliced for TP, None when stored whole
    start: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """Every output file (relative name -> its tensors in order) and the per-tensor metadata for the manifest."""

    files: dict[str, list[PlannedTensor]]
    tp_dims: dict[str, int | None]
    quant: dict[str, QuantInfo]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for items in self.files.values() for t in items)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    tp: int = 1,
    dtype: str = "keep",
    force: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert ``src`` (a Hugging Face directory, a ``.safetensors`` file, a preheat checkpoint or a GGUF file)
    into a verified preheat checkpoint at ``dst``.

    >>> convert("SmolLM2.gguf", "smollm2-int8", dtype="int8")           # doctest: +SKIP
    >>> convert("./Llama-3-8B", "./llama-tp2", tp=2, dtype="bf16")      # doctest: +SKIP

    ``tp > 1`` writes ``rank-RRRRR-of-WWWWW/`` directories holding each rank's slices (the loader's built-in TP
    plan); ``dtype``: ``keep``, ``bf16``/``fp16`` (cast floating tensors), ``int8``/``fp8`` (weight-only quantized
    linear weights, see ``preheat.checkpoint.quant``). Raises ``ConfigError`` for bad options or an existing ``dst``
    without ``force``, ``CheckpointError`` naming the file/tensor for anything wrong with the data.
    """
    started = time.perf_counter()
    source, target = os.fspath(src), os.path.abspath(os.fspath(dst))
    _check_options(source, target, tp=tp, dtype=dtype, force=force, shard_bytes=shard_bytes)
    model = read_source(source, progress=progress)
    plan = plan_conversion(model.tensors, dtype=dtype, tp=tp, shard_bytes=shard_bytes, where=source)
    config = _output_config(model.config, dtype)
    remove_stale_temps(target)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        os.makedirs(tmp)
        expected = _write(tmp, model, plan, config, progress)
        manifest = _verify(tmp, plan, config, expected, progress)
        publish_dir(tmp, target, force=force)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        where = exc.filename or tmp
        raise CheckpointError(f"{where}: cannot write the conversion: {exc.strerror or exc}", path=where) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertResult(
        source=source,
        destination=target,
        source_format=model.format,
        identity=manifest.identity,
        dtype=dtype,
        tp=tp,
        files=len(manifest.files),
        tensors=len({t.name for t in manifest.tensors}),
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - started,
    )


def _check_options(source: str, target: str, *, tp: int, dtype: str, force: bool, shard_bytes: int) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {tp}")
    if shard_bytes < 1:
        raise ConfigError(f"shard size must be positive, got {shard_bytes}")
    if not os.path.exists(source):
        raise CheckpointError(f"{source}: no such file or directory", path=source)
    if os.path.realpath(source) == os.path.realpath(target):
        raise ConfigError(f"{target}: the destination is the source; write the conversion somewhere else")
    if os.path.lexists(target) and not force:
        raise ConfigError(f"{target}: already exists; choose another destination or pass --force to replace it")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise ConfigError(f"{target}: parent directory {parent} does not exist")


def _output_config(config: dict[str, object], dtype: str) -> dict[str, object]:
    out = dict(config)
    if dtype in _CONFIG_DTYPE and out:
        keys = [k for k in ("torch_dtype", "dtype") if k in out] or ["torch_dtype"]
        for key in keys:
            out[key] = _CONFIG_DTYPE[dtype]
    return out


# Planning: pure, so every error (a tensor that cannot be split, a name clash) comes before any write.


def plan_conversion(tensors: Mapping[str, torch.Tensor], *, dtype: str, tp: int, shard_bytes: int, where: str) -> Plan:
    """Decide every output tensor (dtype, rank slice) and which file it goes to."""
    per_rank: list[list[PlannedTensor]] = [[] for _ in range(tp)]
    tp_dims: dict[str, int | None] = {}
    quant: dict[str, QuantInfo] = {}
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        outputs: list[tuple[str, str, torch.dtype, tuple[int, ...]]]
        if dtype in ("int8", "fp8") and is_quantizable(name, shape, tensor.dtype):
            scale = scale_name(name)
            if scale in tensors:
                raise CheckpointError(f"{where}: cannot quantize {name!r}: {scale!r} already exists", tensor=name)
            scales = scale_shape(name, shape, dtype)
            if tp > 1 and split_dim(name, "auto", ndim=len(shape)) == 1:
                check_split(name, shape, dtype, tp)  # before rank_slice, whose error would name the scale instead
            outputs = [(name, "weight", stored_dtype(dtype), shape), (scale, "scale", torch.float32, scales)]
            quant[name] = QuantInfo(dtype, scale, torch_dtypes.from_torch(tensor.dtype), group_size(dtype))
        elif dtype in _CAST and tensor.dtype.is_floating_point and tensor.dtype.itemsize > 1:
            outputs = [(name, "plain", _CAST[dtype], shape)]
        else:
            outputs = [(name, "plain", tensor.dtype, shape)]
        for out_name, role, out_dtype, out_shape in outputs:
            entry = _entry(out_name, out_dtype, out_shape)
            for rank in range(tp):
                part = rank_slice(entry, "auto", rank, tp, path=where)
                per_rank[rank].append(
                    PlannedTensor(out_name, name, role, out_dtype, part.shape, part.dim, part.start, part.nbytes)
                )
                if tp > 1:
                    tp_dims[out_name] = part.dim
    files: dict[str, list[PlannedTensor]] = {}
    for rank, items in enumerate(per_rank):
        shards = _shard(items, shard_bytes)
        for k, shard in enumerate(shards, start=1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            if tp > 1:
                name = f"{rank_dir(rank, tp)}/{name}"
            elif len(shards) == 1:
                name = "model.safetensors"  # the Hugging Face name, so transformers can open an unsharded output
            files[name] = shard
    return Plan(files, tp_dims, quant)


def _entry(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorEntry:
    kind = torch_dtypes.from_torch(dtype)
    return TensorEntry(name, kind, shape, 0, _numel(shape) * dtypes.itemsize(kind))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _shard(items: list[PlannedTensor], limit: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for item in items:
        if shards[-1] and size + item.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards


# Writing and verifying.


class _Converter:
    """Converts source tensors on demand, slicing before converting so that each rank pays only for its own part.

    A quantized weight's scales are computed once from the whole tensor and remembered for its ``.scale``, which is
    planned right after it; each slice of the weight is quantized with its own part of them: its rows' (dim 0), its
    column groups' (dim 1, grouped scales), or all of them (dim 1, per-row scales, which span every column).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], quant: Mapping[str, QuantInfo]) -> None:
        self.tensors, self.quant = tensors, quant
        self._scales: tuple[str, torch.Tensor] | None = None

    def __call__(self, item: PlannedTensor) -> torch.Tensor:
        source = self.tensors[item.source]
        if item.role == "plain":
            return _part(source, item).to(item.dtype).contiguous()
        method = self.quant[item.source].method
        if self._scales is None or self._scales[0] != item.source:
            self._scales = (item.source, compute_scales(item.source, source, method))
        scale = self._scales[1]
        if item.role == "scale":
            return _part(scale, item).contiguous()
        group = group_size(method)
        if item.dim == 0:
            scale = scale.narrow(0, item.start, item.shape[0])
        elif item.dim == 1 and group is not None:  # check_split made the slice start and end on group boundaries
            scale = scale.narrow(1, item.start // group, item.shape[1] // group)
        return quantize_with(_part(source, item), scale, method).contiguous()


def _part(tensor: torch.Tensor, item: PlannedTensor) -> torch.Tensor:
    return tensor if item.dim is None else tensor.narrow(item.dim, item.start, item.shape[item.dim])


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (for hashing)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _write(
    tmp: str, model: SourceModel, plan: Plan, config: Mapping[str, object], progress: Progress | None
) -> dict[tuple[str, str], str]:
    """Write every planned file and side file into ``tmp``; return the in-memory digest of each (file, tensor) and
    of each side file (keyed ``(name, "")``)."""
    convert_one = _Converter(model.tensors, plan.quant)
    expected: dict[tuple[str, str], str] = {}
    total, done = plan.total_bytes, 0
    for name, items in plan.files.items():
        out: dict[str, torch.Tensor] = {}
        for item in items:
            tensor = convert_one(item)  # the cast or quantization: most of this stage's time
            expected[(name, item.name)] = digest_bytes(tensor_bytes(tensor))
            out[item.name] = tensor
            done += item.nbytes
            if progress is not None and done < total:  # per tensor; the last bytes count once the file is saved
                progress("write", done, total)
        path = os.path.join(tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(out, path, {"format": "pt"})
        if progress is not None:
            progress("write", done, total)
    side = dict(model.files)
    if config:
        side["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    if len(plan.files) > 1 and "model.safetensors" not in plan.files and not plan.tp_dims:
        weight_map = {item.name: name for name, items in plan.files.items() for item in items}
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        side["model.safetensors.index.json"] = (json.dumps(index, indent=2) + "\n").encode()
    for name, data in side.items():
        write_bytes(os.path.join(tmp, name), data)
        expected[(name, "")] = digest_bytes(data)
    return expected


def _verify(
    tmp: str,
    plan: Plan,
    config: dict[str, object],
    expected: Mapping[tuple[str, str], str],
    progress: Progress | None,
) -> Manifest:
    """Hash what is on disk into the manifest, compare with what was in memory, write the manifest and read it back."""
    total, done = plan.total_bytes, 0

    def tick(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress("verify", min(done, total), total)

    manifest = build_manifest(tmp, config=config, tp_dims=plan.tp_dims, quant=plan.quant, progress=tick)
    found = {(t.file, t.name): t.digest for t in manifest.tensors}
    found |= {(f.name, ""): f.digest for f in manifest.extra_files}
    for key, digest in expected.items():
        if found.get(key) != digest:
            file, tensor = key
            where = os.path.join(tmp, file)
            what = f"tensor {tensor!r}" if tensor else "the file"
            raise CheckpointError(
                f"{where}: {what} read back differently from what was written (disk or filesystem corrupted it)",
                path=where,
                tensor=tensor or None,
            )
    if len(found) != len(expected):
        unexpected = sorted(set(found) - set(expected))
        raise CheckpointError(f"{tmp}: unexpected content appeared while converting: {unexpected[:3]}", path=tmp)
    path = os.path.join(tmp, MANIFEST_NAME)
    write_bytes(path, manifest.to_json())
    reread = read_manifest(tmp)
    if reread is None or reread.identity != manifest.identity:
        raise CheckpointError(f"{path}: read back with a different identity; the manifest was not stored intact")
    return reread
