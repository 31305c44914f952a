"""Expected time to first token of a prompt on one replica, from what that replica's KV tiers hold. Pure.

``ttft = queue wait + recomputed tokens x prefill cost + (GPU, L1, L2) tokens x (GPU, L1, L2) cost``

The GPU tier is an engine replica's own accelerator cache (vLLM/SGLang medium ``GPU``): its K/V is where attention
reads it, so a hit there costs nothing (``Costs.gpu`` = 0). An engine's ``CPU`` medium is a host-to-device copy,
priced as preheat's L1 (host DRAM); its ``STORAGE`` medium as L2. preheat replicas publish L1 and L2 only.

Chunks are taken in order and the walk stops at the first chunk found in no tier: a chunk's K/V depend on every token
before it, so a hit after a miss cannot be used (docs/kv-events.md). Only ``cacheable_chunks`` count: the last
prompt token is always computed.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from preheat.kv.keys import cacheable_chunks, split_hits

__all__ = ["Costs", "Estimate", "Queue", "expected_ttft", "rank_cost", "resolve_costs", "split_hits"]


@dataclass(frozen=True)
class Costs:
    """Seconds per token: computing a prompt token, restoring one from L1 (host DRAM) or L2 (shared store), and using
    one already in the engine's GPU cache (free: nothing moves)."""

    prefill: float
    l1: float
    l2: float
    gpu: float = 0.0


# Priors until a replica has measured its own costs (the replica publishes null before its first request of each
# kind). Only their ratios matter when replicas are compared with each other; these are the CPU reference engine's
# orders of magnitude, and a restore is always priced below a recompute so that a hit wins over a miss.
DEFAULT_COSTS = Costs(prefill=2e-3, l1=2e-5, l2=2e-4)


@dataclass(frozen=True)
class Estimate:
    """One replica's expected TTFT for one prompt, and the token counts behind it (for logs and tests)."""

    ttft: float
    recompute_tokens: int
    l1_tokens: int
    l2_tokens: int
    queue_wait: float
    gpu_tokens: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.gpu_tokens + self.l1_tokens + self.l2_tokens

    @property
    def service(self) -> float:
        """Seconds of the replica's own work for this prompt (restores and recompute): what it adds to the queue."""
        return self.ttft - self.queue_wait


@dataclass(frozen=True)
class Queue:
    """The work ahead of a new request at one replica, as this router knows it; ``wait()`` prices it in seconds.

    A replica generates its requests one after another, so a new one waits for the *work* queued before it, not for
    the number of requests: one miss of a long prompt weighs as much as many hits. ``waiting``: the estimated
    service seconds (``Estimate.service``: restores and recompute) of this router's requests sent there and not
    answered yet, oldest first, the oldest ``elapsed`` seconds ago; each of them then generates its answer, about
    ``tail`` seconds (a request's measured duration there less its measured time to the first byte); ``streaming``:
    those answered and still generating, each with about ``tail`` left; ``others``: requests the replica reports
    beyond this router's, each ``typical`` seconds of service and a ``tail``.

    >>> Queue(waiting=(2.0, 0.5), elapsed=0.5).wait()  # the oldest is being prefilled
    2.0
    >>> Queue(waiting=(2.0,), streaming=1, tail=0.2, elapsed=0.5).wait()  # it has not started: one still generates
    2.4
    >>> Queue(waiting=(0.1, 0.1, 0.1), tail=1.0).wait()  # three short hits, each answered at length: not 0.3 s
    3.3
    """

    waiting: tuple[float, ...] = ()
    elapsed: float = 0.0
    streaming: int = 0
    tail: float = 0.0
    others: int = 0
    typical: float = 0.0

    def wait(self) -> float:
        # A queued request's answer is generated before the next request's prefill starts (one sequence at a time;
        # a batching engine overlaps them, and there this over-prices a queue: the safer side, away from a hot spot).
        ahead = sum(self.waiting) + (len(self.waiting) + self.streaming + self.others) * self.tail
        ahead += self.others * self.typical
        if self.waiting and not self.streaming and not self.others:
            # Nothing else is before the oldest: it has been served for ``elapsed`` s (at most all of its work).
            ahead -= min(self.elapsed, self.waiting[0])
        return max(ahead, 0.0)


