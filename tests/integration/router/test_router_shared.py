"""Several ``preheat router`` processes in front of the same two ``preheat serve`` replicas, sharing one view through
a real ``redis-server`` (``--shared-state``): a user's next turn lands where the last one did whichever router it is
sent to, a restarted router catches up, and a Redis that dies leaves every router serving on its own view.

Nothing is timed: each test waits (with a deadline) for the routers to say they have heard each other, through
their own ``/metrics``, and then checks where requests went.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.core.procs import Child
from preheat.router.cluster import ServerProcess, healthy
from preheat.router.shared_redis import STALENESS_BOUND
from preheat.testing.redisserver import RedisServer
from routing import NAME, SlowProxy, replica_of, start_replicas, wait_until
from serving import Client, Reply

GREEDY = {"model": NAME, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
TOPICS = [
    "Tell me about the keeper of lighthouses and old maps who lived in a kingdom by the sea, long ago. " * 2,
    "Describe the river that runs through the valley of orchards, where the miller keeps his accounts. " * 2,
]


@pytest.fixture(scope="module")
def replicas(tiny_servable_model: Path) -> Iterator[list[str]]:
    started: list[ServerProcess] = start_replicas(str(tiny_servable_model), 2, "--max-model-len", "512")
    yield [r.url for r in started]
    for replica in started:
        replica.stop()


class RouterProcess:
    """``preheat router --policy prefix --shared-state URL EXTRA...`` as a child, with the replicas healthy in it."""

    def __init__(self, replicas: list[str], model: Path, redis_url: str, fleet: str, *extra: str) -> None:
        policy = () if "--policy" in extra else ("--policy", "prefix")
        args = ["router", *policy, "--model", str(model), "--kv-chunk-tokens", "16", "--port", "0",
                "--shared-state", redis_url, "--shared-fleet", fleet, *extra]  # fmt: skip
        for url in replicas:
            args += ["--replica", url]
        self.child = Child("preheat router", args, merge_stderr=True)
        self.url = self.child.wait_address()
        self.child.wait_until(lambda url: healthy(url + "/health"), timeout=60)
        self.client = Client(self.url)

    def metric_sum(self, name: str, **labels: str) -> float:
        """The sum of every series of ``name`` whose labels include ``labels`` (0 when none)."""
        total = 0.0
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in self.client.get("/metrics").body.decode().splitlines():
            series, _, value = line.rpartition(" ")
            if (series == name or series.startswith(name + "{")) and all(w in series for w in want):
                total += float(value)
        return total

    def staleness(self) -> float | None:
        for line in self.client.get("/metrics").body.decode().splitlines():
            if line.startswith("preheat_router_shared_staleness_seconds "):
                return float(line.split()[-1])
        return None

    def stop(self) -> None:
        self.child.stop()


def fleet_of(count: int, replicas: list[str], model: Path, redis_url: str, *extra: str) -> list[RouterProcess]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    routers: list[RouterProcess] = []
    try:
        for _ in range(count):
            routers.append(RouterProcess(replicas, model, redis_url, fleet, *extra))
    except BaseException:
        for router in routers:
            router.stop()
        raise
    return routers


def caught_up(routers: list[RouterProcess], learnt: dict[int, float] | None = None) -> None:
    """Wait until every router has applied every key the others learnt (``learnt``: keys learnt by routers no
    longer running, which the others still replay), has heard that the others' requests are over (it is called
    between turns: a request another router just finished, still counted in flight, is a queue the ``kv`` policy
    would route around), and its view is within the staleness bound."""

    seen: list[object] = []

    def done() -> bool:
        counts = [r.metric_sum("preheat_router_shared_learnt_keys_total") for r in routers]
        applied = [r.metric_sum("preheat_router_shared_applied_keys_total") for r in routers]
        stale = [r.staleness() for r in routers]
        remote = [r.metric_sum("preheat_router_remote_in_flight") for r in routers]
        seen[:] = [counts, applied, stale, remote]
        gone = sum((learnt or {}).values())
        return all(
            applied[i] >= sum(counts) - counts[i] + gone and _within_bound(stale[i]) and remote[i] == 0
            for i in range(len(routers))
        )

    try:
        wait_until(done, "the routers to apply each other's learnt keys", deadline=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: learnt, applied, staleness, remote in flight: {seen}") from None


def _within_bound(staleness: float | None) -> bool:
    return staleness is not None and staleness <= STALENESS_BOUND


class Chat:
    """One user's conversation: each turn repeats the whole history, as a chat client does."""

    def __init__(self, topic: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "user", "content": topic}]

    def turn(self, router: RouterProcess) -> tuple[str, str]:
        """Send the conversation to ``router``; the replica that answered, and why the router chose it."""
        body = {"model": NAME, "messages": self.messages, "temperature": 0, "max_tokens": 8}
        reply = router.client.post("/v1/chat/completions", body)
        assert reply.status == 200, reply.body
        answer = reply.json()["choices"][0]["message"]["content"]
        self.messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on, please."}]
        return replica_of(reply), str(reply.headers.get("X-Preheat-Route"))


