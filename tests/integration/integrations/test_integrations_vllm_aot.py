"""preheat's plugin lets vLLM load back the AOT function it saved with torch's Inductor backend (a CPU build's).

vLLM calls ``finalize_loading`` on what ``torch.compiler.load_compiled_function`` returns; only vLLM's own
serializable function has it. The real load through vLLM runs in tests/engines/test_vllm_artifacts.py (0 AOT
functions loaded without the plugin's wrap, 1 with it); here torch's loader is wrapped for real and what it returns
is a stand-in of torch's loaded function (the foreign object's two attributes vLLM touches).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.compiler

from preheat.integrations.vllm import aot


def loaded(compiled: object) -> SimpleNamespace:
    return SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled))


class VllmSerializable:
    """vLLM's own kind: it finalizes itself (rebuilds its piecewise backend) and must keep doing so."""

    def __init__(self) -> None:
        self.finalized: list[object] = []

    def finalize_loading(self, vllm_config: object) -> None:
        self.finalized.append(vllm_config)


@pytest.fixture
def torch_loader(monkeypatch: pytest.MonkeyPatch) -> list[Any]:  # Any: what the stand-in loader returns
    """torch's loader replaced by one returning the queued objects; monkeypatch restores torch's own afterwards."""
    queue: list[Any] = []
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda *a, **k: queue.pop(0))
    monkeypatch.delenv("PREHEAT_VLLM_AOT_LOAD", raising=False)
    return queue


def test_an_inductor_function_loads_with_a_finalize_loading_that_does_nothing(torch_loader: list[Any]) -> None:
    def compiled(*args: object) -> str:
        return "ran"

    torch_loader.append(loaded(compiled))
    assert aot.install()
    load: Any = torch.compiler.load_compiled_function  # Any: the wrap around the stand-in
    fn = load(None)
    fn._artifacts.compiled_fn.finalize_loading(object())  # what vLLM calls: no AttributeError any more
    assert fn._artifacts.compiled_fn() == "ran"


def test_vllms_own_function_keeps_its_finalize_loading(torch_loader: list[Any]) -> None:
    own = VllmSerializable()
    torch_loader.append(loaded(own))
    aot.install()
    config = object()
    load: Any = torch.compiler.load_compiled_function  # Any: the wrap around the stand-in
    load(None)._artifacts.compiled_fn.finalize_loading(config)
    assert own.finalized == [config]


def test_install_wraps_once_and_not_at_all_when_turned_off(
    torch_loader: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREHEAT_VLLM_AOT_LOAD", "0")
    before = torch.compiler.load_compiled_function
    assert not aot.install()
    assert torch.compiler.load_compiled_function is before
    monkeypatch.setenv("PREHEAT_VLLM_AOT_LOAD", "1")
    assert aot.install()
    wrapped = torch.compiler.load_compiled_function
    assert not aot.install()  # a second register() in the same process
    assert torch.compiler.load_compiled_function is wrapped
