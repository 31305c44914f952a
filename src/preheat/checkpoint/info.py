"""``preheat info``: what a preheat checkpoint is, from its manifest alone (no weights are read)."""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass

from preheat.checkpoint.manifest import Manifest
from preheat.checkpoint.verify import require_manifest

# Config keys worth showing a person deciding whether this is the model they meant.
_MODEL_KEYS = (
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class RankFiles:
    """The weights files one TP rank of a pre-sharded checkpoint loads."""

    rank: int
    files: list[str]
    bytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    """A summary of one checkpoint. ``tensors`` counts distinct names (a TP checkpoint lists each once per rank);
    ``elements`` counts the whole model's elements (split tensors summed over ranks, replicated ones once)."""

    path: str
    identity: str
    format_version: int
    size: int
    extra_size: int
    files: int
    extra_files: list[str]
    tensors: int
    elements: int
    dtypes: dict[str, int]
    tp_world_size: int
    tp_split: dict[str, int]
    ranks: list[RankFiles]
    quantization: dict[str, object] | None
    model: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready; the checkpoint's identity is under ``identity``."""
        return {
            "path": self.path,
            "identity": self.identity,
            "format_version": self.format_version,
            "size": self.size,
            "extra_size": self.extra_size,
            "files": self.files,
            "extra_files": self.extra_files,
            "tensors": self.tensors,
            "elements": self.elements,
            "dtypes": self.dtypes,
            "tp": {
                "world_size": self.tp_world_size,
                "split": self.tp_split,
                "ranks": [{"rank": r.rank, "files": r.files, "bytes": r.bytes} for r in self.ranks],
            },
            "quantization": self.quantization,
            "model": self.model,
        }


def checkpoint_info(directory: str | os.PathLike[str]) -> CheckpointInfo:
    """Summarize the preheat checkpoint in ``directory`` (``CheckpointError`` if it has no valid manifest)."""
    root = os.fspath(directory)
    return describe(require_manifest(root), root)


def describe(manifest: Manifest, path: str) -> CheckpointInfo:
    """The summary of ``manifest`` (pure)."""
    unique = {t.name: t for t in manifest.tensors}
    world = manifest.tp_world_size
    ranks = []
    if world > 1:
        for rank in range(world):
            files = manifest.files_for_rank(rank, world)
            ranks.append(RankFiles(rank, [f.name for f in files], sum(f.size for f in files)))
    split = Counter("replicated" if t.tp is None or t.tp.dim is None else f"dim {t.tp.dim}" for t in unique.values())
    infos = [t.quant for t in unique.values() if t.quant is not None]
    quantization: dict[str, object] | None = None
    if infos:
        quantization = {
            "method": ",".join(sorted({q.method for q in infos})),
            "tensors": len(infos),
            "compute_dtype": ",".join(sorted({q.compute_dtype for q in infos})),
        }
    elements = sum(
        math.prod(t.shape) for t in manifest.tensors if t.tp is None or t.tp.dim is not None or t.tp.rank == 0
    )
    return CheckpointInfo(
        path=path,
        identity=manifest.identity,
        format_version=manifest.format_version,
        size=manifest.total_bytes,
        extra_size=sum(f.size for f in manifest.extra_files),
        files=len(manifest.files),
        extra_files=[f.name for f in manifest.extra_files],
        tensors=len(unique),
        elements=elements,
        dtypes=dict(sorted(Counter(t.dtype for t in unique.values()).items())),
        tp_world_size=world,
        tp_split=dict(sorted(split.items())),
        ranks=ranks,
        quantization=quantization,
        model={k: manifest.config[k] for k in _MODEL_KEYS if k in manifest.config},
    )
