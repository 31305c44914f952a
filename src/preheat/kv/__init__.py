"""The tiered KV cache (spec: docs/kv-cache.md, keys: docs/kv-keys.md).

``keys`` (pure, no torch: the router and the analyzer import it) names chunks of tokens; ``chunkfile`` is the
self-checking byte format every tier stores; ``memory``, ``fs`` and ``redis_tier`` are the tiers; ``tiered`` joins
them for the engine. ``store`` keeps other engines' KV (LMCache, ...) in the same L2 through the same code
(docs/kv-store.md), and ``warm`` fills a host tier from it before a replica takes traffic.
"""
