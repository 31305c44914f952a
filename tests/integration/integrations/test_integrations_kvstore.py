"""The engine-free parts of the LMCache connector, the SGLang HiCache backend and the vLLM offloading tier
(preheat.integrations.lmcache, .sglang, .vllm_offload): their settings, namespaces and keys. The engines themselves
are exercised in tests/engines/."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from preheat.core.errors import ConfigError
from preheat.integrations import lmcache, sglang, vllm_offload
from preheat.integrations.store_settings import StoreSettings


def test_importing_the_integrations_imports_no_engine() -> None:
    code = ("import sys, preheat.integrations.lmcache, preheat.integrations.sglang, preheat.integrations.vllm_offload; "
            "print(sorted(m for m in ('sglang', 'vllm', 'lmcache') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]"


def test_sglang_settings_read_preheats_keys_beside_sglangs() -> None:
    settings = sglang.settings_from({
        "backend_name": "preheat", "module_path": "preheat.integrations.sglang", "class_name": "X",
        "url": "redis://kv:6379/0", "ttl_s": "600", "model_identity": "org/m@rev"})
    assert (settings.url, settings.ttl_s, settings.model_identity) == ("redis://kv:6379/0", 600, "org/m@rev")


@pytest.mark.parametrize(("extra", "says"), [
    ({}, "url"),
    ({"url": "fs:///kv", "max_byte": "1GiB"}, "unknown key"),
    ({"url": "fs:///kv", "interface_v1": 1}, "v1"),
    ({"url": "fs:///kv", "ttl_s": "soon"}, "invalid literal"),
])
def test_sglang_settings_refuse_what_would_fail_later(extra: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        sglang.settings_from(extra)


def test_lmcache_settings_are_the_plugins_keys_read_as_every_engines() -> None:
    settings = lmcache.settings_from({
        "remote_storage_plugin.preheat.module_path": "preheat.integrations.lmcache",
        "remote_storage_plugin.preheat.class_name": "PreheatConnector",
        "remote_storage_plugin.preheat.url": "fs:///kv", "remote_storage_plugin.preheat.max_bytes": "1GiB",
        "remote_storage_plugin.other.url": "redis://elsewhere:6379/0", "chunk_size": 256})
    assert settings == StoreSettings(url="fs:///kv", max_bytes=1 << 30)
    with pytest.raises(ConfigError, match="url"):
        lmcache.settings_from({"remote_storage_plugin.other.url": "fs:///kv"})
    with pytest.raises(ConfigError, match="unknown key"):  # a typo is refused, not ignored
        lmcache.settings_from({"remote_storage_plugin.preheat.url": "fs:///kv",
                               "remote_storage_plugin.preheat.max_byte": "1GiB"})


def hicache_config(**changes: object) -> SimpleNamespace:
    """The fields of SGLang's HiCacheStorageConfig that the namespace reads."""
    fields: dict[str, object] = {"tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0,
                                 "attn_cp_size": 1, "dcp_rank": 0, "dcp_size": 1, "is_mla_model": False,
                                 "is_page_first_layout": False, "model_name": "org/model"}
    return SimpleNamespace(**{**fields, **changes})


def test_sglang_ranks_have_their_own_namespace_except_for_mla() -> None:
    settings = StoreSettings(url="fs:///kv")
    rank0, rank1 = (sglang.namespace_for(hicache_config(tp_rank=r), settings).id for r in (0, 1))
    assert rank0 != rank1
    mla0, mla1 = (sglang.namespace_for(hicache_config(tp_rank=r, is_mla_model=True), settings).id for r in (0, 1))
    assert mla0 == mla1  # MLA KV is the same on every TP rank
    page_first = sglang.namespace_for(hicache_config(is_page_first_layout=True), settings).id
    assert page_first != rank0


def test_sglang_host_pool_dtype_joins_the_namespace() -> None:
    settings = StoreSettings(url="fs:///kv")
    config = hicache_config()
    bf16 = SimpleNamespace(dtype="torch.bfloat16", page_size=64, layout="layer_first", layer_num=2, head_num=8,
                           head_dim=128)
    fp16 = SimpleNamespace(**{**vars(bf16), "dtype": "torch.float16"})
    ids = {sglang.namespace_for(config, settings, pool).id for pool in (None, bf16, fp16)}
    assert len(ids) == 3


def test_sglang_host_pool_facts_are_plain_json() -> None:
    import torch

    pool = SimpleNamespace(dtype=torch.bfloat16, page_size=64, layout="page_first", head_num=8)
    assert sglang.pool_layout(pool) == {"pool": "SimpleNamespace", "dtype": "bfloat16", "page_size": 64,
                                        "layout": "page_first", "head_num": 8}


def test_vllm_tier_settings_refuse_unknown_keys() -> None:
    def read(values: dict[str, object]) -> StoreSettings:
        return StoreSettings.from_mapping(values, where="vLLM secondary tier")

    assert read({"url": "fs:///kv", "max_bytes": "1GiB"}).max_bytes == 1 << 30
    with pytest.raises(ConfigError, match="unknown key"):
        read({"url": "fs:///kv", "root_dir": "/kv"})
    with pytest.raises(ConfigError, match="url"):
        read({})


def offloading_config(agnostic: bool, tp: int = 1, dtype: str = "bfloat16") -> SimpleNamespace:
    """The fields of vLLM's OffloadingConfig that the namespace reads."""
    return SimpleNamespace(
        groups=(SimpleNamespace(tokens_per_block=16),), worker_kv_bytes_per_block=4096,
        model=SimpleNamespace(name="org/model", dtype=dtype),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=SimpleNamespace(is_parallelism_agnostic=agnostic, world_size=tp, tp_size=tp, pp_size=1,
                                 pcp_size=1, dcp_size=1),
        kv_cache_layout="NHD", canonical_layout=False, replicated_layout=False)


def test_vllm_parallelism_joins_the_namespace_unless_the_bytes_are_agnostic_of_it() -> None:
    ns = vllm_offload.namespace_for
    assert ns(offloading_config(True, tp=1), 4096).id == ns(offloading_config(True, tp=2), 4096).id
    assert ns(offloading_config(False, tp=1), 4096).id != ns(offloading_config(False, tp=2), 4096).id
    assert ns(offloading_config(True), 4096).id != ns(offloading_config(True, dtype="float16"), 4096).id
    assert ns(offloading_config(True), 4096, "org/model@rev").model == "org/model@rev"


def test_vllm_offload_keys_are_their_hex() -> None:
    key = bytes(range(32)) + (1).to_bytes(4, "big")
    assert vllm_offload.key_name(key) == key.hex()
    assert bytes.fromhex(vllm_offload.key_name(key)) == key