def stopped(routers: list[RouterProcess]) -> None:
    for router in routers:
        router.stop()


@pytest.mark.parametrize("count", [2, 3])
def test_a_chat_stays_on_its_replica_whichever_router_gets_each_turn(
    count: int, replicas: list[str], tiny_servable_model: Path, redis_server: RedisServer
) -> None:
    routers = fleet_of(count, replicas, tiny_servable_model, redis_server.url)
    try:
        chats = [Chat(topic) for topic in TOPICS]
        homes = [chat.turn(routers[0])[0] for chat in chats]
        for k in range(1, 2 * count + 1):  # every router gets turns, each after another router had the last one
            caught_up(routers)
            for chat, home in zip(chats, homes, strict=True):
                where, why = chat.turn(routers[k % count])
                assert (where, why) == (home, "prefix_match"), f"turn {k + 1} through router {k % count}"
        fleet = routers[0].metric_sum("preheat_router_fleet_hit_ratio", router="fleet")
        assert fleet > 0.5  # most turns followed the cache, whichever router took them
        assert all(len(_peer_lines(router)) == count - 1 for router in routers)  # each hears every other
        shared = routers[-1].client.get("/dashboard/api/state").json()["shared"]
        assert shared["up"] is True
        assert len(shared["routers"]) == count
        assert shared["routers"][0]["router"] == shared["router"]  # this one first
        assert all(r["decisions"] > 0 for r in shared["routers"])  # every router took turns, and said so
    finally:
        stopped(routers)


def _peer_lines(router: RouterProcess) -> list[str]:
    text = router.client.get("/metrics").body.decode()
    return [line for line in text.splitlines() if line.startswith("preheat_router_shared_peer_age_seconds{")]


def test_a_restarted_router_catches_up_and_agrees(
    replicas: list[str], tiny_servable_model: Path, redis_server: RedisServer
) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    routers: list[RouterProcess] = []
    try:
        first = RouterProcess(replicas, tiny_servable_model, redis_server.url, fleet)
        routers.append(first)
        second = RouterProcess(replicas, tiny_servable_model, redis_server.url, fleet)
        routers.append(second)
        chat = Chat(TOPICS[0])
        home, _ = chat.turn(first)
        caught_up(routers)
        assert chat.turn(second) == (home, "prefix_match")
        learnt_before = second.metric_sum("preheat_router_shared_learnt_keys_total")
        second.stop()
        restarted = RouterProcess(replicas, tiny_servable_model, redis_server.url, fleet)
        routers = [first, restarted]
        # The restarted router replays what both learnt, its former self's keys included (it has a new id).
        caught_up(routers, learnt={1: learnt_before})
        assert chat.turn(restarted) == (home, "prefix_match")
        caught_up(routers)
        assert chat.turn(first) == (home, "prefix_match")
    finally:
        stopped(routers)


def test_routers_keep_serving_on_their_own_view_while_redis_is_down(
    replicas: list[str], tiny_servable_model: Path, own_redis: RedisServer
) -> None:
    routers = fleet_of(2, replicas, tiny_servable_model, own_redis.url)
    try:
        chat = Chat(TOPICS[1])
        home, _ = chat.turn(routers[0])
        caught_up(routers)
        own_redis.stop()
        wait_until(lambda: all(r.metric_sum("preheat_router_shared_up") == 0 for r in routers), "routers to notice")
        for router in routers:  # every request is still answered, on what each router knew
            assert chat.turn(router) == (home, "prefix_match")
            assert router.metric_sum("preheat_router_shared_errors_total") > 0
        wait_until(lambda: all((r.staleness() or 0) > STALENESS_BOUND for r in routers), "staleness to show it")
        assert routers[0].client.get("/dashboard/api/state").json()["shared"]["up"] is False
        own_redis.start()  # an empty Redis on the same port: the routers carry on sharing
        wait_until(lambda: all(r.metric_sum("preheat_router_shared_up") == 1 for r in routers), "routers to reconnect")
        fresh = Chat(TOPICS[0])
        home, _ = fresh.turn(routers[1])
        caught_up(routers)
        assert fresh.turn(routers[0]) == (home, "prefix_match")
    finally:
        stopped(routers)


