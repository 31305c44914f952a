"""A real SGLang 0.5.23 storage side for the HiCache backend tests: SGLang's own ``HiCacheStorageConfig`` and
``StorageBackendFactory`` building preheat's backend from a ``dynamic`` extra config, and pages as SGLang's MHA host
pool hands them over. Imported only in the SGLang venv.

The pages are real torch tensors in the host pool's layout, not SGLang's ``MHATokenToKVPoolHost`` itself: building
that pool imports ``sglang.srt.configs``, which needs torchvision (absent from the SGLang venv, and its PyPI wheel
does not load against the CPU torch build)."""

from __future__ import annotations

from typing import Any

import torch

MODEL = "org/tiny-model"
LAYERS, PAGE, HEADS, DIM = 2, 16, 2, 64  # a bf16 page of 16 tokens: 2 x 2 x 16 x 2 x 64 x 2 bytes = 16 KiB
PAGE_SHAPE = (2, LAYERS, PAGE, HEADS, DIM)  # K/V, layer, token, head, dim: MHA host pool's "layer_first" page
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * DIM * 2


def storage_config(url: str, *, model: str = MODEL, tp_rank: int = 0, tp_size: int = 1, **extra: Any) -> Any:
    """SGLang's storage config of one rank with preheat as its dynamic backend."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False, model_name=model,
        extra_config={"backend_name": "preheat", "module_path": "preheat.integrations.sglang",
                      "class_name": "PreheatHiCacheStorage", "url": url, **extra},
    )


def backend(url: str, **kwargs: Any) -> Any:  # Any: SGLang's HiCacheStorage (preheat's)
    """preheat's backend, built the way HiCache's cache controller builds it."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    return StorageBackendFactory.create_backend("dynamic", storage_config(url, **kwargs), None)


def page(seed: int) -> torch.Tensor:
    """A page of random K/V, as the host pool's ``get_data_page`` returns it (flat)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(PAGE_SHAPE, generator=generator).to(torch.bfloat16).flatten()


def dummy_page() -> torch.Tensor:
    """What the host pool's ``get_dummy_flat_data_page`` hands ``batch_get`` to read into."""
    return torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16).flatten()


def key(i: int) -> str:
    """A page key as HiCache makes them: the hex SHA-256 of a page chain."""
    import hashlib

    return hashlib.sha256(f"page-{i}".encode()).hexdigest()
