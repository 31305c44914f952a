"""preheat's blob store as SGLang HiCache's L3 storage backend: checksummed pages, an index that survives restarts,
quotas and cross-process LRU behind SGLang's own ``HiCacheStorage`` interface (SGLang 0.5.23).

SGLang configuration::

    python -m sglang.launch_server --model-path org/model --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "preheat",
            "module_path": "preheat.integrations.sglang", "class_name": "PreheatHiCacheStorage",
            "url": "fs:///shared/kv", "max_bytes": "200GiB"}'

Optional keys beside ``url``: ``max_bytes`` (``fs://`` quota), ``ttl_s`` (Redis expiry after the last read),
``secret_file`` (fleet MAC, docs/kv-cache.md), ``model_identity`` (``repo@revision``; defaults to the
checkpoint's content identity, else SGLang's model name with a warning: ``store_settings.namespace_model``).
SGLang builds the backend itself (``StorageBackendFactory`` → ``cls(storage_config, kwargs)``). Each value is one
HiCache page as SGLang's host pool hands it over (its flat bytes), stored by ``preheat.kv.store`` under
SGLang's own page hash in a namespace of the model identity, the engine and the layout (TP/PP/CP/DCP rank and
size, MLA, page-first layout; and, once SGLang registers its host pool, the pool's dtype, page size, layout and KV
geometry), so another model's or another rank's pages never answer. A damaged page, a dead Redis, a full disk are
misses (logged, counted in ``store.stats``), never an exception into HiCache's I/O threads. On ``fs://`` a page is
read straight into the tensor HiCache allocates for it and verified there.

Implemented: ``get``/``set``/``exists``, ``batch_get``/``batch_set``, ``batch_exists`` (the leading run of pages
present, one stat or one Redis round trip per page batch), ``clear``. **Not** implemented, on purpose: the
zero-copy ``batch_get_v1``/``batch_set_v1`` (``"interface_v1": 1``; a backend that declares them and leaves one
out stops HiCache's prefetch thread silently, so the backend refuses that key) and the ``*_v2`` pool-transfer
methods that sidecar pools (Mamba, DSA, SWA state) need: models with those pools are not supported.

SGLang is imported only when ``PreheatHiCacheStorage`` is first looked up (SGLang's factory does that).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from preheat.core.errors import ConfigError
from preheat.integrations.store_settings import StoreSettings, namespace_model
from preheat.kv.blob_reads import exactly
from preheat.kv.store import DEFAULT_MAX_VALUE, BlobStore, Namespace

if TYPE_CHECKING:
    import torch

log = logging.getLogger("preheat.integrations.sglang")

ENGINE = "sglang-hicache"
SUPPORTED = ("0.5.23",)  # SGLang versions this module is tested against (tests/engines/test_sglang_hicache.py)
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_PAGE_MARGIN = 64 << 10  # bytes a stored page may exceed the host pool's page by before it is refused unread


# SGLang's objects as this module reads them (SGLang is not installed where preheat is type-checked, and these name
# only what is read here; what is getattr'd with a default is left out).
class StorageConfig(Protocol):
    """SGLang's ``HiCacheStorageConfig``: the rank's shard, the page layout, and preheat's extra config."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_mla_model: bool
    is_page_first_layout: bool
    model_name: str | None
    extra_config: Mapping[str, object] | None


class HostPool(Protocol):
    """SGLang's host KV pool (``HostKVCache``): its flat page bounds a stored page (a pool that cannot make one
    raises, and the default bound stays); its geometry is read by ``pool_layout`` with getattr."""

    def get_dummy_flat_data_page(self) -> torch.Tensor: ...


def settings_from(extra: Mapping[str, object] | None) -> StoreSettings:
    """preheat's part of ``--hicache-storage-backend-extra-config``; ``ConfigError`` for a missing URL, an unknown
    key, a bad value or ``"interface_v1"`` (this backend does not implement the zero-copy methods).

    >>> settings_from({"backend_name": "preheat", "url": "fs:///kv", "max_bytes": "1GiB"}).max_bytes
    1073741824
    """
    extra = dict(extra or {})
    if extra.get("interface_v1"):
        raise ConfigError("SGLang HiCache: preheat's backend does not implement the zero-copy v1 methods; "
                          "remove \"interface_v1\" from --hicache-storage-backend-extra-config")
    return StoreSettings.from_mapping(extra, where="SGLang HiCache extra config", others=_SGLANG_KEYS)


