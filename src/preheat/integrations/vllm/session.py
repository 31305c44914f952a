"""One weight load for an engine, on preheat's timeline: resolve (pull) → read → hand-off, vLLM-free.

The engine's side is one callable, ``hand_off(iterable of (name, tensor))``, which vLLM's loader passes as
``model.load_weights``; it is called only after every check passed, so an engine is never handed a tensor of a load
that fails. Stages (``preheat timeline FILE``): ``fetch`` (a remote source pulled into the node cache),
``weight_load`` (map or read, and the digest checks) and ``weight_handoff`` (the engine copying into its parameters,
which is when a mapping's pages are read), then the mark ``weights_ready``. On CUDA, and on the CPU with the
``bucket`` option, the weights are handed over in buckets instead (``bucketed.py``), with the same stages.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from preheat.core import durable
from preheat.core.timeline import Timeline
from preheat.integrations.vllm.bucketed import load_bucketed, uses_buckets
from preheat.integrations.vllm.options import LoadOptions
from preheat.integrations.vllm.resolve import resolve
from preheat.integrations.vllm.weights import prepare, read_bytes
from preheat.loader.buckets import HandOff

log = logging.getLogger("preheat.vllm")


@dataclass(frozen=True)
class Outcome:
    """What the hand-off returned (vLLM: the set of parameter names loaded), where the weights came from, and the
    seconds of each stage (``fetch`` only for a remote source)."""

    loaded: object
    path: str
    verified: bool
    tensors: int
    seconds: dict[str, float]


def timeline_path(path: str, rank: int, world_size: int) -> str:
    """Each TP rank writes its own file: ``load.json`` becomes ``load.rank1.json`` for rank 1 of 2.

    >>> timeline_path("/tmp/load.json", 1, 2)
    '/tmp/load.rank1.json'
    >>> timeline_path("/tmp/load.json", 0, 1)
    '/tmp/load.json'
    """
    if world_size == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def load_for_engine(
    model: str,
    options: LoadOptions,
    hand_off: HandOff,
    *,
    rank: int = 0,
    world_size: int = 1,
    model_weights: str = "",
    timeline: Timeline | None = None,
    device: str | torch.device = "cpu",
) -> Outcome:
    """Resolve MODEL's weights, load and check them, then hand them to the engine (whose parameters live on
    ``device``); the stages go on ``timeline`` (default ``Timeline.from_env()``) and, with ``options.timeline``, into
    that JSON file, also when the load fails (the failing stage's ``detail.error`` says why)."""
    timeline = timeline or Timeline.from_env()
    try:
        return _load(
            model,
            options,
            hand_off,
            rank=rank,
            world_size=world_size,
            model_weights=model_weights,
            timeline=timeline,
            device=torch.device(device),
        )
    finally:
        if options.timeline:
            path = timeline_path(options.timeline, rank, world_size)
            try:
                write_timeline(path, timeline)
            except OSError as exc:  # the timeline observes the load; it never fails one
                log.warning("preheat: cannot write the timeline to %s: %s", path, exc)


def _load(
    model: str,
    options: LoadOptions,
    hand_off: HandOff,
    *,
    rank: int,
    world_size: int,
    model_weights: str,
    timeline: Timeline,
    device: torch.device,
) -> Outcome:
    resolved = resolve(model, options, timeline, model_weights=model_weights)
    try:
        if uses_buckets(options, device):
            bucketed = load_bucketed(
                resolved.path, options, hand_off, device=device, rank=rank, world_size=world_size, timeline=timeline
            )
            loaded, verified, count = bucketed.loaded, bucketed.verified, bucketed.tensors
        else:
            loaded, verified, count = _load_mapped(
                resolved.path, options, hand_off, rank=rank, world_size=world_size, timeline=timeline
            )
    finally:
        resolved.close()
    timeline.mark("weights_ready")
    seconds = {
        s.name: s.end - s.start
        for s in timeline.stages()
        if s.name in ("fetch", "weight_load", "weight_handoff") and s.end is not None
    }
    log.info(
        "preheat: %d tensors from %s handed to the engine (%s)",
        count,
        resolved.path,
        "verified" if verified else "UNVERIFIED",
    )
    return Outcome(loaded, resolved.path, verified, count, seconds)


def _load_mapped(
    path: str, options: LoadOptions, hand_off: HandOff, *, rank: int, world_size: int, timeline: Timeline
) -> tuple[object, bool, int]:
    """The mapping (or one read of everything): checked whole, then handed over in one call."""
    before = read_bytes()
    with timeline.stage("weight_load", path=path, rank=rank, world_size=world_size) as stage:
        try:
            prepared = prepare(path, options, rank=rank, world_size=world_size)
        except Exception as exc:
            stage.detail["error"] = str(exc)
            raise
        report = prepared.tensors.report
        stage.nbytes = report.bytes
        stage.detail.update(
            mode=report.mode, verified=report.verified, verified_tensors=report.verified_tensors, notes=report.notes
        )
    with timeline.stage("weight_handoff", tensors=len(prepared.tensors)) as stage:
        try:
            loaded = hand_off(prepared.items())
        except Exception as exc:
            stage.detail["error"] = str(exc)
            raise
        finally:
            prepared.finish()
        after = read_bytes()
        if before is not None and after is not None:
            # Bytes this process read from storage for the load and hand-off: a TP rank's share of the pages.
            stage.detail["read_bytes"] = after - before
        stage.nbytes = report.bytes
    verified, count = report.verified, len(prepared.tensors)
    del prepared  # the engine holds copies now: let the mappings go
    return loaded, verified, count


def weights_for_engine(
    model: str, options: LoadOptions, *, rank: int = 0, world_size: int = 1, model_weights: str = ""
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of MODEL's weights, resolved, loaded and checked as for a first load (a mapping, whatever the
    ``bucket`` option: a reload hands the engine an iterator, and a bucket's views outlive no hand-off call), for an
    engine that pulls weights itself: vLLM's ``reload_weights`` (a level-2 wake). The mapping and the resolved source
    are let go when the iterator is exhausted or closed."""
    resolved = resolve(model, options, Timeline.from_env(), model_weights=model_weights)
    try:
        prepared = prepare(resolved.path, options, rank=rank, world_size=world_size)
        try:
            yield from prepared.items()
        finally:
            prepared.finish()
    finally:
        resolved.close()


def write_timeline(path: str, timeline: Timeline) -> None:
    """The timeline as ``preheat timeline`` reads it, written atomically (a reader never sees half a file)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    durable.write_file(path, json.dumps(timeline.to_dict(), indent=2).encode())
