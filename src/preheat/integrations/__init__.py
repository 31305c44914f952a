"""preheat inside the engines people run: one package per engine (docs/integrations.md, docs/kv-store.md).

``vllm/`` (``--load-format preheat``, the KV offloading tier ``vllm/offload.py``), ``sglang/`` (HiCache storage),
``lmcache/`` (remote storage); ``store_settings`` reads the store keys all three engines' configurations carry.
Each package imports its engine lazily: ``import preheat.integrations`` never pulls in vLLM, SGLang or LMCache.
"""
