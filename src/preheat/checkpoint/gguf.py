"""GGUF input: read a llama.cpp checkpoint as dequantized tensors under Hugging Face names, plus config and tokenizer.

GGUF stores (block-)quantized tensors under llama.cpp names, with q/k projections permuted for its RoPE layout and the
tokenizer and hyper-parameters as key/value metadata. Rather than re-implement every block format and architecture
mapping, this module uses the GGUF loader of ``transformers`` (which uses the ``gguf`` package to dequantize): it
supports the Llama family (Llama, Mistral, Qwen2, SmolLM ...) and more. Install with ``pip install 'preheat[gguf]'``.

Tensors come back in float32, exactly what dequantization produced; ``preheat convert --dtype`` picks what is stored.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import mmap
import os
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from preheat.core.errors import CheckpointError, ConfigError
from preheat.core.jsonsafe import load_object

GGUF_MAGIC = b"GGUF"
Progress = Callable[[str, int, int], None]  # (stage, done bytes, total bytes): ProgressBars.stage
METADATA, DEQUANTIZE = "read GGUF metadata", "dequantize"  # the stages read_gguf reports
_INSTALL = "pip install 'preheat[gguf]' (transformers, gguf, accelerate)"
# Keys of transformers' config that describe this machine or this load, not the model; they would make the
# checkpoint's identity depend on where and how it was converted.
_DROP_KEYS = ("_name_or_path", "quantization_config", "transformers_version", "_commit_hash")


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds: float32 tensors by Hugging Face name, the model config, and tokenizer files by name."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, object]
    files: dict[str, bytes]


def is_gguf(path: str) -> bool:
    """True when ``path`` is a regular file starting with the GGUF magic bytes."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as handle:
        return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def read_gguf(path: str, progress: Progress | None = None) -> GGUFModel:
    """Dequantize every tensor of the GGUF file ``path`` and extract its config and tokenizer.

    ``progress`` hears two stages, in bytes: ``read GGUF metadata`` (the key/value section: vocabulary, merges) and
    ``dequantize`` (the tensors' stored bytes). Raises ``ConfigError`` when the optional dependencies are missing and
    ``CheckpointError`` naming ``path`` when the file cannot be read as a model.
    """
    metadata = metadata_bytes(path)
    if progress is not None:
        progress(METADATA, 0, metadata or 0)  # a bar (and its clock) while transformers imports
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ConfigError(f"{path}: reading GGUF files needs optional dependencies: {_INSTALL}") from None
    folder, name = os.path.split(os.path.abspath(path))
    # transformers draws a tqdm bar per tensor on stderr; preheat's own CLI shows progress instead.
    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    try:
        # Its GGUF reader also draws a bare tqdm bar (which nothing switches off) straight to sys.stderr.
        with _transformers_hooks(progress, metadata, sys.stderr), contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32, local_files_only=True
            )
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except ImportError as exc:
        raise ConfigError(f"{path}: reading GGUF files needs optional dependencies ({exc}): {_INSTALL}") from None
    except Exception as exc:
        # A third-party parser of untrusted bytes raises anything (struct.error, IndexError, ValueError...); to the
        # user each is a bad input file, so it stops here as one typed error naming the file.
        raise CheckpointError(f"{path}: cannot read this GGUF file as a model: {exc}", path=path) from None
    finally:
        if not bars_were_off:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    tensors = {key: value.detach() for key, value in model.state_dict().items()}
    config = _clean_config(model.config.to_dict(), type(model).__name__)
    with tempfile.TemporaryDirectory(prefix="preheat-gguf-") as scratch:
        tokenizer.save_pretrained(scratch)
        files = {}
        for entry in sorted(os.listdir(scratch)):
            with open(os.path.join(scratch, entry), "rb") as handle:
                files[entry] = handle.read()
    return GGUFModel(tensors, config, files)


