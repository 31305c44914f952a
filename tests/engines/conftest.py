"""Fixtures of the tests against the real engines: the root tests/conftest.py's (``store_url``, once ``fs://`` and
once Redis; ``redis_server``; ``own_redis``) serve them, shared with the blob store's own tests.

Here: the ``engine`` mark (engines.enginekit's ``needs_*``, declared in pyproject.toml), judged when a marked test
is about to set up, so the probe of an engine's native code runs only in a session that reaches such a test, and
before any fixture loads that code; and the wide model the tensor-parallel vLLM tests share (engines.vllmkit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.enginekit import why_not
from engines.vllmkit import write_vllm_tiny


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(name="engine"):
        reason = why_not(mark.args[0])
        if reason is not None:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 MB of float32 (hidden 2048, 32 heads, 2 KV heads; 8 KiB rows): o_proj/down_proj columns split on whole
    pages' worth of bytes per rank, and each rank's files of a ``--tp 2`` conversion are ~75 MB. Read-only."""
    return write_vllm_tiny(tmp_path_factory.mktemp("vllm-wide"), hidden=2048, intermediate=4096, layers=1)