def storage_layout(config: StorageConfig) -> dict[str, object]:
    """What of SGLang's storage config changes a page's bytes: the shard (TP, PP, attention CP, DCP) and the
    page layout. MLA KV is the same on every TP rank (SGLang's own file backend shares it too), so its TP rank is
    left out."""
    mla = bool(config.is_mla_model)
    layout: dict[str, object] = {
        "mla": mla,
        "page_first": bool(config.is_page_first_layout),
        "pp": [int(config.pp_rank), int(config.pp_size)],
        "attn_cp": [int(getattr(config, "attn_cp_rank", 0)), int(getattr(config, "attn_cp_size", 1))],
        "dcp": [int(getattr(config, "dcp_rank", 0)), int(getattr(config, "dcp_size", 1))],
    }
    layout["tp"] = [None if mla else int(config.tp_rank), int(config.tp_size)]
    return layout


def pool_layout(pool: object) -> dict[str, object]:  # SGLang's HostKVCache, read with getattr
    """What of SGLang's host pool changes a page's bytes: dtype, page size, layout and KV geometry (whatever
    attributes the pool has)."""
    out: dict[str, object] = {"pool": type(pool).__name__}
    for name in ("dtype", "page_size", "layout", "layer_num", "head_num", "head_dim", "v_head_dim",
                 "kv_lora_rank", "qk_rope_head_dim", "storage_format_tag"):
        found = getattr(pool, name, None)
        if isinstance(found, bool | int | float):
            out[name] = found
        elif found is not None:  # a torch.dtype, an enum, a string: its text (the namespace is JSON)
            out[name] = str(found).removeprefix("torch.")
    return out


def namespace_for(config: StorageConfig, settings: StoreSettings, pool: object = None) -> Namespace:
    """The store namespace of one SGLang rank: the model identity, ``sglang-hicache`` and the page layout
    (``storage_layout``, plus ``pool_layout`` once the host pool is known)."""
    if not settings.model_identity and not config.model_name:
        raise ConfigError("SGLang HiCache: no model name in the storage config; set \"model_identity\"")
    model = namespace_model(settings.model_identity, config.model_name, ENGINE)
    layout = storage_layout(config)
    if pool is not None:
        layout["host_pool"] = pool_layout(pool)
    return Namespace(model=str(model), engine=ENGINE, layout=layout)


def _page_bytes(pool: HostPool) -> int | None:
    try:
        page = pool.get_dummy_flat_data_page()
        return int(page.numel() * page.element_size())
    except Exception:  # a pool without flat pages (or one that cannot build one): keep the default limit
        return None


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's memory (made contiguous first when it is not): the caller keeps ``tensor``
    alive while it uses the view."""
    view = _cpu_bytes(tensor)
    if view is not None:
        return view
    import torch

    flat = tensor.detach().contiguous().reshape(-1)  # a copy, which the numpy view below keeps alive
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs lack Buffer


def _cpu_bytes(tensor: torch.Tensor) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor's own memory, valid while the tensor lives (the caller holds
    it); None for a strided or device tensor. Through ``ctypes`` rather than ``tensor.view(uint8).numpy()``: measured
    here, a page read and hashed through the numpy view took 20-35 us longer at 4 MiB (and ~2 us more to make)."""
    if not (tensor.is_cpu and tensor.is_contiguous()):
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview(_byte_array(nbytes).from_address(tensor.data_ptr())).cast("B")


@functools.lru_cache(maxsize=64)  # a host pool has one page size: the ctypes type is made once, not per call
def _byte_array(nbytes: int) -> type[ctypes.Array[ctypes.c_char]]:
    return ctypes.c_char * nbytes


