"""The node-local model cache: download a checkpoint once per node, verify it, share it between processes."""

from preheat.store.cache import CacheEntry, ModelCache, default_cache_dir

__all__ = ["CacheEntry", "ModelCache", "default_cache_dir"]
