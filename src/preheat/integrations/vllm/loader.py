"""The vLLM model loader behind ``--load-format preheat``. Imports vLLM: only ``register()`` imports this module.

vLLM builds the model skeleton (``BaseModelLoader.load_model``), then calls ``load_weights(model, model_config)``;
there the weights are resolved, loaded and checked by ``session.load_for_engine`` and handed to vLLM's own
``model.load_weights``, whose parameter loaders shard them for this rank: on CUDA in device buckets, on the CPU as a
mapping (or in private buckets with the ``bucket`` option).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import vllm
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from preheat.core.errors import CheckpointError
from preheat.core.timeline import Timeline
from preheat.integrations.vllm import startup
from preheat.integrations.vllm.options import check_vllm_version, parse_options
from preheat.integrations.vllm.resolve import resolve
from preheat.integrations.vllm.session import load_for_engine, weights_for_engine

# Under "vllm.": vLLM configures its handler on the "vllm" logger only, so a logger outside it prints nothing.
logger = init_logger("vllm.model_executor.model_loader.preheat")


class PreheatModelLoader(BaseModelLoader):  # type: ignore[misc]  # vLLM is untyped (Any) in .venv's mypy
    """``--load-format preheat``: options from ``--model-loader-extra-config`` and ``PREHEAT_*`` (checked here, when
    vLLM builds the loader, so a bad option fails before any model is built)."""

    def __init__(self, load_config: LoadConfig) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(load_config)
        self.options = parse_options(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Pull a remote source into the node cache (vLLM's engine never calls this; ``load_weights`` pulls too)."""
        resolve(model_config.model, self.options, Timeline.from_env(), model_weights=_weights_uri(model_config)).close()

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """What vLLM's ``reload_weights`` asks a loader for (a level-2 wake: the weights were discarded): every
        tensor, resolved and checked as for the first load; without this method vLLM refuses to reload."""
        rank, world_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        yield from weights_for_engine(
            model_config.model, self.options, rank=rank, world_size=world_size, model_weights=_weights_uri(model_config)
        )

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        rank, world_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

        def hand_off(weights: Iterable[tuple[str, torch.Tensor]]) -> object:
            # nn.Module.__getattr__ types attributes as Tensor | Module; every vLLM model defines load_weights.
            return model.load_weights(weights)  # type: ignore[operator]

        timeline = Timeline.from_env()
        outcome = load_for_engine(
            model_config.model,
            self.options,
            hand_off,
            rank=rank,
            world_size=world_size,
            model_weights=_weights_uri(model_config),
            timeline=timeline,
            device=_device(model),
        )
        _on_startup_timeline(timeline)
        took = outcome.seconds.get("weight_load", 0.0) + outcome.seconds.get("weight_handoff", 0.0)
        # The line vLLM's own loaders print, so logs and benchmarks compare like with like (a pull is not in it).
        logger.info(
            "Loading weights took %.2f seconds (preheat: read %.2f s, hand-off %.2f s, fetch %.2f s, %s)",
            took,
            outcome.seconds.get("weight_load", 0.0),
            outcome.seconds.get("weight_handoff", 0.0),
            outcome.seconds.get("fetch", 0.0),
            "verified" if outcome.verified else "unverified",
        )
        if isinstance(outcome.loaded, set) and model_config.quantization is None:
            # What vLLM's default loader checks too: a parameter nobody loaded would serve its random init.
            missing = sorted({name for name, _ in model.named_parameters()} - outcome.loaded)
            if missing:
                raise CheckpointError(
                    f"{outcome.path}: no weights for {len(missing)} parameter(s) of the model, e.g. {missing[0]!r}: "
                    "is this the checkpoint of MODEL's config.json?",
                    path=outcome.path,
                    tensor=missing[0],
                )


# The load's stages as they nest inside ``weight_load`` on vLLM's start-up timeline (startup.CATALOGUE).
_NESTED = {"fetch": "weights_fetch", "weight_load": "weights_read", "weight_handoff": "weights_handoff"}


def _on_startup_timeline(timeline: Timeline) -> None:
    recorder = startup.current()
    if recorder is None:
        return
    for stage in timeline.stages():
        name = _NESTED.get(stage.name)
        if name is not None and stage.end is not None:
            detail = {
                k: v
                for k, v in stage.detail.items()
                if k in ("cache", "mode", "verified", "read_bytes", "uri", "bucket")
            }
            start, end = timeline.origin + stage.start, timeline.origin + stage.end
            recorder.stage(name, start, end, nbytes=stage.nbytes, detail=detail)


def _device(model: nn.Module) -> torch.device:
    """Where vLLM built the model's parameters: CUDA gets the bucketed hand-off (docs/integrations.md)."""
    for parameter in model.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return torch.device("cpu")


def _weights_uri(model_config: ModelConfig) -> str:
    """vLLM's ``model_weights``: the ``s3://`` URI whose config.json vLLM fetched itself (runai-model-streamer)."""
    weights = getattr(model_config, "model_weights", "") or ""
    return weights if isinstance(weights, str) else ""
