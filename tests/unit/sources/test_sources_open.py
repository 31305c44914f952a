"""The source picker (``preheat.sources.open``): one table by scheme, kept equal to the remote schemes preheat
streams from, each kind imported only when a location of its scheme is opened."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from preheat.core.errors import ConfigError
from preheat.sources.base import REMOTE_SCHEMES, is_uri
from preheat.sources.local import LocalOrigin
from preheat.sources.open import ORIGINS, open_origin


def test_the_table_holds_exactly_the_remote_schemes() -> None:
    assert {f"{scheme}://" for scheme in ORIGINS} == set(REMOTE_SCHEMES)
    assert all(is_uri(f"{scheme}://host/model") for scheme in ORIGINS)


@pytest.mark.parametrize("scheme", sorted(ORIGINS))
def test_every_scheme_names_an_origin_class(scheme: str) -> None:
    module, _, name = ORIGINS[scheme].partition(":")
    kind = getattr(importlib.import_module(module), name)
    assert isinstance(kind, type)
    assert all(callable(getattr(kind, method, None)) for method in ("open", "read_bytes"))


def test_a_location_without_a_known_scheme_is_a_local_directory(tmp_path: Path) -> None:
    assert isinstance(open_origin(str(tmp_path)), LocalOrigin)
    with pytest.raises(ConfigError, match="pulled from peers"):
        open_origin("preheat://smollm2")
