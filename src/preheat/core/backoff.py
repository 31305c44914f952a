"""The one retry policy: exponential backoff with full jitter.

After the ``n``-th consecutive failure (``n`` counted from 0) a retry waits a random time in ``[0, ceiling(n)]``, where
``ceiling(n) = min(cap, first * factor**n)``. The randomness is the point ("full jitter"): the threads of a load, or
the replicas of a deployment, that failed together at one outage spread their retries over the whole window instead
of all arriving at the recovering server in the same instant, and the total wait stays about half of the plain
exponential one.

The policy is a value: it holds no state and does no I/O; the loop that retries counts its failures and sleeps. Tests
pass their own ``random.Random(seed)`` to get the same delays every run.

>>> policy = Backoff(first=0.5, cap=30.0)
>>> [policy.ceiling(n) for n in range(8)]
[0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
>>> 0.0 <= policy.delay(3, random.Random(7)) <= 4.0
True
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from preheat.core.errors import ConfigError

# Jitter spreads retries; it protects no secret, so the ordinary generator is the right one (and it is seedable).
_RANDOM = random.Random()  # noqa: S311 - jitter, not cryptography


@dataclass(frozen=True)
class Backoff:
    """Delays of a jittered exponential backoff: ``first`` seconds at most for the first retry, ``factor`` times more
    for each failure after it, never more than ``cap``."""

    first: float
    cap: float
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not (self.first > 0 and math.isfinite(self.cap) and self.cap >= self.first and self.factor >= 1):
            raise ConfigError(
                f"backoff first={self.first} cap={self.cap} factor={self.factor}: "
                "need 0 < first <= cap (finite) and factor >= 1"
            )

    def ceiling(self, attempt: int) -> float:
        """The longest wait after failure number ``attempt`` (0 for the first failure)."""
        if attempt < 0:
            raise ValueError(f"attempt {attempt}: failures are counted from 0")
        try:
            grown = self.first * self.factor**attempt
        except OverflowError:  # far past the cap already (a loop that has failed for hours)
            return self.cap
        return min(self.cap, grown)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failure number ``attempt``: uniform in ``[0, ceiling(attempt)]``."""
        return (rng or _RANDOM).uniform(0.0, self.ceiling(attempt))

    def delays(self, seed: int | None = None) -> Iterator[float]:
        """The waits after failures 0, 1, 2, ... (endless); the same ``seed`` gives the same waits."""
        rng = random.Random(seed)  # noqa: S311 - jitter, not cryptography
        attempt = 0
        while True:
            yield self.delay(attempt, rng)
            attempt += 1
