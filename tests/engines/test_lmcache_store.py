"""preheat as LMCache 0.5.6's remote storage, built by LMCache's own ``ConnectorManager("plugin://preheat", ...)``
over a real directory and a real Redis: real memory objects round trip, two processes share one store, a restarted
process finds every entry, and every fault is a miss (never wrong bytes, never an exception into LMCache)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.enginekit import needs_lmcache
from engines.lmcachekit import KV_SHAPE, Side, key, side
from kvchunks import tiny_tmpfs
from preheat.testing.redisserver import RedisServer

pytestmark = needs_lmcache
TESTS = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture
def sides() -> Iterator[list[Side]]:
    """LMCache sides built by a test, closed after it."""
    built: list[Side] = []
    yield built
    for one in built:
        one.close()


def make(sides: list[Side], url: str, *, kv_shape: tuple[int, ...] = KV_SHAPE, **extra: str) -> Side:
    built = side(url, kv_shape=kv_shape, **extra)
    sides.append(built)
    return built


def same(a: Any, b: Any) -> bool:  # Any: LMCache's MemoryObj
    import torch

    return bool(torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)))


def test_lmcache_builds_preheat_from_its_plugin_config(tmp_path: Path, sides: list[Side]) -> None:
    lm = make(sides, f"fs://{tmp_path}")
    assert type(lm.connector).__name__ == "PreheatConnector"
    assert lm.connector.store.describe().startswith(f"fs://{tmp_path}#")


def test_memory_objects_round_trip(store_url: str, sides: list[Side]) -> None:

    lm = make(sides, store_url)
    conn = lm.connector
    full, partial = lm.memory_obj(1), lm.memory_obj(2, tokens=100)
    assert not lm.run(conn.exists(key(0)))
    lm.run(conn.put(key(0), full))
    lm.run(conn.put(key(1), partial))
    assert lm.run(conn.exists(key(0)))
    assert conn.exists_sync(key(1))
    for k, sent in ((key(0), full), (key(1), partial)):
        got = lm.run(conn.get(k))
        assert got is not None
        assert got.get_shapes() == sent.get_shapes()
        assert got.get_dtypes() == sent.get_dtypes()
        assert same(got, sent)
        got.ref_count_down()
    assert sorted(lm.run(conn.list())) == sorted([key(0).to_string(), key(1).to_string()])
    assert conn.batched_contains([key(0), key(1), key(2), key(0)]) == 2
    assert lm.run(conn.get(key(5))) is None
    assert conn.remove_sync(key(0))
    assert not conn.exists_sync(key(0))
    full.ref_count_down()
    partial.ref_count_down()


WRITER = """
import sys
from engines.lmcachekit import key, side
lm = side(sys.argv[1])
for i in range(int(sys.argv[2]), int(sys.argv[3])):
    obj = lm.memory_obj(i)
    lm.run(lm.connector.put(key(i), obj))
    obj.ref_count_down()
lm.close()
print("written")
"""

READER = """
import sys, torch
from engines.lmcachekit import key, side
lm = side(sys.argv[1])
found = 0
for i in range(int(sys.argv[2])):
    got = lm.run(lm.connector.get(key(i)))
    if got is not None:
        want = lm.memory_obj(i)
        found += torch.equal(got.tensor.view(torch.uint8), want.tensor.view(torch.uint8))
        got.ref_count_down(); want.ref_count_down()
