"""The safetensors format as pure code: parse and validate a header, no file I/O here.

A safetensors file is ``u64 little-endian header length N`` + ``N bytes of JSON`` + the data region. The JSON maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data region) and may hold
``"__metadata__"`` (string to string). ``parse_header`` checks everything a reader could trip on later (sizes, offsets,
overlaps, dtypes) so that nothing past this point can read out of bounds.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from preheat.checkpoint import dtypes
from preheat.core.errors import CheckpointError, JSONInputError
from preheat.core.jsonsafe import MAX_DEPTH, loads_bounded

PREFIX_BYTES = 8
# Real headers are kilobytes to a few MiB; anything beyond this is a different file type or garbage, and refusing it
# early avoids allocating gigabytes because of 8 random bytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bounds on the numbers in a header (and a manifest): sizes and offsets are below 2**63 (no file is larger), and a
# tensor has at most 64 dimensions (NumPy's limit), so computing a tensor's size never multiplies huge integers.
MAX_INT = 2**63 - 1
MAX_DIMS = 64


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of one file: its tensors in file order, its metadata and where data begins."""

    path: str
    data_start: int
    data_end: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]

    def entry(self, name: str) -> TensorEntry:
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        raise CheckpointError(f"{self.path}: no tensor named {name!r}", path=self.path, tensor=name)


def header_length(prefix: bytes, *, path: str, file_size: int) -> int:
    """Decode and sanity-check the 8-byte length prefix against the file's size."""
    if len(prefix) < PREFIX_BYTES:
        raise CheckpointError(
            f"{path}: only {len(prefix)} bytes long; a safetensors file starts with an 8-byte header length",
            path=path,
        )
    (length,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: not a safetensors file (its first 8 bytes declare a {length}-byte header)", path=path
        )
    if PREFIX_BYTES + length > file_size:
        raise CheckpointError(
            f"{path}: header length {length} runs past the end of the {file_size}-byte file "
            "(truncated download, or not a safetensors file)",
            path=path,
        )
    return int(length)


def parse_header(raw: bytes, *, path: str, file_size: int) -> SafetensorsHeader:
    """Validate the JSON header ``raw`` (the bytes after the length prefix) of a ``file_size``-byte file."""
    data_start = PREFIX_BYTES + len(raw)
    try:
        doc = loads_bounded(raw, max_bytes=MAX_HEADER_BYTES, max_depth=MAX_DEPTH)
    except JSONInputError as exc:
        raise CheckpointError(f"{path}: not a safetensors file (header refused: {exc})", path=path) from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)", path=path)

    metadata_raw = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict):
        raise CheckpointError(f"{path}: __metadata__ must be an object of strings", path=path)
    metadata = {str(k): str(v) for k, v in metadata_raw.items()}

    entries = [_entry(name, spec, path=path, data_start=data_start) for name, spec in doc.items()]
    entries.sort(key=lambda e: (e.start, e.end))
    data_end = data_start
    previous: TensorEntry | None = None
    for entry in entries:
        if entry.end > file_size:
            raise CheckpointError(
                f"{path}: tensor {entry.name!r} ends at byte {entry.end} but the file has only {file_size} bytes "
                "(truncated file?)",
                path=path,
                tensor=entry.name,
            )
        # Zero-sized tensors may share an offset with a neighbour; real bytes may not.
        if previous is not None and entry.nbytes and previous.nbytes and entry.start < previous.end:
            raise CheckpointError(
                f"{path}: tensor {entry.name!r} [{entry.start}, {entry.end}) overlaps {previous.name!r} "
                f"[{previous.start}, {previous.end})",
                path=path,
                tensor=entry.name,
            )
        if entry.nbytes:
            previous = entry
        data_end = max(data_end, entry.end)
    return SafetensorsHeader(path, data_start, data_end, tuple(entries), metadata)


def _entry(name: str, spec: object, *, path: str, data_start: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise CheckpointError(f"{path}: entry for tensor {name!r} is not an object", path=path, tensor=name)
    dtype = spec.get("dtype")
    shape = spec.get("shape")
    offsets = spec.get("data_offsets")
    if not isinstance(dtype, str) or not dtypes.is_known(dtype):
        raise CheckpointError(
            f"{path}: tensor {name!r} has unknown dtype {dtype!r} (known: {', '.join(dtypes.known_names())})",
            path=path,
            tensor=name,
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_bounded(d) for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid shape {brief(shape)}", path=path, tensor=name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_bounded(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(
            f"{path}: tensor {name!r} has invalid data_offsets {brief(offsets)}", path=path, tensor=name
        )
    expected = math.prod(shape) * dtypes.itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but dtype {dtype} and shape {shape} "
            f"need {expected}",
            path=path,
            tensor=name,
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _bounded(value: object) -> bool:
    """A size, offset or dimension: an integer (not a bool) in ``[0, MAX_INT]``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def brief(value: object) -> str:
    """``repr(value)`` cut short for a message (a hostile header's or manifest's values can be megabytes)."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def encode_header(
    tensors: dict[str, tuple[str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> bytes:
    """Build the prefix+header bytes for tensors given as ``name -> (dtype, shape, nbytes)`` laid out in dict order.

    The header is padded with spaces so the data region starts 8-byte aligned, as the reference writer does.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(PREFIX_BYTES + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw
