"""Requests held at the router (router/hold.py), on a real event loop with a hand-moved clock: at most ``slots + 1``
reach a replica, the held ones go by response ratio (the cheapest first, a long one not passed forever), and a
client that goes away while held, or just as it is let through, loses no place at the replica."""

from __future__ import annotations

import asyncio

import pytest

from preheat.router.hold import NOT_HELD, Holds, Pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _hold(holds: Holds, order: list[str], name: str, cost: float) -> Pass:
    admitted = await holds.enter("r", 1, lambda: cost)
    order.append(name)
    return admitted


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_two_go_through_for_one_slot_and_the_cheapest_held_one_goes_next() -> None:
    async def scenario() -> list[str]:
        clock, order = Clock(), list[str]()
        holds = Holds(clock)
        first = await holds.enter("r", 1, lambda: 5.0)
        second = await holds.enter("r", 1, lambda: 5.0)
        tasks = [asyncio.create_task(_hold(holds, order, name, cost)) for name, cost in
                 (("long", 4.0), ("short", 0.1), ("middle", 1.0))]  # fmt: skip
        await _settle()
        assert order == []
        assert holds.held() == {"r": 3}
        clock.now = 0.5
        first.leave()
        await _settle()
        assert order == ["short"]
        second.leave()
        second.leave()  # idempotent: one place freed, not two
        await _settle()
        assert order == ["short", "middle"]
        for task in tasks[1:]:
            task.result().leave()
        await _settle()
        tasks[0].result().leave()
        assert holds.held() == {}
        return order

    assert asyncio.run(scenario()) == ["short", "middle", "long"]


def test_a_long_request_that_has_waited_passes_a_short_one_that_just_came() -> None:
    async def scenario() -> list[str]:
        clock, order = Clock(), list[str]()
        holds = Holds(clock)
        sent = [await holds.enter("r", 1, lambda: 1.0) for _ in range(2)]
        long = asyncio.create_task(_hold(holds, order, "long", 2.0))
        await _settle()
        clock.now = 10.0  # the long one waited 10 s: ratio (10 + 2) / 2 = 6
        short = asyncio.create_task(_hold(holds, order, "short", 0.5))  # just came: ratio 1
        await _settle()
        sent[0].leave()
        await _settle()
        sent[1].leave()
        await _settle()
        long.result().leave()
        short.result().leave()
        return order

    assert asyncio.run(scenario()) == ["long", "short"]


def test_a_client_gone_while_held_or_as_it_is_let_through_frees_its_place() -> None:
    async def scenario() -> None:
        holds = Holds(Clock())
        sent = [await holds.enter("r", 1, lambda: 1.0) for _ in range(2)]
        order: list[str] = []
        gone = asyncio.create_task(_hold(holds, order, "gone", 0.1))
        waiting = asyncio.create_task(_hold(holds, order, "waiting", 1.0))
        await _settle()
        gone.cancel()
        await _settle()
        assert holds.held() == {"r": 1}
        sent[0].leave()
        await _settle()
        assert order == ["waiting"]
        # Let through and cancelled before it ran: its place is given back, the next held one goes.
        late = asyncio.create_task(_hold(holds, order, "late", 0.1))
        after = asyncio.create_task(_hold(holds, order, "after", 1.0))
        await _settle()
        sent[1].leave()  # lets "late" through...
        late.cancel()  # ...which never runs
        await _settle()
        assert order == ["waiting", "after"]
        with pytest.raises(asyncio.CancelledError):
            await late
        waiting.result().leave()
        after.result().leave()
        assert holds.held() == {}
        assert not holds._lines

    asyncio.run(scenario())


def test_a_replica_with_more_slots_takes_more_at_once_and_not_held_leaves_nothing() -> None:
    async def scenario() -> None:
        holds = Holds(Clock())
        sent = [await holds.enter("r", 3, lambda: 1.0) for _ in range(4)]  # slots + 1 at once
        held = asyncio.create_task(holds.enter("r", 3, lambda: 1.0))
        await _settle()
        assert not held.done()
        sent[0].leave()
        await _settle()
        assert held.done()
        NOT_HELD.leave()  # a request no line counts
        for admitted in (*sent[1:], held.result()):
            admitted.leave()
        assert not holds._lines

    asyncio.run(scenario())


