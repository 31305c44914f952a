"""Fixtures of the tests against the real engines: the root tests/conftest.py's (``store_url``, once ``fs://`` and
once Redis; ``redis_server``; ``own_redis``) serve them, shared with the blob store's own tests.

Here: the ``engine`` mark (engines.enginekit's ``needs_*``, declared in pyproject.toml), judged when a marked test
is about to set up, so the probe of an engine's native code runs only in a session that reaches such a test, and
before any fixture loads that code."""

from __future__ import annotations

import pytest

from engines.enginekit import why_not


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(name="engine"):
        reason = why_not(mark.args[0])
        if reason is not None:
            pytest.skip(reason)
