"""Fixtures shared by the tests against the real engines (the root tests/conftest.py applies here too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from redisserver import RedisServer


@pytest.fixture(params=["fs", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A blob store URL, once a fresh ``fs://`` directory and once the session's real Redis, flushed."""
    if request.param == "fs":
        return f"fs://{tmp_path}"
    server: RedisServer = request.getfixturevalue("redis_server")
    import redis

    redis.Redis.from_url(server.url).flushdb()
    return server.url