def test_least_load_counts_the_requests_other_routers_have_in_flight(
    replicas: list[str], tiny_servable_model: Path, redis_server: RedisServer
) -> None:
    with SlowProxy(int(replicas[0].rsplit(":", 1)[1])) as slow:
        # Health checks wait as long as the held answer: the slow replica stays in rotation in both routers.
        extra = ("--policy", "least-load", "--health-timeout", "120")
        first, second = routers = fleet_of(2, [slow.url, replicas[1]], tiny_servable_model, redis_server.url, *extra)
        try:
            slow.delay = 120.0
            held: list[Reply] = []
            thread = threading.Thread(target=lambda: held.append(first.client.post("/v1/completions", GREEDY)))
            thread.start()  # the first of a router's ties goes to its first replica: the slow one
            wait_until(lambda: first.metric_sum("preheat_router_in_flight", replica=slow.url) == 1, "one held")
            wait_until(
                lambda: second.metric_sum("preheat_router_remote_in_flight", replica=slow.url) == 1,
                "the second router to hear of it",
            )
            # On its own view the second router would take turns between two idle replicas; it sees one busy.
            replies = [second.client.post("/v1/completions", GREEDY) for _ in range(2)]
            assert [(replica_of(r), r.headers.get("X-Preheat-Route")) for r in replies] == [
                (replicas[1], "least_load")
            ] * 2
            slow.release()
            thread.join(timeout=60)
            assert held[0].status == 200
            wait_until(lambda: second.metric_sum("preheat_router_remote_in_flight") == 0, "the load to clear")
        finally:
            slow.release()
            stopped(routers)


@pytest.fixture(scope="module")
def kv_replicas(kv_model: Path) -> Iterator[list[str]]:
    tiers = ("--kv-l1", "64MiB", "--kv-chunk-tokens", "16", "--max-model-len", "512")
    started: list[ServerProcess] = start_replicas(str(kv_model), 2, *tiers)
    yield [r.url for r in started]
    for replica in started:
        replica.stop()


def l1_sizes(router: RouterProcess, replicas: list[str]) -> list[float]:
    return [router.metric_sum("preheat_router_index_keys", replica=url, index="l1") for url in replicas]


def settled(routers: list[RouterProcess]) -> None:
    """``caught_up``, and every router's last poll of the replicas' events says nothing runs there: a poll taken
    while the last turn ran would price a queue the next turn does not have (``kv`` would route around it)."""
    caught_up(routers)

    def idle(router: RouterProcess) -> bool:
        running = [line for line in router.client.get("/metrics").body.decode().splitlines()
                   if line.startswith('preheat_router_replica_requests{') and 'state="running"' in line]  # fmt: skip
        return len(running) == 2 and all(float(line.rpartition(" ")[2]) == 0 for line in running)

    wait_until(
        lambda: all(idle(r) for r in routers), "the routers to hear from the replicas that the last turn is over"
    )


def test_kv_routers_build_the_same_index_from_the_replicas_events(
    kv_replicas: list[str], kv_model: Path, redis_server: RedisServer
) -> None:
    routers = fleet_of(2, kv_replicas, kv_model, redis_server.url, "--policy", "kv")
    try:
        chat = Chat(TOPICS[0])
        home, _ = chat.turn(routers[0])

        # Each router polls the replicas' KV events itself: the same events, the same index, without Redis.
        def alike() -> bool:  # each router's sizes read once: a second read could see a newer poll
            first, second = (l1_sizes(router, kv_replicas) for router in routers)
            return first == second and sum(first) > 0

        wait_until(alike, "both routers to index the replicas' L1 alike")
        settled(routers)
        assert chat.turn(routers[1]) == (home, "kv_hit")
        settled(routers)
        assert chat.turn(routers[0]) == (home, "kv_hit")
    finally:
        stopped(routers)
