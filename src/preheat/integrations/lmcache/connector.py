"""preheat's blob store as LMCache's remote storage: checksummed values, an index that survives restarts, quotas
and cross-process LRU behind LMCache's own ``RemoteConnector`` interface (LMCache 0.5.6).

LMCache configuration (YAML, or ``LMCACHE_*`` variables)::

    chunk_size: 256
    remote_storage_plugins: ["preheat"]
    extra_config:
      remote_storage_plugin.preheat.module_path: preheat.integrations.lmcache
      remote_storage_plugin.preheat.class_name: PreheatConnector
      remote_storage_plugin.preheat.url: fs:///shared/kv         # or redis://host:6379/0
      remote_storage_plugin.preheat.max_bytes: 200GiB             # fs:// quota (optional)
      remote_storage_plugin.preheat.model_identity: org/model@rev # optional; default: the checkpoint's identity
      remote_storage_plugin.preheat.secret_file: /etc/kv.secret   # optional fleet MAC (docs/kv-cache.md)

LMCache builds the connector itself (``ConnectorManager`` → ``cls(loop=..., local_cpu_backend=...,
config=...)``). Every value is LMCache's ``RemoteMetadata`` (shapes, dtypes, memory format) followed by the memory
object's bytes, stored by ``preheat.kv.store`` under LMCache's key string in a namespace of the model identity, the
engine (``lmcache``) and the KV layout (shape, dtype, chunk size, MLA, serde), so the stores of two models or two
layouts never answer for each other. A damaged value, a dead Redis, a full disk are misses (logged, counted in the
store's ``stats``), never an exception into LMCache. On ``fs://`` a value is read straight into the memory object
LMCache allocates, and verified there.

LMCache is imported only when ``PreheatConnector`` is first looked up (LMCache's plugin loader does that), so
importing this module costs nothing in an environment without LMCache. ``warm`` fills LMCache's local CPU backend
with the hottest values of the store before a replica takes traffic (docs/kv-store.md, *Warm start*).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from preheat.core.errors import CorruptChunkError
from preheat.integrations.store_settings import StoreSettings, namespace_model
from preheat.kv.store import BlobStore, Namespace
from preheat.kv.warm import WarmReport, warm_into

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("preheat.integrations.lmcache")

PLUGIN = "preheat"
ENGINE = "lmcache"
SUPPORTED = ("0.5.6",)  # LMCache versions this module is tested against (tests/engines/test_lmcache_store.py)
_VALUE_MARGIN = 64 << 10  # bytes a stored value may exceed one full chunk by (LMCache's metadata) before it is refused
_LMCACHE_KEYS = frozenset({"module_path", "class_name"})  # LMCache's own keys of a plugin, read by its loader


# LMCache's objects as this module uses them (LMCache is not installed where preheat is type-checked, and these name
# only what is read here). Its config (LMCacheEngineConfig) is an ``object``: only getattr'd, with defaults.
class EngineMetadata(Protocol):
    """LMCache's ``LMCacheEngineMetadata``: what the namespace is keyed by."""

    model_name: str
    kv_shape: Sequence[int]
    chunk_size: int
    use_mla: bool
    world_size: int

    def get_dtypes(self) -> Iterable[object]: ...  # torch dtypes

    def get_shapes(self) -> Iterable[Iterable[int]]: ...  # torch.Size values


class CPUBackend(Protocol):
    """LMCache's ``LocalCPUBackend``: where values read from the store are allocated, and warmed into."""

    metadata: EngineMetadata
    config: object  # handed to RemoteConnector's constructor as it is

    def get_full_chunk_size_bytes(self) -> int: ...

    def allocate(self, shapes: object, dtypes: object, fmt: object) -> MemoryObj | None: ...  # RemoteMetadata's

    def contains(self, key: CacheEngineKey) -> bool: ...

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> object: ...


def settings_from(extra: Mapping[str, object] | None, name: str = PLUGIN) -> StoreSettings:
    """The connector's part of LMCache's ``extra_config`` (keys ``remote_storage_plugin.<name>.<field>``, fields as
    ``StoreSettings``); ``ConfigError`` for a missing URL, a bad value or an unknown field.

    >>> settings_from({"remote_storage_plugin.preheat.url": "fs:///kv",
    ...                "remote_storage_plugin.preheat.max_bytes": "1GiB"}).max_bytes
    1073741824
    """
    prefix = f"remote_storage_plugin.{name}."
    mine = {k[len(prefix) :]: v for k, v in (extra or {}).items() if isinstance(k, str) and k.startswith(prefix)}
    return StoreSettings.from_mapping(mine, where=f"LMCache extra_config {prefix}*", others=_LMCACHE_KEYS)


def namespace_for(metadata: EngineMetadata, config: object, model_identity: str | None = None) -> Namespace:
    """The store namespace of an LMCache engine: its model identity, and everything that changes what a memory
    object's bytes mean (KV shape and dtype, chunk size, MLA, serde, saving partial chunks)."""
    dtypes = [str(d).removeprefix("torch.") for d in metadata.get_dtypes()]
    shapes = [list(s) for s in metadata.get_shapes()]
    layout = {
        "kv_shape": [int(d) for d in metadata.kv_shape],
        "shapes": shapes,
        "dtypes": dtypes,
        "chunk_size": int(metadata.chunk_size),
        "use_mla": bool(metadata.use_mla),
        "remote_serde": str(getattr(config, "remote_serde", "naive")),
        "world_size": int(metadata.world_size),
    }
    model = namespace_model(model_identity, metadata.model_name, ENGINE)
    return Namespace(model=model, engine=ENGINE, layout=layout)


