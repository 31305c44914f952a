"""preheat as a secondary tier of vLLM 0.33's KV offloading (``TieringOffloadingSpec``), scheduler side as vLLM's
own tiering tests drive it: vLLM builds the tier from its config, chunks written to the real CPU primary tier
cascade into preheat's store, are evicted from the primary, found by ``lookup`` and promoted back with identical
bytes; a restarted engine finds them; every fault is a miss or a failed job, never wrong bytes, never an
exception into vLLM."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engines.enginekit import needs_vllm_033
from kvchunks import tiny_tmpfs
from preheat.testing.redisserver import RedisServer

pytestmark = needs_vllm_033
CHUNK = 16 << 10  # bytes of one primary-tier chunk (one 16-token block of a tiny model)
SLOTS = 4  # chunks the CPU primary tier holds


@dataclass
class Engine:
    """One vLLM engine's offloading scheduler side: vLLM's TieringOffloadingManager, its CPU primary tier and
    preheat's tier, all built by vLLM from the connector's extra config."""

    spec: Any  # Any: vLLM's TieringOffloadingSpec
    manager: Any  # Any: vLLM's TieringOffloadingManager
    steps: int = 0

    @property
    def tier(self) -> Any:  # Any: preheat's PreheatTier
        return self.manager.secondary_tiers[0]

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.tier.store.stats.snapshot())

    def row(self, chunk_id: int) -> bytes:
        view = self.manager.primary_tier.get_kv_memoryview().cast("B")
        return bytes(view[chunk_id * CHUNK : (chunk_id + 1) * CHUNK])

    def step(self) -> None:
        """Let the tier finish its jobs, then end two scheduler steps (the first resets vLLM's once-per-step
        poll gate, the second polls the tier)."""
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.tier.drain_jobs()
        for _ in range(2):
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))

    def request(self) -> Any:  # Any: vLLM's ReqContext
        from vllm.v1.kv_offload.base import ReqContext

        self.steps += 1
        ctx = ReqContext(req_id=f"req-{self.steps}")
        self.manager.on_new_request(ctx)
        return ctx

    def write(self, keys: list[bytes], contents: dict[bytes, bytes]) -> None:
        """What the GPU worker does for a request: store ``keys`` in the primary tier with their contents, then
        vLLM cascades them to the secondary tier."""
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        view = self.manager.primary_tier.get_kv_memoryview().cast("B")
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            view[int(chunk) * CHUNK : (int(chunk) + 1) * CHUNK] = contents[key]
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.step()

    def read(self, keys: list[bytes]) -> list[bytes | None]:
        """What the scheduler does for a new request: look each key up (promoting from the secondary tier),
        wait for the promotions, and read the primary chunks the GPU would load. None for a miss."""
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self.request()
        found: list[bytes | None] = []
        for key in keys:
            result = self.manager.lookup(key, ctx)
            for _ in range(20):
                if result is not LookupResult.HIT_PENDING and result is not LookupResult.RETRY:
                    break
                self.step()
                result = self.manager.lookup(key, ctx)
            if result is not LookupResult.HIT:
                found.append(None)
                continue
            spec = self.manager.prepare_load([key], ctx)
            found.append(self.row(int(spec.chunk_ids[0])))
            self.manager.complete_load([key], ctx)
        self.manager.on_request_finished(ctx)
        return found

    def in_primary(self, key: bytes) -> bool:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        return self.manager.primary_tier.lookup(key, ReqContext(req_id="peek")) is LookupResult.HIT

    def close(self) -> None:
        self.manager.shutdown()


def engine(url: str, *, model: str = "org/tiny-model", **tier: Any) -> Engine:
    """An engine's offloading config (vLLM's own dataclasses) with preheat as its one secondary tier."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=CHUNK,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": SLOTS * CHUNK, "secondary_tiers": [
            {"type": "PreheatTier", "module_path": "preheat.integrations.vllm_offload", "url": url, **tier}]},
        engine_id=f"preheat-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )
    spec = TieringOffloadingSpec(config)
    return Engine(spec, spec.get_manager())


def keys(start: int, stop: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(f"block-{i}".encode().ljust(32, b"\0"), 0) for i in range(start, stop)]


def contents(ks: list[bytes]) -> dict[bytes, bytes]:
    return {k: os.urandom(CHUNK) for k in ks}


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    built: list[Engine] = []
    yield built
    for one in built:
        one.close()


def make(engines: list[Engine], url: str, **kwargs: Any) -> Engine:
    built = engine(url, **kwargs)
    engines.append(built)
    return built


def fill_and_evict(eng: Engine, first: list[bytes], data: dict[bytes, bytes]) -> None:
    """Store ``first`` (cascaded to preheat), then as many other chunks as the primary holds, evicting them."""
    eng.write(first, data)
    others = keys(1000, 1000 + SLOTS)
    eng.write(others, contents(others))
    assert not any(eng.in_primary(k) for k in first)