def expected_ttft(
    n_tokens: int,
    keys: Sequence[str],
    chunk_tokens: int,
    *,
    l1: Container[str],
    l2: Container[str],
    costs: Costs,
    queue_wait: float = 0.0,
    gpu: Container[str] = frozenset(),
) -> Estimate:
    """The expected TTFT of an ``n_tokens`` prompt whose chunk keys are ``keys`` on a replica whose tiers hold
    ``l1`` and ``l2``, with ``queue_wait`` seconds of work ahead of it.

    >>> e = expected_ttft(1000, ["a", "b", "c"], 256, l1={"a"}, l2={"b"}, costs=Costs(1e-3, 1e-5, 1e-4))
    >>> e.l1_tokens, e.l2_tokens, e.recompute_tokens, round(e.ttft, 6)
    (256, 256, 488, 0.51616)
    """
    usable = list(keys[: cacheable_chunks(n_tokens, chunk_tokens)])
    in_gpu = 0
    for key in usable:  # the cheapest tier first: a key held in several is restored from the fastest
        if key not in gpu:
            break
        in_gpu += 1
    if in_gpu < len(usable):
        in_l1, in_l2 = split_hits(usable[in_gpu:], _Either(gpu, l1), l2)
    else:
        in_l1 = in_l2 = 0
    gpu_tokens, l1_tokens, l2_tokens = in_gpu * chunk_tokens, in_l1 * chunk_tokens, in_l2 * chunk_tokens
    recompute = max(n_tokens - gpu_tokens - l1_tokens - l2_tokens, 0)
    ttft = queue_wait + recompute * costs.prefill + gpu_tokens * costs.gpu + l1_tokens * costs.l1 + l2_tokens * costs.l2
    return Estimate(ttft, recompute, l1_tokens, l2_tokens, queue_wait, gpu_tokens)


def rank_cost(estimate: Estimate, busy: float) -> float:
    """What sending the request there costs the fleet: its own expected TTFT, plus its service once more for each
    share ``busy`` (0-1) of the replicas with requests in flight. A replica computes one request after another, so
    while the fleet is busy the work a request adds is waited for by the requests that come next (and on shared
    cores, by the other replicas' too): a recompute that saves this request a short wait costs the next ones more.
    Idle, only this request's TTFT counts.

    >>> hit, miss = Estimate(1.1, 10, 990, 0, 1.0), Estimate(1.0, 1000, 0, 0, 0.0)  # a hit behind 1 s, a miss idle
    >>> rank_cost(hit, 0.0) > rank_cost(miss, 0.0), rank_cost(hit, 1.0) < rank_cost(miss, 1.0)
    (True, True)
    """
    return estimate.ttft + busy * estimate.service


class _Either:
    """A key in either of two sets (a GPU hit after the run of GPU hits broke counts at L1's price)."""

    def __init__(self, first: Container[str], second: Container[str]) -> None:
        self._first, self._second = first, second

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._second


def resolve_costs(own: Sequence[float | None], others: Sequence[Sequence[float | None]]) -> Costs:
    """A replica's costs (prefill, L1, L2), each its own when measured, else the mean of the other replicas'
    measurements; a cost nobody measured yet is scaled from one that was by ``DEFAULT_COSTS``'s ratios, and only
    when nothing is measured anywhere are the priors used as they are. Borrowing a peer's number keeps a fresh
    replica comparable with warm ones; scaling keeps a restore priced below a recompute (a measured prefill of
    2e-5 s/token beside an L1 prior of 2e-5 would make a hit and a miss cost the same).

    >>> resolve_costs([1e-3, None, None], [[3e-3, 4e-5, None]])
    Costs(prefill=0.001, l1=4e-05, l2=0.0001, gpu=0.0)
    >>> round(resolve_costs([2e-5, None, None], []).l1, 12)  # no L1 restore measured yet: a hundredth of a recompute
    2e-07
    """
    defaults = (DEFAULT_COSTS.prefill, DEFAULT_COSTS.l1, DEFAULT_COSTS.l2)
    values: list[float | None] = []
    for i in range(len(defaults)):
        mine = own[i] if i < len(own) else None
        seen = [v for o in others if i < len(o) and (v := o[i]) is not None]
        values.append(mine if mine is not None else (sum(seen) / len(seen) if seen else None))
    anchor = next(((v, defaults[i]) for i, v in enumerate(values) if v is not None), None)
    scale = anchor[0] / anchor[1] if anchor is not None else 1.0
    return Costs(*(v if v is not None else defaults[i] * scale for i, v in enumerate(values)))
