"""A ``preheat convert --tp N`` checkpoint handed to vLLM rank by rank: each rank's slice, dressed as the full tensor.

vLLM's parameter loaders take a full tensor and cut their rank's part themselves: ``narrow`` along the split
dimension (rows of q/k/v/gate/up and of the vocabulary, columns of o/down), then a copy into the parameter, the fused
shards (qkv, gate_up) at their offsets. Rank r of a pre-sharded checkpoint maps only its own files, which hold exactly
those parts. So each split tensor is handed over as a ``RankShard``: the slice's own data, reporting the full tensor's
shape, whose ``narrow`` to the rank's range returns the slice itself (no copy, no byte of another rank's files).

vLLM cutting another way than preheat's plan (KV heads replicated over more ranks than there are heads, a vocabulary
padded to another block) would ask for rows the rank does not hold: ``check_engine_cut`` refuses those models before
anything is mapped, and ``narrow`` raises for any other range it was not made for, naming the tensor and both ranges,
so a wrong row is never copied into a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from preheat.checkpoint.manifest import Manifest, TensorRecord
from preheat.core.errors import CheckpointError, ConfigError

# vLLM pads the vocabulary to a multiple of this before splitting it over ranks (DEFAULT_VOCAB_PADDING_SIZE in
# vllm/model_executor/layers/vocab_parallel_embedding.py, 0.32 and 0.33); preheat cuts ceil(V / N)-row blocks.
VLLM_VOCAB_PADDING = 64


@dataclass(frozen=True)
class Split:
    """Where rank's slice sits in the full tensor: along ``dim``, from index ``start``; ``full`` is the whole shape."""

    dim: int
    start: int
    full: tuple[int, ...]


def rank_splits(manifest: Manifest, rank: int) -> dict[str, Split]:
    """For every tensor the manifest splits, rank ``rank``'s place in it (the ranks' slices laid end to end)."""
    by_name: dict[str, dict[int, TensorRecord]] = {}
    for record in manifest.tensors:
        if record.tp is not None and record.tp.dim is not None:
            by_name.setdefault(record.name, {})[record.tp.rank] = record
    splits: dict[str, Split] = {}
    for name, ranks in by_name.items():
        mine = ranks.get(rank)
        if mine is None or mine.tp is None or mine.tp.dim is None:
            continue
        dim = mine.tp.dim % len(mine.shape)
        start = sum(ranks[r].shape[dim] for r in range(rank) if r in ranks)
        total = sum(record.shape[dim] for record in ranks.values())
        splits[name] = Split(dim, start, (*mine.shape[:dim], total, *mine.shape[dim + 1 :]))
    return splits


def check_engine_cut(manifest: Manifest, world_size: int, path: str) -> None:
    """Refuse, before anything is mapped, a model whose vLLM layers cut other rows than ``preheat convert --tp``
    did: fewer KV heads than ranks (vLLM replicates a head over ranks; preheat's plan splits inside it), or a
    vocabulary vLLM pads to another block per rank than ceil(V / N)."""
    config = manifest.config
    fix = "convert the model without --tp (vLLM ranks then read only their own pages of the unsharded files)"
    kv_heads = config.get("num_key_value_heads", config.get("num_attention_heads"))
    if isinstance(kv_heads, int) and kv_heads % world_size:
        raise ConfigError(
            f"{path}: {kv_heads} KV heads do not split over {world_size} ranks: vLLM replicates them, while "
            f"`preheat convert --tp {world_size}` split inside them; {fix}"
        )
    vocab = config.get("vocab_size")
    if isinstance(vocab, int):
        padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        if padded % world_size or padded // world_size != math.ceil(vocab / world_size):
            raise ConfigError(
                f"{path}: vLLM splits the {vocab}-token vocabulary (padded to {padded}) in blocks of "
                f"{padded // world_size} rows per rank, `preheat convert --tp {world_size}` in blocks of "
                f"{math.ceil(vocab / world_size)}; {fix}"
            )


class RankShard(torch.Tensor):
    """Rank's slice of a tensor that reports the full tensor's shape; ``narrow`` to the rank's range is the slice.

    Torch functions are not overridden (``__torch_function__`` disabled): any operation but ``narrow``/``shape``/
    ``size`` sees the slice as it is, so nothing can read past it."""

    # torch's stubs type the classmethod hook as a plain function; this is the value torch documents for disabling it.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _preheat_name: str
    _preheat_split: Split

    @staticmethod
    def wrap(name: str, tensor: torch.Tensor, split: Split) -> RankShard:
        if tuple(tensor.shape) != (*split.full[: split.dim], tensor.shape[split.dim], *split.full[split.dim + 1 :]):
            raise CheckpointError(f"tensor {name!r}: slice of shape {list(tensor.shape)} does not fit {split}")
        shard = tensor.as_subclass(RankShard)
        shard._preheat_name = name
        shard._preheat_split = split
        return shard

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]  # a property in torch's stubs too, typed as a method
        return torch.Size(self._preheat_split.full)

    def size(self, dim: int | None = None) -> Any:  # Any: torch.Size or int, as torch's
        full = torch.Size(self._preheat_split.full)
        return full if dim is None else full[dim]

    def narrow(self, dim: Any, start: Any, length: Any) -> torch.Tensor:  # Any: torch's own signature (SymInts)
        split = self._preheat_split
        held = torch.Tensor.size(self, split.dim)
        exact = isinstance(dim, int) and isinstance(start, int) and isinstance(length, int)
        if (
            exact
            and dim % len(split.full) == split.dim
            and split.start <= start
            and start + length <= split.start + held
        ):
            return self.as_subclass(torch.Tensor).narrow(dim, start - split.start, length)
        raise CheckpointError(
            f"tensor {self._preheat_name!r}: vLLM asked for [{start}, {start}+{length}) of dim {dim}, and this rank's "
            f"file holds [{split.start}, {split.start + held}) of dim {split.dim} (`preheat convert --tp` cut it "
            "otherwise than vLLM's layer does); convert the model without --tp",
            tensor=self._preheat_name,
        )


def dress(name: str, tensor: torch.Tensor, splits: Mapping[str, Split]) -> torch.Tensor:
    """``tensor`` as vLLM's loaders expect it: a ``RankShard`` when the checkpoint split it, else itself."""
    split = splits.get(name)
    return tensor if split is None else RankShard.wrap(name, tensor, split)