def test_vllm_builds_preheat_from_its_tier_config(tmp_path: Path, engines: list[Engine]) -> None:
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    eng = make(engines, f"fs://{tmp_path}")
    assert type(eng.tier).__name__ == "PreheatTier"
    assert isinstance(eng.tier, SecondaryTierManager)
    assert eng.tier.store.describe().startswith(f"fs://{tmp_path}#")


def test_chunks_cascade_are_evicted_and_come_back_identical(store_url: str, engines: list[Engine]) -> None:
    eng = make(engines, store_url)
    ks = keys(0, 3)
    data = contents(ks)
    fill_and_evict(eng, ks, data)
    assert eng.tier.store.exists_many([k.hex() for k in ks]) == [True] * 3
    assert eng.read(ks) == [data[k] for k in ks]  # promoted from preheat into the primary, bytes identical
    assert eng.stats["hits"] >= 3


def test_a_restarted_engine_finds_every_chunk(store_url: str, engines: list[Engine]) -> None:
    first = make(engines, store_url)
    ks = keys(0, 3)
    data = contents(ks)
    first.write(ks, data)
    first.close()
    engines.remove(first)
    restarted = make(engines, store_url)  # a new process: an empty primary tier
    assert not any(restarted.in_primary(k) for k in ks)
    assert restarted.read(ks) == [data[k] for k in ks]



def test_shutdown_lets_vllm_unmap_its_primary_tier(tmp_path: Path) -> None:
    eng = engine(f"fs://{tmp_path}")
    ks = keys(0, 2)
    eng.write(ks, contents(ks))
    region = eng.spec._scheduler_mmap  # vLLM keeps the mapping while any view of it is held
    eng.close()
    assert region.mmap_obj is None
    assert not eng.tier._worker.is_alive()

# -- faults --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_chunk_is_a_miss_never_wrong_bytes(tmp_path: Path, engines: list[Engine], how: str) -> None:
    from preheat.kv.store import storage_name

    eng = make(engines, f"fs://{tmp_path}")
    ks = keys(0, 2)
    data = contents(ks)
    fill_and_evict(eng, ks, data)
    path = Path(eng.tier.store.storage.path(storage_name(ks[0].hex())))
    blob = bytearray(path.read_bytes())
    if how == "flip":
        blob[len(blob) - 100] ^= 0x04
        path.write_bytes(bytes(blob))
    else:
        path.write_bytes(bytes(blob[: len(blob) // 2]))
    assert eng.read(ks) == [None, data[ks[1]]]
    assert eng.stats["corrupt"] == 1
    assert not path.exists()


def test_another_models_chunks_are_misses(tmp_path: Path, engines: list[Engine]) -> None:
    url = f"fs://{tmp_path}"
    eng = make(engines, url)
    ks = keys(0, 2)
    eng.write(ks, contents(ks))
    other = make(engines, url, model_identity="org/other-model@rev2")
    assert other.read(ks) == [None, None]
    assert other.tier.store.exists_many([k.hex() for k in ks]) == [False, False]


def test_redis_killed_mid_run_fails_jobs_not_vllm(own_redis: RedisServer, engines: list[Engine]) -> None:
    eng = make(engines, own_redis.url)
    ks = keys(0, 2)
    data = contents(ks)
    fill_and_evict(eng, ks, data)
    own_redis.stop()
    assert eng.read(ks) == [None, None]
    more = keys(10, 12)
    eng.write(more, contents(more))  # the cascade fails; vLLM's primary keeps them
    assert all(eng.in_primary(k) for k in more)
    assert eng.stats["errors"] >= 1


def test_a_quota_smaller_than_one_chunk_stores_nothing(tmp_path: Path, engines: list[Engine]) -> None:
    eng = make(engines, f"fs://{tmp_path}", max_bytes="8KiB")
    ks = keys(0, 2)
    fill_and_evict(eng, ks, contents(ks))
    assert eng.read(ks) == [None, None]
    assert eng.stats["refused"] >= 2


def test_a_full_disk_fails_cascades_not_vllm(tmp_path: Path, engines: list[Engine]) -> None:
    with tiny_tmpfs(tmp_path / "full", "48k") as mount:  # room for two 16 KiB chunks and their headers
        eng = make(engines, f"fs://{mount}")
        ks = keys(0, 4)
        data = contents(ks)
        eng.write(ks, data)  # four chunks cascade; the disk fills up after the first ones
        assert eng.stats["errors"] >= 1
        assert eng.tier.store.up  # a full disk is not a dead mount: lookups go on
        stored = eng.tier.store.exists_many([k.hex() for k in ks])
        assert stored[0]
        assert not all(stored)
        assert all(eng.in_primary(k) for k, ok in zip(ks, stored, strict=True) if not ok)  # vLLM keeps those
        assert not list(mount.rglob("*.tmp"))  # no partial file left behind
        restarted = make(engines, f"fs://{mount}")  # an empty primary: what reached the disk loads back
        assert restarted.read(ks) == [data[k] if ok else None for k, ok in zip(ks, stored, strict=True)]


def test_a_bad_tier_config_fails_at_start_up(tmp_path: Path) -> None:
    from preheat.core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown key"):
        engine(f"fs://{tmp_path}", root_dir="/tmp")
