"""The module path vLLM configurations name for preheat's offloading tier; the code is ``vllm/offload.py``.

Kept for good: a ``--kv-transfer-config`` names it (``"module_path": "preheat.integrations.vllm_offload"``), and
deployed configurations must keep working whatever the package's layout becomes.
"""

from preheat.integrations.vllm.offload import (
    ENGINE,
    SUPPORTED,
    __getattr__,  # noqa: F401 - PreheatTier, the class vLLM's tier factory looks up here
    key_name,
    namespace_for,
    tier_class,
)

__all__ = ["ENGINE", "SUPPORTED", "key_name", "namespace_for", "tier_class"]
