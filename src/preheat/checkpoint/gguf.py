"""GGUF input: read a llama.cpp checkpoint as dequantized tensors under Hugging Face names, plus config and tokenizer.

GGUF stores (block-)quantized tensors under llama.cpp names, with q/k projections permuted for its RoPE layout and the
tokenizer and hyper-parameters as key/value metadata. Rather than re-implement every block format and architecture
mapping, this module uses the GGUF loader of ``transformers`` (which uses the ``gguf`` package to dequantize): it
supports the Llama family (Llama, Mistral, Qwen2, SmolLM ...) and more. Install with ``pip install 'preheat[gguf]'``.

Tensors come back in float32, exactly what dequantization produced; ``preheat convert --dtype`` picks what is stored.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from dataclasses import dataclass

import torch

from preheat.errors import CheckpointError, ConfigError

GGUF_MAGIC = b"GGUF"
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


def read_gguf(path: str) -> GGUFModel:
    """Dequantize every tensor of the GGUF file ``path`` and extract its config and tokenizer.

    Raises ``ConfigError`` when the optional dependencies are missing and ``CheckpointError`` naming ``path`` when
    the file cannot be read as a model.
    """
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
        with contextlib.redirect_stderr(io.StringIO()):
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


def _clean_config(raw: dict[str, object], architecture: str) -> dict[str, object]:
    config = {k: v for k, v in raw.items() if k not in _DROP_KEYS}
    if not config.get("architectures"):
        config["architectures"] = [architecture]
    # Round-trip through JSON so only plain values remain (transformers may hold enums or dtypes).
    loaded: dict[str, object] = json.loads(json.dumps(config, default=str))
    return loaded
