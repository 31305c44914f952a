"""``preheat.core.backoff``: the one retry policy. Every wait lies in ``[0, ceiling]``; ceilings start at ``first``,
grow by ``factor`` and stop at ``cap``; a seed replays the same waits; no failure count is too large."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.core.backoff import Backoff
from preheat.core.errors import ConfigError
from strategies import FUZZ


@st.composite
def policies(draw: st.DrawFn) -> Backoff:
    first = draw(st.floats(1e-3, 10.0))
    cap = draw(st.floats(first, 600.0))
    factor = draw(st.floats(1.0, 4.0))
    return Backoff(first, cap, factor)


attempts = st.integers(0, 10_000)


@FUZZ
@given(policies(), attempts, st.integers(0, 2**32))
def test_a_wait_is_never_negative_nor_over_its_ceiling_nor_over_the_cap(policy: Backoff, n: int, seed: int) -> None:
    wait = policy.delay(n, random.Random(seed))
    assert 0.0 <= wait <= policy.ceiling(n) <= policy.cap


@FUZZ
@given(policies(), attempts)
def test_ceilings_never_shrink_as_failures_continue(policy: Backoff, n: int) -> None:
    assert policy.ceiling(n) <= policy.ceiling(n + 1)


@FUZZ
@given(policies())
def test_the_first_retry_waits_at_most_first_and_a_long_outage_waits_up_to_the_cap(policy: Backoff) -> None:
    assert policy.ceiling(0) == policy.first
    if policy.factor >= 1.01:
        assert policy.ceiling(1_000_000) == policy.cap  # factor**n far past any float: no OverflowError
    elif policy.factor == 1.0:
        assert policy.ceiling(1_000_000) == policy.first  # factor 1: a constant ceiling


@FUZZ
@given(policies(), st.integers(0, 2**32))
def test_the_same_seed_replays_the_same_waits(policy: Backoff, seed: int) -> None:
    assert list(itertools.islice(policy.delays(seed), 20)) == list(itertools.islice(policy.delays(seed), 20))


def test_doubling_from_half_a_second_to_thirty() -> None:
    assert [Backoff(0.5, 30.0).ceiling(n) for n in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_waits_are_spread_over_the_window_not_bunched_at_its_end() -> None:
    # The jitter is what keeps clients that failed together from retrying together.
    waits = list(itertools.islice(Backoff(1.0, 1.0).delays(seed=1), 1000))
    assert min(waits) < 0.1
    assert max(waits) > 0.9
    assert len(set(waits)) == len(waits)


@pytest.mark.parametrize(
    ("first", "cap", "factor"),
    [(0.0, 1.0, 2.0), (-1.0, 1.0, 2.0), (2.0, 1.0, 2.0), (1.0, float("inf"), 2.0), (1.0, 2.0, 0.5)],
)
def test_a_policy_that_could_spin_or_never_retry_is_refused(first: float, cap: float, factor: float) -> None:
    with pytest.raises(ConfigError, match="backoff"):
        Backoff(first, cap, factor)


def test_a_negative_failure_count_is_refused() -> None:
    with pytest.raises(ValueError, match="attempt -1"):
        Backoff(1.0, 2.0).ceiling(-1)
