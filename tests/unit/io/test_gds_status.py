"""``gds_status`` never raises, whatever kvikio is installed: an H200 with kvikio-cu13 26.10 showed ``kvikio.defaults``
is no longer imported with the package, and the old code failed every ``mode="auto"`` CUDA load on it."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from preheat.io import gds


def _install(monkeypatch: pytest.MonkeyPatch, defaults: types.ModuleType | None) -> None:
    package = types.ModuleType("kvikio")
    package.__path__ = []  # a package, so that "kvikio.defaults" is looked up as its submodule
    package.__version__ = "26.10.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", package)
    if defaults is None:
        monkeypatch.delitem(sys.modules, "kvikio.defaults", raising=False)
    else:
        monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)  # importable, yet no attribute of the package
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_defaults_submodule_not_imported_by_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = types.ModuleType("kvikio.defaults")
    defaults.is_compat_mode_preferred = lambda: True  # type: ignore[attr-defined]
    _install(monkeypatch, defaults)
    status = gds.gds_status()
    assert status.available
    assert status.compat_mode
    assert "compatibility mode" in status.detail


def test_unusable_kvikio_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, None)  # no kvikio.defaults at all
    status = gds.gds_status()
    assert not status.available
    assert "kvikio 26.10.0 is not usable here" in status.detail
