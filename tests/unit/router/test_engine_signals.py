"""The router's pure rules for engine replicas: which idle replicas sleep (``sleeping.idle``), which level a vLLM
replica sleeps at, and the ``kv`` policy's queue term from an engine's own ``/metrics`` (``Candidate.load``)."""

from __future__ import annotations

from preheat.router.index import KVIndex, PrefixIndex
from preheat.router.policies import Candidate, KVAware, LoadGuard
from preheat.router.sleeping import Idle, idle, vllm_level
from preheat.router.upstream import Replica


def test_the_longest_idle_replicas_sleep_first_and_keep_stay_in_rotation() -> None:
    replicas = [
        Idle("busy", True, 1, 0.0, True),  # a request in flight: never
        Idle("recent", True, 0, 95.0, True),  # idle 5 s of the 60 needed
        Idle("old", True, 0, 10.0, True),
        Idle("older", True, 0, 0.0, True),
        Idle("mute", True, 0, 0.0, False),  # speaks no sleep protocol
        Idle("down", False, 0, 0.0, True),  # out of rotation already
    ]
    assert idle(replicas, now=100.0, after=60.0, keep=3) == ["older", "old"]
    assert idle(replicas, now=100.0, after=60.0, keep=4) == ["older"]
    assert idle(replicas, now=100.0, after=60.0, keep=5) == []


def test_a_vllm_replicas_level_is_its_gauges_then_the_routers_then_two() -> None:
    replica = Replica("http://v:1")
    assert vllm_level(replica, None) == 2  # unknown: a reload is never wrong
    replica.sleep_level = 1
    assert vllm_level(replica, None) == 1
    assert vllm_level(replica, "discard_all") == 2
    assert vllm_level(replica, "weights_offloaded") == 1


def test_an_engines_own_queue_replaces_what_its_events_do_not_carry() -> None:
    policy = KVAware(KVIndex(), LoadGuard(), PrefixIndex())
    # 1 in flight through this router; vLLM says 3 running and 4 waiting: 6 requests of someone else's, 2 s each.
    engine = Candidate("v", 1, 2.0, finished=0, load=(3, 4), load_finished=0)
    assert policy.queue(engine, (0, 0), 0).others == 6
    # Requests of this router that finished since the scrape are no longer in its queue.
    assert policy.queue(Candidate("v", 1, 2.0, finished=2, load=(3, 4), load_finished=0), (0, 0), 0).others == 4
    # Unknown: only this router's own requests count.
    assert policy.queue(Candidate("v", 1, 2.0), (0, 0), 0).others == 0
