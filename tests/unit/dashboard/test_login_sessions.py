"""The dashboard's sessions and login throttle (``preheat.dashboard.login``) over a hand-moved clock."""

from __future__ import annotations

from preheat.dashboard.login import Sessions, Throttle


class Clock:
    """Seconds that pass only when a test says so (``now`` moved by hand)."""

    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sessions_are_bounded_and_the_oldest_go_first() -> None:
    clock = Clock()
    sessions = Sessions(ttl_s=3600, max_sessions=3, clock=clock)
    made = [sessions.new() for _ in range(4)]
    assert [sessions.valid(s) for s in made] == [False, True, True, True]
    assert len(sessions) == 3


def test_expired_sessions_are_forgotten_and_never_valid_again() -> None:
    clock = Clock()
    sessions = Sessions(ttl_s=10, clock=clock)
    early = sessions.new()
    clock.now += 6
    late = sessions.new()
    clock.now += 5
    assert not sessions.valid(early)
    assert sessions.valid(late)
    assert len(sessions) == 1
    clock.now -= 100  # a clock going back never revives it
    assert not sessions.valid(early)


def test_a_throttled_address_regains_one_try_per_refill_period() -> None:
    clock = Clock()
    throttle = Throttle(burst=2, refill_s=60, clock=clock)
    assert throttle.wait("10.0.0.7") is None
    throttle.failed("10.0.0.7")
    assert throttle.wait("10.0.0.7") is None
    throttle.failed("10.0.0.7")
    assert throttle.wait("10.0.0.7") == 60
    assert throttle.wait("10.0.0.8") is None  # per address
    clock.now += 30
    assert throttle.wait("10.0.0.7") == 30
    clock.now += 30
    assert throttle.wait("10.0.0.7") is None
    throttle.failed("10.0.0.7")  # the one try regained, used up
    assert throttle.wait("10.0.0.7") == 60


def test_the_throttle_remembers_a_bounded_number_of_addresses_forgetting_calm_ones_first() -> None:
    clock = Clock()
    throttle = Throttle(burst=1, refill_s=60, max_clients=2, clock=clock)
    throttle.failed("calm")
    clock.now += 120  # its bucket is full again: it says nothing worth keeping
    throttle.failed("guesser")
    throttle.failed("third")
    assert throttle.wait("guesser") is not None  # kept, the calm one forgotten
    assert throttle.wait("third") is not None
