"""An engine replica's cached blocks, translated into the router's chunk keys. Pure: events in, key sets out.

vLLM and SGLang name a cached block by their own hash, which the router cannot recompute from a prompt: vLLM's
depends on ``--prefix-caching-hash-algo`` and, for the builtin hash, on a random per-process seed unless
``PYTHONHASHSEED`` is set; SGLang's on its own scheme. So the router does not try. Every ``BlockStored`` carries the
block's tokens and its parent's hash, and the router keeps ``engine hash -> router key`` where

    router key of a block = chunk key of its tokens chained on its parent's router key
                            (the fingerprint's seed for a block with no parent)

which is exactly ``preheat.kv.keys.chunk_keys(fingerprint, prompt, block_size)`` over the prompt the blocks came from:
the key of the i-th block of a prompt names that block and every token before it, as the engine's hash does. A
request's prompt tokens then give the same keys, with the engine's block size as the chunk size.

A block is not mapped (counted, not indexed) when:

- its parent is unknown: stored before the router joined and no longer in the engine's replay buffer, or after a
  gap the replay could not fill. Its children are unmapped too, until the prompt's first block is stored again;
- its hash covers more than its tokens (a LoRA adapter, image features, a cache salt, prompt embeddings), or it
  belongs to another KV-cache group than the first (hybrid models), or has another block size than the first seen:
  no prompt token list gives its key.

Media are tiers: ``GPU`` (and an engine that names none) the accelerator's own cache; ``CPU`` (SGLang: ``CPU_PINNED``)
host memory, priced as preheat's L1; ``STORAGE`` (SGLang: ``DISK``, ``EXTERNAL``) anything slower, priced as L2.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from preheat.kv.keys import chunk_keys, fingerprint
from preheat.router.engine_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
)
from preheat.router.index import KeySet, ReplicaCache


@dataclass
class Applied:
    """What one batch did: blocks indexed, blocks that could not be mapped (and why), events not understood."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unmapped: int = 0  # unknown parent
    foreign: int = 0  # hash covers more than tokens, another group or block size
    unknown: int = 0  # event types this router does not know


def engine_fingerprint(identity: str, block_size: int) -> str:
    """The seed of an engine replica's router keys: the same for every replica of one model (``identity``: the
    tokenizer's source) at one block size, so that a request's keys are computed once for all of them.

    >>> engine_fingerprint("/models/smollm2", 32) == engine_fingerprint("/models/smollm2", 32)
    True
    """
    return fingerprint(identity=identity, layout={"index": "preheat-router-engine-blocks"}, chunk_tokens=block_size)


class EngineBlockMap:
    """One engine replica's blocks as router keys, per medium; ``cache`` is what the KV index scores (None until a
    block could be mapped: such a replica is routed by prefix, policies.py).

    >>> from preheat.router.engine_events import EventBatch, BlockStored
    >>> blocks = EngineBlockMap("model")
    >>> first = BlockStored((11, 12), None, (1, 2, 3, 4), 2, "GPU", False, None)
    >>> blocks.apply(EventBatch(0.0, (first,), 0)).stored
    2
    >>> cache = blocks.cache
    >>> cache is not None and [k in cache.gpu for k in chunk_keys(cache.fingerprint, [1, 2, 3, 4], 2)]
    [True, True]
    """

    def __init__(self, identity: str, *, max_keys: int = 100_000) -> None:
        self.identity, self.max_keys = identity, max_keys
        self.cache: ReplicaCache | None = None
        # engine hash -> router key, least recently stored first. Kept after a block is removed (the engine's hash
        # of the same tokens is the same): bounded instead, to a few times what the tiers can hold.
        self._keys: OrderedDict[BlockHash, str] = OrderedDict()

    def clear(self) -> None:
        """Forget everything: the engine restarted (its hashes may have changed with its seed)."""
        self.cache = None
        self._keys.clear()

    def apply(self, batch: EventBatch) -> Applied:
        """Fold one batch in, in order."""
        done = Applied()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event, done)
            elif isinstance(event, BlockRemoved):
                if self.cache is not None:
                    tier = self._tier(self.cache, event.medium)
                    for block in event.block_hashes:
                        key = self._keys.get(block)
                        if key is not None:
                            tier.discard(key)
                            done.removed += 1
            elif isinstance(event, AllBlocksCleared):
                done.cleared += 1
                if self.cache is not None:
                    for tier in (self.cache.gpu, self.cache.l1, self.cache.l2):
                        for key in list(tier):
                            tier.discard(key)
            elif isinstance(event, UnknownEvent):
                done.unknown += 1
        return done

    def _store(self, event: BlockStored, done: Applied) -> None:
        cache = self.cache
        if (
            event.extra
            or event.group not in (None, 0)
            or (cache is not None and cache.chunk_tokens != event.block_size)
        ):
            done.foreign += len(event.block_hashes)
            return
        if event.parent is None:
            seed = engine_fingerprint(self.identity, event.block_size)
        else:
            parent = self._keys.get(event.parent)
            if parent is None:
                done.unmapped += len(event.block_hashes)
                return
            seed = parent
        if cache is None:
            fp = engine_fingerprint(self.identity, event.block_size)
            cache = self.cache = ReplicaCache(
                epoch="engine", fingerprint=fp, chunk_tokens=event.block_size, seq=0, l2_id=None,
                l1=KeySet(self.max_keys), l2=KeySet(self.max_keys), snapshot_at=0.0, gpu=KeySet(self.max_keys),
            )  # fmt: skip
        # A chained chunk key is XXH3(previous key || tokens): the parent's key is a valid seed for the rest.
        keys = chunk_keys(seed, event.token_ids, event.block_size)
        tier = self._tier(cache, event.medium)
        for block, key in zip(event.block_hashes, keys, strict=True):
            self._keys[block] = key
            self._keys.move_to_end(block)
            tier.add(key)
        while len(self._keys) > 4 * self.max_keys:
            self._keys.popitem(last=False)
        done.stored += len(keys)

    @staticmethod
    def _tier(cache: ReplicaCache, medium: str | None) -> KeySet:
        tier = MEDIA.get((medium or "GPU").upper(), "storage")  # a medium not known here: the slowest restore
        return cache.gpu if tier == "gpu" else cache.l1 if tier == "cpu" else cache.l2


# Each engine's media names, as tiers: vLLM GPU/CPU/STORAGE, SGLang GPU/CPU_PINNED/DISK/EXTERNAL.
MEDIA = {
    "GPU": "gpu",
    "CPU": "cpu",
    "CPU_PINNED": "cpu",
    "STORAGE": "storage",
    "DISK": "storage",
    "EXTERNAL": "storage",
}
