"""preheat's blob store inside SGLang: the module SGLang's HiCache configuration names (``hicache`` has the code).

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "preheat",
        "module_path": "preheat.integrations.sglang", "class_name": "PreheatHiCacheStorage", "url": "fs:///kv"}'

SGLang's backend factory imports this package and looks up ``PreheatHiCacheStorage``, which is built (on SGLang's
``HiCacheStorage``) at that first lookup: importing the package imports no SGLang.
"""

from preheat.integrations.sglang.hicache import (
    ENGINE,
    SUPPORTED,
    __getattr__,  # noqa: F401 - PreheatHiCacheStorage, the class SGLang's backend factory looks up here
    backend_class,
    namespace_for,
    pool_layout,
    settings_from,
    storage_layout,
)

__all__ = ["ENGINE", "SUPPORTED", "backend_class", "namespace_for", "pool_layout", "settings_from", "storage_layout"]