class _Backend:
    """What ``PreheatHiCacheStorage`` does (it adds SGLang's ``HiCacheStorage`` as a base when first looked up)."""

    def __init__(self, storage_config: StorageConfig, kwargs: Mapping[str, object] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = settings_from(storage_config.extra_config)
        self.store: BlobStore = self.settings.open(namespace_for(storage_config, self.settings), DEFAULT_MAX_VALUE)
        log.info("SGLang HiCache storage: preheat %s", self.store.describe())

    # -- SGLang's interface ------------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        """SGLang hands over its host pool before any I/O: its dtype and geometry join the namespace, and a stored
        page may be at most one of its pages."""
        super().register_mem_pool_host(mem_pool_host)  # type: ignore[misc]
        page = _page_bytes(mem_pool_host)
        namespace = namespace_for(self.storage_config, self.settings, mem_pool_host)
        self.store.close()
        self.store = self.settings.open(namespace, page + _PAGE_MARGIN if page is not None else DEFAULT_MAX_VALUE)
        log.info("SGLang HiCache storage: preheat %s (host pool %s)", self.store.describe(),
                 type(mem_pool_host).__name__)

    # SGLang's signatures; target_sizes and extra_info are not used (a page's size is its target's).
    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes: object = None
            ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Sequence[torch.Tensor | None] | None = None,
                  target_sizes: object = None) -> list[torch.Tensor | None]:
        """Each page read into its target tensor (HiCache's flat dummy page), or None: absent, damaged, of
        another size, storage down. Without targets, a new uint8 tensor per page. The pages of a batch are read
        on the store's ``io_threads`` threads (``kv/fanout.py``), each straight into its own target. Never raises
        into HiCache's prefetch thread: what fails is a miss."""
        targets = target_locations if target_locations is not None else [None] * len(keys)
        out: list[torch.Tensor | None] = [None] * len(keys)
        flat: list[tuple[int, str, torch.Tensor, memoryview]] = []  # (position, key, target, its bytes): one batch
        for i, (key, target) in enumerate(zip(keys, targets, strict=False)):
            try:
                view = _cpu_bytes(target) if target is not None else None
                if view is not None and target is not None:  # HiCache's flat page: straight into it, with the batch
                    flat.append((i, key, target, view))
                else:
                    out[i] = self._get_one(key, target)
            except Exception:
                log.exception("SGLang HiCache get of %s failed; a miss", key)
        try:
            found = self.store.get_into_many([(key, exactly(view)) for _, key, _, view in flat], peek=False,
                                             nbytes=sum(len(view) for *_, view in flat))
        except Exception:  # (the store itself never raises; its threads have all finished when this is reached)
            log.exception("SGLang HiCache get of %d pages failed; misses", len(flat))
            found = [None] * len(flat)
        for (i, _key, target, _view), n in zip(flat, found, strict=True):
            if n is not None:
                out[i] = target
        return out

    def _get_one(self, key: str, target: torch.Tensor | None) -> torch.Tensor | None:
        """A page without a flat CPU target: into a new tensor (no target), or read then copied (a strided or
        device target)."""
        import torch

        if target is None:
            found = self.store.get(key)
            return None if found is None else torch.frombuffer(bytearray(found), dtype=torch.uint8)
        page: torch.Tensor = target
        buffer = torch.empty(page.shape, dtype=page.dtype)
        staged = _bytes_of(buffer)
        if self.store.get_into(key, exactly(staged), peek=False) is None:
            return None
        page.copy_(buffer)
        return page

    def set(self, key: str, value: Any = None,  # Any: SGLang's signature; a None page fails in batch_set (logged)
            target_location: object = None, target_sizes: object = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: object = None, target_sizes: object = None) -> bool:
        """Store every page (tensors from the host pool); True only when all of them are stored (HiCache stops
        backing up the rest of the request on False)."""
        if values is None or len(values) != len(keys):
            return False
        try:
            done = self.store.put_many([(key, _bytes_of(value)) for key, value in zip(keys, values, strict=True)])
        except Exception:  # never an exception into HiCache's backup thread: not stored
            log.exception("SGLang HiCache set of %d pages failed", len(keys))
            return False
        return all(done)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
        """How many leading pages are stored (a page is only usable after every page before it)."""
        try:
            return self.store.prefix_length(keys)
        except Exception:  # never an exception into HiCache: nothing found
            log.exception("SGLang HiCache exists of %d pages failed", len(keys))
            return 0

    def clear(self) -> bool:
        """Remove every page of this rank's namespace (other namespaces on the same store stay)."""
        try:
            while keys := self.store.keys(4096):
                if not any(self.store.remove(key) for key in keys):
                    break
        except Exception:
            log.exception("SGLang HiCache clear of %s failed", self.store.describe())
            return False
        return True

    def close(self) -> None:
        self.store.close()


@functools.cache
def backend_class() -> type:
    """``PreheatHiCacheStorage``: ``_Backend`` with SGLang's ``HiCacheStorage`` as a base, built on first use."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    return type("PreheatHiCacheStorage", (_Backend, HiCacheStorage), {"__module__": __name__, "__doc__": __doc__})


def __getattr__(name: str) -> Any:  # Any: the class SGLang's backend factory looks up
    if name == "PreheatHiCacheStorage":
        return backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
