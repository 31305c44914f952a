"""What ``preheat convert`` reads: a Hugging Face directory, a ``.safetensors`` file (with the config and tokenizer
beside it), a preheat checkpoint (dequantized; pre-sharded ones are refused), or a GGUF file."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from preheat.checkpoint.jsonfile import read_config
from preheat.checkpoint.layout import read_manifest
from preheat.core.errors import ConfigError
from preheat.loader.load import load

Progress = Callable[[str, int, int], None]  # (stage: "read" (GGUF: 2 stages) | "write" | "verify", done, total bytes)
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Files copied from a Hugging Face source directory (config.json is rewritten from the parsed config instead).
TOKENIZER_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class SourceModel:
    """A model read into memory (tensors may be lazy views of mapped files), with its config and side files."""

    tensors: Mapping[str, torch.Tensor]
    config: dict[str, object]
    files: dict[str, bytes]
    format: str


def read_source(source: str, *, progress: Progress | None = None) -> SourceModel:
    """Read ``source`` into memory: tensors, config and tokenizer files. Quantized preheat checkpoints are
    dequantized; pre-sharded ones are refused (convert from the unsharded original)."""
    from preheat.checkpoint.gguf import is_gguf, read_gguf

    if is_gguf(source):
        gguf = read_gguf(source, progress)  # its own stages: the metadata, then the dequantization (bytes each)
        return SourceModel(untie(gguf.tensors, gguf.config), gguf.config, gguf.files, "gguf")
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    manifest = read_manifest(source) if os.path.isdir(source) else None
    if manifest is not None and manifest.tp_world_size > 1:
        raise ConfigError(
            f"{source}: is pre-sharded for {manifest.tp_world_size} TP ranks; convert from the unsharded original"
        )
    tensors = load(
        source,
        dequantize=True,
        progress=None if progress is None else (lambda done, total: progress("read", done, total)),
    )
    config = read_config(folder)
    files = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as handle:
                files[name] = handle.read()
    return SourceModel(untie(dict(tensors), config), config, files, "preheat" if manifest else "safetensors")


def untie(tensors: dict[str, torch.Tensor], config: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """With ``tie_word_embeddings``, the output layer *is* the embedding: store it once (as Hugging Face does) and
    let the config say so, instead of writing the same bytes twice. A differing ``lm_head`` is kept."""
    if config.get("tie_word_embeddings") is True and EMBED in tensors and LM_HEAD in tensors:
        embed, head = tensors[EMBED], tensors[LM_HEAD]
        if embed.data_ptr() == head.data_ptr() or (embed.shape == head.shape and bool(torch.equal(embed, head))):
            return {k: v for k, v in tensors.items() if k != LM_HEAD}
    return tensors
