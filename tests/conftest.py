"""The fixtures every folder of the suite shares: tiny real checkpoints (tests/checkpoints.py), the servable tiny
model, SmolLM2 (``preheat.testing.smollm2``) and real Redis servers (``preheat.testing.redisserver``).

Fixtures named ``*_checkpoint`` are shared by a whole session and must not be modified; ``fresh_checkpoint`` is a
private copy per test, for tests that truncate or rewrite files.

A fixture used by the tests of one folder only lives in that folder's conftest.py (tests/integration/conftest.py,
tests/integration/peer/conftest.py, ...); helpers that are not fixtures live in modules at tests/ top level, imported by
bare name. Nothing imports a conftest.py: pytest loads each under the one name ``conftest``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkpoints import WIDE, WrittenCheckpoint, write
from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.testing.redisserver import RedisServer
from preheat.testing.smollm2 import SmolLM2, cache_root
from preheat.testing.synthetic import make_tiny_servable_model


@pytest.fixture(scope="session")
def single_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """A Hugging Face directory with one ``model.safetensors`` (about 200 KiB of bf16)."""
    return write(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """The same model in three shards with ``model.safetensors.index.json``."""
    return write(tmp_path_factory.mktemp("sharded"), shards=3, seed=1)


@pytest.fixture(scope="session")
def unindexed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """A directory of ``*.safetensors`` shards with no index file."""
    written = write(tmp_path_factory.mktemp("unindexed"), shards=2, seed=2)
    os.remove(written.root / "model.safetensors.index.json")
    return written


@pytest.fixture(scope="session")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> WrittenCheckpoint:
    """Hidden size 1024 (about 11 MiB): large enough for page-level read accounting to be meaningful."""
    return write(tmp_path_factory.mktemp("wide"), WIDE, seed=3)


@pytest.fixture
def fresh_checkpoint(tmp_path: Path) -> WrittenCheckpoint:
    """A single-file checkpoint this test may truncate or overwrite."""
    return write(tmp_path / "model")


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2:
    """SmolLM2-135M-Instruct converted per dtype (``smollm2.path("int8")``), cached across runs
    (``preheat.testing.smollm2``)."""
    return SmolLM2(cache_root())


@pytest.fixture(scope="session")
def tiny_servable_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama with a real byte-level tokenizer, chat template and EOS (``make_tiny_servable_model``):
    what the engine and server tests serve. Shared by the session: copy it before changing any file."""
    return make_tiny_servable_model(tmp_path_factory.mktemp("servable"))


@pytest.fixture(scope="session")
def kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny servable model with a ``preheat.json`` manifest, so it has the identity KV L2 tiers require."""
    root = make_tiny_servable_model(tmp_path_factory.mktemp("kv-model"))
    (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real ``redis-server`` for the session (tests use their own key prefixes or flush it)."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(params=["fs", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A KV store URL, once a fresh ``fs://`` directory and once the session's real Redis, flushed."""
    if request.param == "fs":
        return f"fs://{tmp_path}"
    server: RedisServer = request.getfixturevalue("redis_server")
    import redis

    redis.Redis.from_url(server.url).flushdb()
    return server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A ``redis-server`` of this test alone, which it may kill and restart."""
    server = RedisServer()
    yield server
    server.stop()
