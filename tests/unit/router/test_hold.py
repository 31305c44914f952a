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