def test_a_client_whose_connection_is_lost_while_held_leaves_the_line() -> None:
    async def scenario() -> None:
        holds = Holds(Clock())
        sent = [await holds.enter("r", 1, lambda: 1.0) for _ in range(2)]
        gone = asyncio.get_running_loop().create_future()
        order: list[str] = []
        lost = asyncio.create_task(holds.enter("r", 1, lambda: 0.1, gone=gone))
        stays = asyncio.create_task(_hold(holds, order, "stays", 1.0))
        await _settle()
        gone.set_result(None)  # the client's connection is lost (Stream.lost)
        await _settle()
        with pytest.raises(ConnectionResetError):
            lost.result()
        assert holds.held() == {"r": 1}
        sent[0].leave()  # the cheaper request is gone: the place goes to the one still there
        await _settle()
        assert order == ["stays"]
        sent[1].leave()
        stays.result().leave()
        assert not holds._lines

    asyncio.run(scenario())


def test_a_held_request_is_priced_again_when_the_next_one_is_chosen() -> None:
    async def scenario() -> list[str]:
        holds, order = Holds(Clock()), list[str]()
        sent = [await holds.enter("r", 1, lambda: 1.0) for _ in range(2)]
        now_cheap = [10.0]  # its prefix is computed meanwhile: from a miss to a hit

        async def repriced() -> None:
            admitted = await holds.enter("r", 1, lambda: now_cheap[0])
            order.append("repriced")
            admitted.leave()

        first = asyncio.create_task(repriced())
        middle = asyncio.create_task(_hold(holds, order, "middle", 1.0))
        await _settle()
        now_cheap[0] = 0.1
        sent[0].leave()
        await _settle()
        sent[1].leave()
        await _settle()
        middle.result().leave()
        await first
        return order

    assert asyncio.run(scenario()) == ["repriced", "middle"]


def _moved_to(there: float | None, *, steal: bool = True) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """Replica "a" with two sent and three hits held (1 s each), "b" with one sent; "b" finishes it and falls idle.
    ``there``: what the held ones would cost on "b". Each held one's arrival (0-2) and the replica it went to, in the
    order they went, and what is still held once "b" took its part."""

    async def scenario() -> tuple[list[tuple[int, str]], dict[str, int]]:
        holds = Holds(Clock(), steal=steal)
        at_a = [await holds.enter("a", 1, lambda: 1.0) for _ in range(2)]
        at_b = await holds.enter("b", 1, lambda: 1.0)
        went: list[tuple[int, str]] = []

        async def held(n: int) -> Pass:
            admitted = await holds.enter("a", 1, lambda: 1.0, price_at=lambda name: there if name == "b" else None)
            went.append((n, admitted.replica))
            return admitted

        tasks = [asyncio.create_task(held(n)) for n in range(3)]
        await _settle()
        at_b.leave()
        await _settle()
        after_b = holds.held()
        for admitted in at_a:
            admitted.leave()
        while holds.held():  # each one let through is over in turn
            await _settle()
            for task in tasks:
                if task.done():
                    task.result().leave()
        await _settle()
        for task in tasks:
            task.result().leave()
        assert not holds._lines
        return went, after_b

    return asyncio.run(scenario())


def test_an_idle_replica_takes_the_held_request_that_gains_most_by_moving() -> None:
    # At "a" the last held one waits for the two before it and the one queued there (3 s) besides its own 1 s; on
    # "b" it costs 2 s (a recompute): it moves, the idle replica counts it, and the rest stay where they were routed.
    went, after_b = _moved_to(2.0)
    assert went[0] == (2, "b")  # of equal ratios the last to come: the others go first at "a"
    assert sorted(went) == [(0, "a"), (1, "a"), (2, "b")]
    assert after_b == {"a": 2}