lm.close()
print(found)
"""


def python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": TESTS}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_restarted_process_finds_every_entry(store_url: str) -> None:
    assert python(WRITER, store_url, "0", "12") == "written"  # this process exits: nothing of it stays in memory
    assert python(READER, store_url, "12") == "12"


def test_two_processes_share_one_fs_store(tmp_path: Path, sides: list[Side]) -> None:

    url = f"fs://{tmp_path}"
    lm = make(sides, url)
    for i in range(6):
        obj = lm.memory_obj(i)
        lm.run(lm.connector.put(key(i), obj))
        obj.ref_count_down()
    assert python(WRITER, url, "6", "12") == "written"  # the other process adds its own
    assert python(READER, url, "12") == "12"  # and a third reads both
    for i in range(12):
        got = lm.run(lm.connector.get(key(i)))
        assert got is not None
        got.ref_count_down()


# -- faults --------------------------------------------------------------------------------------------------------


def stored_file(lm: Side, k: Any) -> Path:  # Any: LMCache's CacheEngineKey
    from preheat.kv.store import storage_name

    store = lm.connector.store
    return Path(store.storage.path(storage_name(k.to_string())))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_value_is_a_miss_and_removed(tmp_path: Path, sides: list[Side], how: str) -> None:

    lm = make(sides, f"fs://{tmp_path}")
    obj = lm.memory_obj(1)
    lm.run(lm.connector.put(key(0), obj))
    path = stored_file(lm, key(0))
    blob = bytearray(path.read_bytes())
    if how == "flip":
        blob[len(blob) - 1000] ^= 0x10
        path.write_bytes(bytes(blob))
    else:
        path.write_bytes(bytes(blob[: len(blob) // 2]))
    assert lm.run(lm.connector.get(key(0))) is None
    assert not path.exists()
    assert lm.connector.store.stats.snapshot()["corrupt"] == 1
    lm.run(lm.connector.put(key(0), obj))  # recomputed and stored again
    got = lm.run(lm.connector.get(key(0)))
    assert got is not None
    assert same(got, obj)
    got.ref_count_down()
    obj.ref_count_down()


def test_a_damaged_metadata_header_is_a_miss(tmp_path: Path, sides: list[Side]) -> None:
    # LMCache's metadata (shapes, dtypes) is read before the value is verified, to allocate its memory object; a
    # flipped bit there must still end as a miss, with the memory object given back.
    from preheat.kv import chunkfile

    lm = make(sides, f"fs://{tmp_path}")
    obj = lm.memory_obj(1)
    lm.run(lm.connector.put(key(0), obj))
    path = stored_file(lm, key(0))
    blob = bytearray(path.read_bytes())
    payload_start = chunkfile.head_length(blob)
    blob[payload_start + 12] ^= 0x01  # inside the first shape dimension
    path.write_bytes(bytes(blob))
    assert lm.run(lm.connector.get(key(0))) is None
    assert not path.exists()
    assert lm.connector.store.stats.snapshot()["corrupt"] == 1
    obj.ref_count_down()


def test_another_models_values_are_misses(tmp_path: Path, sides: list[Side]) -> None:

    url = f"fs://{tmp_path}"
    lm = make(sides, url)
    obj = lm.memory_obj(1)
    lm.run(lm.connector.put(key(0), obj))
    renamed = make(sides, url, model_identity="org/other-model@rev2")  # same name, other weights: its own namespace
    assert not renamed.connector.exists_sync(key(0))
    assert renamed.run(renamed.connector.get(key(0))) is None
    reshaped = make(sides, url, kv_shape=(KV_SHAPE[0], 2, 256, 1, 128))  # another KV layout
    assert reshaped.run(reshaped.connector.get(key(0))) is None
    # A value copied into the other namespace's directory under the same key is refused, not served.
    target = stored_file(renamed, key(0))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(stored_file(lm, key(0)).read_bytes())
    assert renamed.run(renamed.connector.get(key(0))) is None
    assert renamed.connector.store.stats.snapshot()["corrupt"] == 1
    obj.ref_count_down()


def test_redis_killed_mid_run_is_a_miss_not_an_exception(own_redis: RedisServer, sides: list[Side]) -> None:

    lm = make(sides, own_redis.url)
    obj = lm.memory_obj(1)
    lm.run(lm.connector.put(key(0), obj))
    own_redis.stop()
    assert lm.run(lm.connector.get(key(0))) is None
    assert not lm.run(lm.connector.exists(key(0)))
    lm.run(lm.connector.put(key(1), obj))  # dropped, not raised
    assert lm.connector.store.stats.snapshot()["errors"] >= 1
    obj.ref_count_down()


def test_a_full_disk_and_a_tiny_quota_drop_puts(tmp_path: Path, sides: list[Side]) -> None:

    tiny = make(sides, f"fs://{tmp_path}", max_bytes="64KiB")  # smaller than one 256 KiB chunk
    obj = tiny.memory_obj(1)
    tiny.run(tiny.connector.put(key(0), obj))
    assert tiny.run(tiny.connector.get(key(0))) is None
    assert tiny.connector.store.stats.snapshot()["refused"] == 1
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(obj.ref_count_down)
        mount = cleanup.enter_context(tiny_tmpfs(tmp_path / "full", "600k"))
        full = make(sides, f"fs://{mount}")
        for i in range(4):  # the third does not fit
            full.run(full.connector.put(key(i), obj))
        assert full.connector.store.stats.snapshot()["errors"] >= 1
        got = full.run(full.connector.get(key(0)))
        assert got is not None
        assert same(got, obj)
        got.ref_count_down()


def test_warm_fills_lmcaches_cpu_backend_with_the_hottest_values(tmp_path: Path, sides: list[Side]) -> None:
    from preheat.integrations.lmcache import warm

    url = f"fs://{tmp_path}"
    assert python(WRITER, url, "0", "8") == "written"
    fresh = make(sides, url)  # a replica scaling up: nothing in its CPU backend
    assert not fresh.backend.contains(key(0))
    report = warm(fresh.connector, max_entries=5)
    assert report.loaded == 5
    held = [i for i in range(8) if fresh.backend.contains(key(i))]
    assert len(held) == 5
    got = fresh.backend.get_blocking(key(held[0]))
    want = fresh.memory_obj(held[0])
    assert same(got, want)
    got.ref_count_down()
    want.ref_count_down()
