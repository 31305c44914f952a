"""Fixtures of the node cache's tests (the ``cache`` itself is tests/integration/conftest.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from origins import make_origin


@pytest.fixture
def hf_origin(tmp_path: Path) -> Path:
    """A Hugging Face directory without a ``preheat.json``: the origins whose files a resumed pull must pin."""
    return make_origin(tmp_path / "hf", manifest=False)
