"""preheat as SGLang 0.5.23's HiCache storage backend, built by SGLang's own ``StorageBackendFactory`` from a
``dynamic`` extra config over a real directory and a real Redis: host-pool pages round trip, ``batch_exists`` counts
the leading pages present, a restarted process finds every page, and every fault is a miss (never wrong bytes,
never an exception into HiCache)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.enginekit import needs_sglang
from engines.sglangkit import PAGE_BYTES, backend, dummy_page, key, page
from kvchunks import tiny_tmpfs
from preheat.testing.redisserver import RedisServer

pytestmark = needs_sglang
TESTS = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture
def backends() -> Iterator[list[Any]]:
    built: list[Any] = []
    yield built
    for one in built:
        one.close()


def make(backends: list[Any], url: str, **kwargs: Any) -> Any:
    built = backend(url, **kwargs)
    backends.append(built)
    return built


def same(a: Any, b: Any) -> bool:
    import torch

    return a is not None and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def test_sglang_builds_preheat_from_its_dynamic_config(tmp_path: Path, backends: list[Any]) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    store = make(backends, f"fs://{tmp_path}")
    assert type(store).__name__ == "PreheatHiCacheStorage"
    assert isinstance(store, HiCacheStorage)
    assert store.store.describe().startswith(f"fs://{tmp_path}#")


def test_pages_round_trip_and_batch_exists_counts_the_leading_pages(store_url: str, backends: list[Any]) -> None:
    store = make(backends, store_url)
    pages = [page(i) for i in range(4)]
    assert store.batch_exists([key(i) for i in range(4)]) == 0
    assert store.batch_set([key(i) for i in range(4)], pages)
    assert store.batch_exists([key(i) for i in range(4)]) == 4
    assert store.batch_exists([key(0), key(1), key(99), key(3)]) == 2  # a page is usable only after its prefix
    assert store.batch_exists([key(99), key(0)]) == 0
    assert store.exists(key(2))
    assert not store.exists(key(99))
    targets = [dummy_page() for _ in range(3)]
    got = store.batch_get([key(0), key(99), key(3)], targets)
    assert got[0] is targets[0]  # read into HiCache's own page tensor
    assert same(got[0], pages[0])
    assert got[1] is None
    assert same(got[2], pages[3])
    assert same(store.get(key(1), dummy_page()), pages[1])
    assert store.set(key(5), page(5))
    assert same(store.get(key(5), dummy_page()), page(5))


def test_a_page_of_another_size_is_a_miss(tmp_path: Path, backends: list[Any]) -> None:
    import torch

    store = make(backends, f"fs://{tmp_path}")
    assert store.set(key(0), page(0))
    assert store.get(key(0), torch.zeros(PAGE_BYTES // 4, dtype=torch.bfloat16)) is None


def test_the_zero_copy_interface_is_refused_not_half_implemented(tmp_path: Path) -> None:
    from preheat.core.errors import ConfigError

    with pytest.raises(ConfigError, match="v1"):
        backend(f"fs://{tmp_path}", interface_v1=1)


WRITER = """
import sys
from engines.sglangkit import backend, key, page
store = backend(sys.argv[1])
assert store.batch_set([key(i) for i in range(int(sys.argv[2]))], [page(i) for i in range(int(sys.argv[2]))])
store.close()
print("written")
"""

READER = """
import sys, torch
from engines.sglangkit import backend, dummy_page, key, page
store = backend(sys.argv[1])
n = int(sys.argv[2])
found = store.batch_exists([key(i) for i in range(n)])
got = store.batch_get([key(i) for i in range(n)], [dummy_page() for _ in range(n)])
same = sum(g is not None and torch.equal(g.view(torch.uint8), page(i).view(torch.uint8)) for i, g in enumerate(got))
store.close()
print(found, same)
"""


def python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": TESTS}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_restarted_process_finds_every_page(store_url: str) -> None:
    assert python(WRITER, store_url, "12") == "written"  # this process exits: nothing of it stays in memory
    assert python(READER, store_url, "12") == "12 12"


# -- faults --------------------------------------------------------------------------------------------------------


def stored_file(store: Any, k: str) -> Path:
    from preheat.kv.store import storage_name

    return Path(store.store.storage.path(storage_name(k)))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_page_is_a_miss_and_removed(tmp_path: Path, backends: list[Any], how: str) -> None:
    store = make(backends, f"fs://{tmp_path}")
    assert store.batch_set([key(0), key(1)], [page(0), page(1)])
    path = stored_file(store, key(0))
    blob = bytearray(path.read_bytes())
    if how == "flip":
        blob[len(blob) - 500] ^= 0x20
        path.write_bytes(bytes(blob))
    else:
        path.write_bytes(bytes(blob[: len(blob) // 2]))
    got = store.batch_get([key(0), key(1)], [dummy_page(), dummy_page()])
    assert got[0] is None
    assert same(got[1], page(1))
    assert store.store.stats.snapshot()["corrupt"] == 1
    assert not path.exists()
    assert store.batch_exists([key(0), key(1)]) == 0  # gone: HiCache recomputes the prefix and stores it again
    assert store.set(key(0), page(0))
    assert same(store.get(key(0), dummy_page()), page(0))


def test_another_models_or_ranks_pages_are_misses(tmp_path: Path, backends: list[Any]) -> None:
    url = f"fs://{tmp_path}"
    store = make(backends, url)
    assert store.batch_set([key(0)], [page(0)])
    for other in (make(backends, url, model="org/other-model"), make(backends, url, model_identity="org/m@rev2"),
                  make(backends, url, tp_rank=1, tp_size=2)):
        assert other.batch_exists([key(0)]) == 0
        assert other.get(key(0), dummy_page()) is None
    # A page copied into another namespace's directory under the same key is refused, not served.
    renamed = backends[-3]
    target = stored_file(renamed, key(0))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(stored_file(store, key(0)).read_bytes())
    assert renamed.batch_exists([key(0)]) == 1  # exists does not read: the get that follows verifies
    assert renamed.get(key(0), dummy_page()) is None
    assert renamed.store.stats.snapshot()["corrupt"] == 1


def test_redis_killed_mid_run_is_a_miss_not_an_exception(own_redis: RedisServer, backends: list[Any]) -> None:
    store = make(backends, own_redis.url)
    assert store.batch_set([key(0)], [page(0)])
    own_redis.stop()
    assert store.batch_get([key(0)], [dummy_page()]) == [None]
    assert store.batch_exists([key(0)]) == 0
    assert not store.batch_set([key(1)], [page(1)])
    assert store.store.stats.snapshot()["errors"] >= 1


def test_a_quota_smaller_than_one_page_stores_nothing(tmp_path: Path, backends: list[Any]) -> None:
    store = make(backends, f"fs://{tmp_path}", max_bytes="8KiB")  # a page is 16 KiB
    assert not store.batch_set([key(0)], [page(0)])
    assert store.batch_exists([key(0)]) == 0
    assert store.get(key(0), dummy_page()) is None
    assert store.store.stats.snapshot()["refused"] == 1


def test_a_full_disk_is_a_failed_set_never_an_exception(tmp_path: Path, backends: list[Any]) -> None:
    with tiny_tmpfs(tmp_path / "full", "64k") as mount:  # room for three 16 KiB pages and their headers
        store = make(backends, f"fs://{mount}")
        stored = [store.batch_set([key(i)], [page(i)]) for i in range(6)]
        assert stored[0]
        assert not all(stored)  # the disk filled up: HiCache is told, nothing raised
        assert store.store.stats.snapshot()["errors"] >= 1
        assert store.store.up  # a full disk is not a dead mount: reads go on
        assert store.batch_exists([key(i) for i in range(6)]) == stored.index(False)
        got = store.batch_get([key(i) for i in range(6)], [dummy_page() for _ in range(6)])
        for i, ok in enumerate(stored):
            assert same(got[i], page(i)) if ok else got[i] is None
        assert not list(mount.rglob("*.tmp"))  # no partial file left behind


def test_clear_removes_this_namespace_only(tmp_path: Path, backends: list[Any]) -> None:
    url = f"fs://{tmp_path}"
    store, other = make(backends, url), make(backends, url, model="org/other-model")
    assert store.batch_set([key(0), key(1)], [page(0), page(1)])
    assert other.batch_set([key(0)], [page(0)])
    assert store.clear()
    assert store.batch_exists([key(0), key(1)]) == 0
    assert other.batch_exists([key(0)]) == 1


def test_strided_pages_are_stored_and_read_back_as_their_values(tmp_path: Path, backends: list[Any]) -> None:
    # HiCache hands over flat contiguous pages, read and written in place; any other tensor (a strided view, a
    # slice of a larger buffer) is copied through a contiguous one, and holds the same values.
    import torch

    store = make(backends, f"fs://{tmp_path}")
    strided = torch.stack([page(7), page(8)], dim=1)[:, 0]  # page(7)'s values, every other element of a buffer
    assert not strided.is_contiguous()
    assert store.set(key(7), strided)
    assert same(store.get(key(7), dummy_page()), page(7))
    target = torch.zeros(2 * dummy_page().numel(), dtype=torch.bfloat16)[::2]
    assert store.get(key(7), target) is target  # read into the caller's own (strided) tensor
    assert same(target.contiguous(), page(7))
    window = torch.zeros(3 * dummy_page().numel(), dtype=torch.bfloat16)[dummy_page().numel():2 * dummy_page().numel()]
    assert store.get(key(7), window) is window  # a contiguous slice of a larger buffer: read straight into it
    assert same(window, page(7))


def test_a_batch_spread_over_io_threads_fills_each_target_with_its_page(tmp_path: Path, backends: list[Any]) -> None:
    # 136 pages of 16 KiB: past fanout.MIN_BYTES, so the store reads and writes them on two threads
    store = make(backends, f"fs://{tmp_path}", io_threads=2)
    keys = [key(i) for i in range(136)]
    pages = [page(i) for i in range(136)]
    assert store.batch_set(keys, pages)
    path = stored_file(store, keys[77])
    blob = bytearray(path.read_bytes())
    blob[len(blob) - 100] ^= 0x01
    path.write_bytes(bytes(blob))
    targets = [dummy_page() for _ in keys]
    got = store.batch_get(keys, targets)
    assert [g is None for g in got] == [i == 77 for i in range(136)]  # the damaged page alone is a miss
    assert all(got[i] is targets[i] and same(got[i], pages[i]) for i in range(136) if i != 77)
    assert store.store.stats.snapshot()["corrupt"] == 1


def test_a_target_that_is_no_tensor_is_a_miss_not_an_exception(tmp_path: Path, backends: list[Any]) -> None:
    store = make(backends, f"fs://{tmp_path}")
    assert store.batch_set([key(0), key(1)], [page(0), page(1)])
    got = store.batch_get([key(0), key(1)], [object(), dummy_page()])
    assert got[0] is None
    assert same(got[1], page(1))
