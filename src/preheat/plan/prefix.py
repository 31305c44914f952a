"""Prefix sharing and KV cache hit rates over chunk keys: pure functions of a trace's chunk-key lists.

A request is its prompt's cacheable chunk keys (``preheat.kv.keys.chunk_keys`` with ``limit=cacheable_chunks``),
interned to small integers, plus its prompt length. Three questions are answered here:

- *Shared prefix*: how many leading chunks of each request some earlier request already had (an infinite cache
  shared by every replica). Chained keys make "chunk i seen" mean "tokens 0..(i+1)C seen as a prefix".
- *Routing*: which replica each request goes to, round-robin or prefix-aware. Prefix-aware routing looks up the
  router's own memory of where each chunk was sent (like sgl-router's approximate tree) and sends the request to the
  replica that got the longest matching prefix, unless that replica had more than ``2/R`` of the last ``window``
  requests (then, like a miss, to the one that had fewest). Routing never looks at cache contents, so one routing
  serves every cache size and the hit rate stays monotone in capacity.
- *LRU tiers*: an L1 per replica and an optional L2 shared by all, each an LRU over chunks. A lookup takes the
  longest leading run of chunks found in L1 or L2 (the engine restores a contiguous prefix only); then every chunk
  of the prompt is stored in (or refreshed in) both tiers, last chunk first, so a prefix's head outlives its tail,
  as in vLLM's free-block queue. Every cache sees the same sequence of touches whatever its size, which is LRU's
  inclusion property: a bigger cache holds a superset, so its hit rate is never lower.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from preheat.kv.keys import split_hits

UNBOUNDED = 1 << 62  # a capacity no trace reaches: an infinite cache


@dataclass(frozen=True)
class KeyedRequest:
    """What the cache simulation needs of one request: interned chunk keys and the prompt length in tokens."""

    keys: tuple[int, ...]
    tokens: int


class KeyTable:
    """Interns 32-hex chunk keys to dense integers (cheaper to hash and store than the strings)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def intern(self, keys: Sequence[str]) -> tuple[int, ...]:
        """The integer id of each key, new ids for keys never seen."""
        ids = self._ids
        out = []
        for key in keys:
            value = ids.get(key)
            if value is None:
                value = ids[key] = len(ids)
            out.append(value)
        return tuple(out)


def reusable_chunks(requests: Sequence[KeyedRequest]) -> list[int]:
    """Per request, how many leading chunks an earlier request already had (an infinite cache every replica shares).

    >>> reusable_chunks([KeyedRequest((1, 2), 600), KeyedRequest((1, 3), 600), KeyedRequest((1, 2, 4), 900)])
    [0, 1, 2]
    """
    seen: set[int] = set()
    out = []
    for request in requests:
        run = 0
        for key in request.keys:
            if key not in seen:
                break
            run += 1
        out.append(run)
        seen.update(request.keys)
    return out


def route_round_robin(requests: Sequence[KeyedRequest], replicas: int) -> list[int]:
    """Request i goes to replica ``i % replicas``."""
    return [i % replicas for i in range(len(requests))]


def route_prefix_aware(requests: Sequence[KeyedRequest], replicas: int, *, window: int | None = None) -> list[int]:
    """Each request to the replica that was sent its longest known prefix, within a load limit (module docstring).

    ``window`` defaults to ``16 * replicas`` requests; a replica may take ``2 * window / replicas`` of them.

    >>> reqs = [KeyedRequest((1,), 300), KeyedRequest((2,), 300), KeyedRequest((1, 5), 600)]
    >>> route_prefix_aware(reqs, 2)
    [0, 1, 0]
    """
    window = window or 16 * replicas
    limit = max(1, 2 * window // replicas)
    owner: dict[int, int] = {}
    recent: deque[int] = deque()
    load = [0] * replicas
    out = []
    for request in requests:
        target = -1
        for key in request.keys:
            holder = owner.get(key)
            if holder is None:
                break
            target = holder
        if target < 0 or load[target] >= limit:
            target = min(range(replicas), key=load.__getitem__)  # ties: lowest index
        out.append(target)
        recent.append(target)
        load[target] += 1
        if len(recent) > window:
            load[recent.popleft()] -= 1
        for key in request.keys:
            owner[key] = target
    return out


@dataclass(frozen=True)
class CacheResult:
    """Chunks found per tier over a whole trace, with the totals to turn them into rates."""

    l1_chunks: int
    l2_chunks: int
    cacheable_chunks: int
    prompt_tokens: int
    chunk_tokens: int

    @property
    def hit_tokens(self) -> int:
        return (self.l1_chunks + self.l2_chunks) * self.chunk_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of all prompt tokens served from a cache instead of prefilled."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, float | int]:
        """JSON-ready: rates as fractions of prompt tokens, and the chunk counts behind them."""
        total = self.prompt_tokens or 1
        return {
            "hit_rate": self.hit_rate,
            "l1_hit_rate": self.l1_chunks * self.chunk_tokens / total,
            "l2_hit_rate": self.l2_chunks * self.chunk_tokens / total,
            "l1_chunks": self.l1_chunks,
            "l2_chunks": self.l2_chunks,
            "cacheable_chunks": self.cacheable_chunks,
        }


def simulate_lru(
    requests: Sequence[KeyedRequest],
    assignment: Sequence[int],
    replicas: int,
    *,
    l1_chunks: int,
    l2_chunks: int = 0,
    chunk_tokens: int,
) -> CacheResult:
    """Replay ``requests`` (sent to replicas per ``assignment``) through an LRU L1 per replica of ``l1_chunks`` and
    a shared LRU L2 of ``l2_chunks`` (0: no such tier; ``UNBOUNDED``: never evicts)."""
    l1s: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
    l2: OrderedDict[int, None] = OrderedDict()
    hits1 = hits2 = cacheable = tokens = 0
    for request, replica in zip(requests, assignment, strict=True):
        keys = request.keys
        tokens += request.tokens
        cacheable += len(keys)
        l1 = l1s[replica]
        in_l1, in_l2 = split_hits(keys, l1, l2)
        hits1 += in_l1
        hits2 += in_l2
        if l1_chunks:
            _touch(l1, keys, l1_chunks)
        if l2_chunks:
            _touch(l2, keys, l2_chunks)
    return CacheResult(hits1, hits2, cacheable, tokens, chunk_tokens)


def _touch(lru: OrderedDict[int, None], keys: tuple[int, ...], capacity: int) -> None:
    for key in reversed(keys):  # last chunk first: the head ends most recent and is evicted last
        if key in lru:
            lru.move_to_end(key)
        else:
            lru[key] = None
            if len(lru) > capacity:
                lru.popitem(last=False)


def capacity_sweep(unique_chunks: int, points: int = 8) -> list[int]:
    """Capacities (chunks) from 1 to ``unique_chunks`` in roughly geometric steps: the x axis of the hit-rate plot.

    >>> capacity_sweep(1000, 4)
    [1, 10, 100, 1000]
    """
    if unique_chunks <= 1:
        return [1]
    ratio = unique_chunks ** (1.0 / (points - 1))
    values = sorted({max(1, round(ratio**i)) for i in range(points)} | {unique_chunks})
    return [v for v in values if v <= unique_chunks]