def test_a_held_request_stays_where_moving_would_not_gain() -> None:
    for there, steal in ((10.0, True), (None, True), (2.0, False)):  # dearer there, cannot go there, --no-steal
        went, after_b = _moved_to(there, steal=steal)
        assert all(replica == "a" for _, replica in went)
        assert after_b == {"a": 3}


def test_a_moved_request_leaves_the_line_of_the_replica_that_took_it() -> None:
    async def scenario() -> None:
        holds = Holds(Clock())
        at_a = [await holds.enter("a", 1, lambda: 1.0) for _ in range(2)]
        at_b = await holds.enter("b", 1, lambda: 1.0)
        held = [asyncio.create_task(holds.enter("a", 1, lambda: 1.0, price_at=lambda _: 0.5)) for _ in range(2)]
        await _settle()
        at_b.leave()
        await _settle()
        moved = next(task.result() for task in held if task.done())
        assert moved.replica == "b"
        assert holds._lines["b"].sent == 1
        assert holds._lines["a"].sent == 2
        moved.leave()  # "b" is idle again: it takes the other one too
        await _settle()
        assert all(task.done() and task.result().replica == "b" for task in held)
        for admitted in (*at_a, *(task.result() for task in held)):
            admitted.leave()
        assert not holds._lines

    asyncio.run(scenario())


def test_an_idle_replica_takes_from_the_line_where_moving_gains_most() -> None:
    async def scenario() -> tuple[int, int]:
        holds = Holds(Clock())
        for replica in ("a", "c"):
            for _ in range(2):
                await holds.enter(replica, 1, lambda: 1.0)
        at_b = await holds.enter("b", 1, lambda: 1.0)
        # "a" holds three, "c" one, each with one queued there: moving gains 3 + 1 - 1.5 from "a", 1 + 1 - 1.5 from "c".
        tasks = [asyncio.create_task(holds.enter(replica, 1, lambda: 1.0, price_at=lambda _: 1.5))
                 for replica in ("a", "a", "a", "c")]  # fmt: skip
        await _settle()
        at_b.leave()
        await _settle()
        moved = [n for n, task in enumerate(tasks) if task.done() and task.result().replica == "b"]
        for task in tasks:
            task.cancel()
        return holds.held()["a"], moved[0]

    assert asyncio.run(scenario()) == (2, 2)


def _held_while_idle(there: float, *, steal: bool = True) -> tuple[list[str], dict[str, int]]:
    """Replica "a" with two sent; "b" in rotation with nothing of this router's (it never had a request, so it never
    falls idle). Three hits (1 s each) come for "a" and are held; ``there``: what each would cost on "b". Where each
    went as it came, and what is still held then."""

    async def scenario() -> tuple[list[str], dict[str, int]]:
        holds = Holds(Clock(), steal=steal)
        at_a = [await holds.enter("a", 1, lambda: 1.0) for _ in range(2)]

        def price_at(name: str) -> float | None:
            return there if name == "b" else None

        def idle() -> list[tuple[str, int]]:
            return [("a", 1), ("b", 1)]

        tasks = [asyncio.create_task(holds.enter("a", 1, lambda: 1.0, price_at=price_at, idle=idle)) for _ in range(3)]
        await _settle()
        went = [task.result().replica for task in tasks if task.done()]
        still = holds.held()
        for task in tasks:
            if task.done():
                task.result().leave()
            else:
                task.cancel()
        for admitted in at_a:
            admitted.leave()
        await _settle()
        return went, still

    return asyncio.run(scenario())


def test_a_replica_idle_already_takes_a_request_held_elsewhere_when_it_comes() -> None:
    # Once two are held, the later one waits for the one held before it and the one queued at "a" (2 s) besides its
    # own 1 s; on "b" it costs 2 s. "b" has nothing to end, so only a look on arrival moves it; it takes that one
    # (one slot: a third held finds "b" busy).
    went, still = _held_while_idle(2.0)
    assert went == ["b"]
    assert still == {"a": 2}


def test_an_idle_replica_takes_nothing_on_arrival_that_would_not_gain_or_with_no_steal() -> None:
    for there, steal in ((10.0, True), (2.0, False)):
        went, still = _held_while_idle(there, steal=steal)
        assert went == []
        assert still == {"a": 3}