@contextlib.contextmanager
def _transformers_hooks(progress: Progress | None, metadata: int | None, stderr: TextIO) -> Iterator[None]:
    """While transformers reads a GGUF file: parse it once, and report how far it got.

    transformers builds the config, the model and the tokenizer from the same file, and each parses its metadata
    again (``gguf.GGUFReader``: the vocabulary one value at a time), then maps tensor names with a table it rebuilds
    for each of the model's ~400 modules (``gguf.get_tensor_name_map``): together about half of a conversion. Here the
    reader is parsed once per path and the table built once per architecture (both are only read afterwards), the
    parse reports its offset in the metadata, and the dequantization loop (wrapped in tqdm) each tensor's bytes.
    Each hook is applied only where this version of transformers and gguf has the name it replaces, and undone on
    leaving; another thread reading a GGUF meanwhile shares them, which changes nothing it gets. ``progress`` is
    called with ``stderr`` (the one before transformers' output is silenced) as ``sys.stderr``: its lines are shown.
    """
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    def report(stage: str, done: int, total: int) -> None:
        if progress is not None:
            with contextlib.redirect_stderr(stderr):
                progress(stage, done, total)

    originals: dict[tuple[Any, str], object] = {}  # Any: the modules whose attributes are swapped

    def swap(owner: Any, name: str, replacement: object) -> None:  # Any: a module
        if hasattr(owner, name):
            originals[(owner, name)] = getattr(owner, name)
            setattr(owner, name, replacement)

    reader_class: type[Any] = gguf.GGUFReader  # Any: gguf's class, subclassed below
    readers: dict[str, Any] = {}  # Any: GGUFReader instances

    class ReportingReader(reader_class):  # type: ignore[misc]  # a base class of type Any (gguf ships no stubs)
        def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:  # Any: GGUFReader's own signature
            self._reported = 0
            super().__init__(path, *args, **kwargs)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:  # Any: GGUFReader's return value
            # Called for every metadata value, in file order: its offset is how far the parse has got.
            if metadata and orig_offs - self._reported >= 1 << 16:
                self._reported = orig_offs
                report(METADATA, min(orig_offs, metadata), metadata)
            return super()._get_field_parts(orig_offs, raw_type)

    def reader(path: str, *args: Any, **kwargs: Any) -> Any:  # Any: GGUFReader's signature and instance
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = ReportingReader(path, *args, **kwargs)
            report(METADATA, metadata or 1, metadata or 1)
        return readers[key]

    def counted(tensors: Iterable[Any], *args: object, **kwargs: object) -> Iterator[Any]:  # Any: ReaderTensor
        every = list(tensors)
        total, done = sum(int(t.n_bytes) for t in every), 0
        for tensor in every:
            report(DEQUANTIZE, done, total)
            yield tensor
            done += int(tensor.n_bytes)
        report(DEQUANTIZE, done, total)

    swap(gguf, "GGUFReader", reader)
    swap(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    swap(hf_gguf, "tqdm", counted)
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def metadata_bytes(path: str) -> int | None:
    """Where the key/value metadata of the GGUF file ``path`` ends (from its header: magic, version, counts, then
    each key and value), or None when the header does not parse as GGUF v2/v3 (the reader then says why). Walks
    lengths only, in well under a second for a 150,000-token vocabulary, never past the end of the file."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _metadata_end(data)
    except (OSError, ValueError, struct.error, RecursionError):  # unreadable, empty, lengths past the end, nesting
        return None


def _metadata_end(data: bytes | mmap.mmap) -> int | None:
    magic, version, _tensors, entries = struct.unpack_from("<4sIQQ", data, 0)
    if magic != GGUF_MAGIC or version not in (2, 3):
        return None
    offset, size = 24, len(data)

    def string(at: int) -> int:
        (length,) = struct.unpack_from("<Q", data, at)
        if length > size:
            raise ValueError("a string longer than the file")
        return at + 8 + int(length)

    def value(kind: int, at: int) -> int:
        if kind in _SCALAR_SIZES:
            return at + _SCALAR_SIZES[kind]
        if kind == _STRING:
            return string(at)
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item in _SCALAR_SIZES:
            return at + int(count) * _SCALAR_SIZES[item]
        if count > size:  # each item takes at least a byte
            raise ValueError("an array longer than the file")
        for _ in range(count):
            at = value(item, at)
        return at

    for _ in range(min(entries, size)):
        offset = string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        offset = value(kind, offset + 4)
        if offset > size:
            return None
    return offset


def _clean_config(raw: dict[str, object], architecture: str) -> dict[str, object]:
    config = {k: v for k, v in raw.items() if k not in _DROP_KEYS}
    if not config.get("architectures"):
        config["architectures"] = [architecture]
    # Round-trip through JSON so only plain values remain (transformers may hold enums or dtypes). The dict came
    # from a GGUF file's metadata, so it is parsed back within jsonsafe's depth; json.dumps writes ASCII only, so
    # its length is its size in bytes; NaN stays NaN, as before.
    text = json.dumps(config, default=str)
    return load_object(text, max_bytes=len(text), allow_constants=True)
