"""``--load-format preheat`` with buckets: the rank's weights read into device (CUDA) or private (CPU) memory one
bucket at a time (``preheat.loader.buckets``), each bucket handed to vLLM's ``model.load_weights`` and freed once
vLLM copied it. vLLM-free: the engine's side is the ``hand_off`` callable.

On CUDA this is the default (vLLM's copies are then device-to-device, and the extra device memory is one bucket); on
the CPU it replaces the mapping when ``bucket`` is set. ``model.load_weights`` is called once per bucket, as vLLM's
own layerwise reload calls it per layer. The two stages go on the timeline as with the mapping: ``weight_load``
(allocations, reads and digest checks, summed over the buckets) then ``weight_handoff`` (vLLM's copies and the
frees, summed); the reads and the copies alternate bucket by bucket, and the bucket report is in the detail.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from preheat.checkpoint.layout import read_manifest
from preheat.core.errors import ConfigError
from preheat.core.timeline import Timeline
from preheat.integrations.vllm.options import LOAD_FORMAT, LoadOptions
from preheat.integrations.vllm.sharded import Split, check_engine_cut, dress, rank_splits
from preheat.integrations.vllm.weights import check_presharded_world, read_bytes
from preheat.loader.buckets import DEFAULT_BUCKET_BYTES, HandOff, handoff_in_buckets


@dataclass(frozen=True)
class BucketedLoad:
    """What the engine's hand-offs returned (the union of vLLM's loaded names), and the load's check."""

    loaded: object
    verified: bool
    tensors: int


def uses_buckets(options: LoadOptions, device: torch.device) -> bool:
    """Buckets on CUDA always, on the CPU when a bucket size was asked for (else the mapping, which costs nothing
    extra there: vLLM copies straight from the page cache)."""
    return device.type == "cuda" or options.bucket is not None


def load_bucketed(
    path: str,
    options: LoadOptions,
    hand_off: HandOff,
    *,
    device: torch.device,
    rank: int,
    world_size: int,
    timeline: Timeline,
) -> BucketedLoad:
    """Hand the checkpoint at ``path`` to ``hand_off`` in buckets on ``device``; raises before any bucket whose
    tensors do not match their digests is handed over (``CheckpointError``), and ``ConfigError`` for what buckets
    cannot serve (a quantized preheat checkpoint, which is restored from weight and scale together)."""
    manifest = read_manifest(path)
    splits: dict[str, Split] = {}
    part_rank, parts = 0, 1  # unsharded: every rank is handed full tensors, and vLLM's loaders narrow them
    if manifest is not None and manifest.tp_world_size > 1:
        check_presharded_world(path, manifest.tp_world_size, world_size)
        check_engine_cut(manifest, world_size, path)
        splits, part_rank, parts = rank_splits(manifest, rank), rank, world_size
    if manifest is not None and any(t.quant is not None for t in manifest.tensors):
        raise ConfigError(
            f"{path} is quantized by `preheat convert --dtype`: its weights are restored from each weight and its "
            f"scale together, which buckets may separate: serve it on the CPU without `bucket` in --load-format "
            f"{LOAD_FORMAT}'s options, or convert the model without --dtype"
        )
    handed = 0

    def counted(weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        nonlocal handed
        handed += 1
        if splits:
            weights = ((name, dress(name, tensor, splits)) for name, tensor in weights)
        return hand_off(weights)

    mode = "auto" if options.mode in ("auto", "mmap") else options.mode
    before = read_bytes()
    started = timeline.now()
    try:
        report = handoff_in_buckets(
            path,
            counted,
            device=device,
            bucket_bytes=options.bucket or DEFAULT_BUCKET_BYTES,
            threads=options.threads,
            verify=options.verify,
            rank=part_rank,
            world_size=parts,
            mode=mode,
        )
    except Exception as exc:
        timeline.add(
            "weight_load", started, timeline.now(), path=path, rank=rank, world_size=world_size, error=str(exc),
            buckets_handed=handed,
        )  # fmt: skip
        raise
    ended = timeline.now()
    split = min(ended, started + report.plan_seconds + report.read_seconds)
    after = read_bytes()
    timeline.add(
        "weight_load",
        started,
        split,
        nbytes=report.bytes,
        path=path,
        rank=rank,
        world_size=world_size,
        mode=f"bucketed {report.mode}",
        verified=report.verified,
        verified_tensors=report.verified_tensors,
        notes=report.notes,
        bucket=report.to_dict(),
    )
    # Bytes this process read from storage for the load (None where /proc/self/io is missing).
    read = after - before if before is not None and after is not None else None
    timeline.add(
        "weight_handoff", split, ended, nbytes=report.bytes, tensors=report.tensors, buckets=report.buckets,
        read_bytes=read,
    )  # fmt: skip
    return BucketedLoad(report.loaded, report.verified, report.tensors)
