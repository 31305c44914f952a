"""The engine-free parts of the LMCache connector, the SGLang HiCache backend and the vLLM offloading tier
(preheat.integrations.lmcache, .sglang, .vllm_offload): their settings, namespaces and keys. The engines themselves
are exercised in tests/engines/."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.core.errors import ConfigError
from preheat.integrations import lmcache, sglang, vllm_offload
from preheat.integrations.store_settings import StoreSettings


def test_importing_the_integrations_imports_no_engine() -> None:
    code = ("import sys, preheat.integrations.lmcache, preheat.integrations.sglang, preheat.integrations.vllm_offload; "
            "print(sorted(m for m in ('sglang', 'vllm', 'lmcache') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "[]"


# (module_path, class_name) exactly as users write them in each engine's configuration (docs/kv-store.md).
CONFIGURED = [
    ("preheat.integrations.lmcache", "PreheatConnector", "lmcache"),
    ("preheat.integrations.sglang", "PreheatHiCacheStorage", "sglang"),
    ("preheat.integrations.vllm_offload", "PreheatTier", "vllm"),
]


@pytest.mark.parametrize(("module_path", "class_name", "engine"), CONFIGURED)
def test_the_module_paths_engine_configs_name_still_reach_their_classes(
    module_path: str, class_name: str, engine: str
) -> None:
    # Without the engine installed, the engine's lookup of class_name gets as far as importing the engine's base
    # class: the name is wired to the builder, and a misspelt class name is an AttributeError as the engines expect.
    code = (f"import importlib; module = importlib.import_module({module_path!r})\n"
            f"try:\n    getattr(module, {class_name!r})\nexcept ModuleNotFoundError as exc:\n    print(exc.name)\n"
            f"print(hasattr(module, 'Nope'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    if importlib.util.find_spec(engine) is None:
        assert done.stdout.split() == [engine, "False"]
    else:
        assert done.stdout.split() == ["False"]


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


# -- namespaces keyed by what the weights are, not what they are called (issue 29) ----------------------------------
def namespaces_of(model: str, model_identity: str | None = None) -> list[str]:
    """The namespace ``model`` each engine's store is keyed by."""
    storage = hicache_config(model_name=model)
    lm = SimpleNamespace(model_name=model, kv_shape=(2, 1, 16, 2, 8), chunk_size=16, use_mla=False, world_size=1,
                         get_dtypes=lambda: ["torch.bfloat16"], get_shapes=lambda: [(2, 16, 8)])  # fmt: skip
    offload = offloading_config(True)
    offload.model.name = model
    return [
        lmcache.namespace_for(lm, SimpleNamespace(), model_identity).model,
        sglang.namespace_for(storage, StoreSettings(url="fs:///kv", model_identity=model_identity)).model,
        vllm_offload.namespace_for(offload, 4096, model_identity).model,
    ]


def test_engine_kv_namespaces_default_to_the_checkpoints_content_identity(kv_model: Path, tmp_path: Path) -> None:
    identity = json.loads((kv_model / MANIFEST_NAME).read_bytes())["identity"]
    assert namespaces_of(str(kv_model)) == [identity] * 3
    renamed = tmp_path / "another-name"
    shutil.copytree(kv_model, renamed)
    assert namespaces_of(str(renamed)) == [identity] * 3  # the same weights under another name: the same values
    assert namespaces_of(f"preheat://{identity}") == [identity] * 3
    assert namespaces_of(str(kv_model), model_identity="org/m@rev") == ["org/m@rev"] * 3  # the operator's word wins


def test_other_weights_under_the_same_name_get_their_own_namespace(kv_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(kv_model, model)
    before = namespaces_of(str(model))
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # fine-tuned, say: the last byte of the last tensor differs
    weights.write_bytes(bytes(data))
    (model / MANIFEST_NAME).write_bytes(build_manifest(str(model)).to_json())
    after = namespaces_of(str(model))
    assert after[0] != before[0]
    assert len(set(after)) == 1


def test_a_model_without_a_content_identity_is_keyed_by_name_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = tmp_path / "hf-snapshot"  # a directory without preheat.json: no identity to key by
    plain.mkdir()
    with caplog.at_level(logging.WARNING, logger="preheat.integrations"):
        assert namespaces_of(str(plain)) == [str(plain)] * 3
        assert namespaces_of("org/hub-model") == ["org/hub-model"] * 3
    warnings = [r.getMessage() for r in caplog.records if "no content identity" in r.getMessage()]
    assert len(warnings) == 2  # once per model, not once per engine or per call
    assert "model_identity" in warnings[0]
    assert "it has no preheat.json" in warnings[0]
    assert "it is not a checkpoint directory" in warnings[1]