def open_for(local_cpu_backend: CPUBackend, config: object, name: str = PLUGIN) -> BlobStore:
    """The blob store an LMCache engine with this config and CPU backend writes to."""
    settings = settings_from(getattr(config, "extra_config", None), name)
    namespace = namespace_for(local_cpu_backend.metadata, config, settings.model_identity)
    return settings.open(namespace, int(local_cpu_backend.get_full_chunk_size_bytes()) + _VALUE_MARGIN)


class _Connector:
    """What ``PreheatConnector`` does (it adds LMCache's ``RemoteConnector`` as a base when first looked up)."""

    remote_metadata_bytes: int  # set by RemoteConnector.__init__

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: CPUBackend,
        config: object,  # LMCache's LMCacheEngineConfig
        plugin_name: str | None = None,
    ) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)  # type: ignore[call-arg]
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.store = open_for(local_cpu_backend, config, (plugin_name or PLUGIN).split(".", 1)[0])
        log.info("LMCache remote storage: preheat %s", self.store.describe())

    # -- LMCache's interface -----------------------------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.loop.run_in_executor(None, self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.store.exists(key.to_string())

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return await self.loop.run_in_executor(None, self.get_sync, key)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.loop.run_in_executor(None, self.put_sync, key, memory_obj)

    async def list(self) -> list[str]:
        return await self.loop.run_in_executor(None, self.store.keys, 1 << 30)

    async def close(self) -> None:
        self.store.close()

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> int:
        return self.store.prefix_length([k.to_string() for k in keys])

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self.store.remove(key.to_string())

    # -- the work, on an executor thread -----------------------------------------------------------------------------

    def get_sync(self, key: CacheEngineKey) -> MemoryObj | None:
        """The memory object stored under ``key``, read into one LMCache allocates, or None (a miss)."""
        from lmcache.v1.protocol import RemoteMetadata

        allocated: list[MemoryObj] = []
        meta_bytes = self.remote_metadata_bytes

        def allocate(n: int, peek: bytes) -> list[memoryview] | None:
            # The metadata is read before the value is verified (its checksum covers it next); what does not add up
            # is a damaged value: counted and removed like any other.
            if n < meta_bytes or len(peek) < meta_bytes:
                raise CorruptChunkError(f"LMCache value of {n} bytes, shorter than its metadata")
            try:
                meta = RemoteMetadata.deserialize(peek[:meta_bytes])
            except (ValueError, KeyError) as exc:  # an unknown memory format or dtype number
                raise CorruptChunkError(f"LMCache metadata does not parse ({exc})") from None
            if meta.length != n - meta_bytes:
                raise CorruptChunkError(f"LMCache metadata says {meta.length} bytes, the value holds {n - meta_bytes}")
            memory_obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
            if memory_obj is None:
                return None  # no room in LMCache's CPU memory: a miss
            allocated.append(memory_obj)
            data = memoryview(memory_obj.byte_array).cast("B")
            if len(data) != meta.length:
                raise CorruptChunkError(f"LMCache metadata's shapes take {len(data)} bytes, not {meta.length}")
            return [memoryview(bytearray(meta_bytes)), data]

        try:
            found = self.store.get_into(key.to_string(), allocate)
        except Exception:  # LMCache's allocator or metadata parser raised: a miss, never an exception into LMCache
            log.exception("LMCache remote get of %s failed; a miss", key.to_string())
            found = None
        if found is None:
            for memory_obj in allocated:
                memory_obj.ref_count_down()
            return None
        return allocated[-1]

    def put_sync(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Store ``memory_obj`` (LMCache's metadata, then its bytes) under ``key``; a failure is logged, not raised."""
        from lmcache.v1.protocol import RemoteMetadata

        data = memoryview(memory_obj.byte_array).cast("B")
        meta = RemoteMetadata(len(data), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                              memory_obj.get_memory_format())
        if not self.store.put(key.to_string(), (meta.serialize(), data)):
            log.debug("LMCache remote put of %s not stored (%s)", key.to_string(), self.store.describe())


@functools.cache
def connector_class() -> type:
    """``PreheatConnector``: ``_Connector`` with LMCache's ``RemoteConnector`` as a base, built on first use."""
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

    return type("PreheatConnector", (_Connector, RemoteConnector), {"__module__": __name__,
                                                                     "__doc__": __doc__})


def warm(connector: _Connector, *, max_bytes: int | None = None, max_entries: int | None = None) -> WarmReport:
    """Pre-load the hottest values of ``connector``'s store (a ``PreheatConnector``) into LMCache's local CPU
    backend, most recently used first, within ``max_bytes`` (default: what the backend's allocator can take) and
    ``max_entries``; call it once the engine is built, before the replica takes traffic. Values that do not fit,
    fail their checks or are already there are skipped."""
    from lmcache.utils import CacheEngineKey

    backend = connector.local_cpu_backend

    def sink(key: str) -> int | None:
        engine_key = CacheEngineKey.from_string(key)
        if backend.contains(engine_key):
            return None
        memory_obj = connector.get_sync(engine_key)
        if memory_obj is None:
            return None
        try:
            backend.submit_put_task(engine_key, memory_obj)
        finally:
            memory_obj.ref_count_down()  # the backend holds its own reference now
        return int(memory_obj.get_size())

    return warm_into(connector.store, sink, max_bytes=max_bytes, max_entries=max_entries)


def __getattr__(name: str) -> Any:  # Any: the class LMCache's plugin loader looks up
    if name == "PreheatConnector":
        return connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
