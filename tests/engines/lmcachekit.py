"""A real LMCache 0.5.6 engine side for the plugin tests: its config, metadata, local CPU backend and event loop,
and preheat's connector built the way LMCache builds it (``ConnectorManager("plugin://preheat", ...)``). Imported
only in the LMCache venv."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")
MODEL = "org/tiny-model"
KV_SHAPE = (2, 2, 256, 2, 64)  # layers, K/V, chunk tokens, kv heads, head dim: 256 KiB per bf16 chunk


@dataclass
class Side:
    """One LMCache engine's storage side with preheat as its remote store."""

    connector: Any  # Any: LMCache's RemoteConnector (preheat's PreheatConnector)
    backend: Any  # Any: LMCache's LocalCPUBackend
    loop: asyncio.AbstractEventLoop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def memory_obj(self, seed: int, tokens: int = KV_SHAPE[2]) -> Any:  # Any: LMCache's MemoryObj
        """A memory object of ``tokens`` tokens filled with random K/V (``seed``)."""
        shape = torch.Size([KV_SHAPE[1], KV_SHAPE[0], tokens, KV_SHAPE[3] * KV_SHAPE[4]])
        obj = self.backend.allocate([shape], [torch.bfloat16])
        generator = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=generator).to(torch.bfloat16))
        return obj

    def close(self) -> None:
        self.run(self.connector.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


def key(i: int, model: str = MODEL) -> Any:  # Any: LMCache's CacheEngineKey
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model_name=model, world_size=1, worker_id=0, chunk_hash=0xABC000 + i, dtype=torch.bfloat16)


def side(url: str, *, model: str = MODEL, kv_shape: tuple[int, ...] = KV_SHAPE, **extra: str) -> Side:
    """LMCache's config, metadata and CPU backend for a tiny model, and preheat's connector from its own manager."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import ConnectorManager
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    extra_config = {
        "remote_storage_plugin.preheat.module_path": "preheat.integrations.lmcache",
        "remote_storage_plugin.preheat.class_name": "PreheatConnector",
        "remote_storage_plugin.preheat.url": url,
        **{f"remote_storage_plugin.preheat.{k}": v for k, v in extra.items()},
    }
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=kv_shape[2],
        local_cpu=True,
        max_local_cpu_size=0.05,
        remote_storage_plugins=["preheat"],
        extra_config=extra_config,
    )
    metadata = LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=kv_shape,
        chunk_size=kv_shape[2],
    )
    backend = LocalCPUBackend(config, metadata)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="lmcache-loop").start()
    connector = ConnectorManager("plugin://preheat", loop, backend, config, metadata).create_connector()
    return Side(connector, backend, loop)
