"""The fleet simulator: hand-checked small cases, and the properties an operator relies on."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.core.errors import ConfigError
from preheat.plan.coldstart import ColdStart
from preheat.plan.simulate import PRESETS, Policy, SimSettings, parse_policy, simulate
from preheat.plan.traces import TraceArrays

# provision 100 + image 10 + start 0 + download 50 + load 20 + warmup 0: 180 s on a new node
COLD = ColdStart(
    {"provision": 100.0, "image": 10.0, "start": 0.0, "download": 50.0, "load": 20.0, "warmup": 0.0, "other": 0.0}
)
# 1 ms per prompt token, 10 ms per generated token, $3600/h = $1 per second: costs read as seconds
SPEED = SimSettings(
    prefill_ms_per_token=1.0, decode_ms_per_token=10.0, slots=1, gpu_cost_per_hour=3600.0, target_utilization=1.0
)


def _trace(*rows: tuple[float, int, int]) -> TraceArrays:
    return TraceArrays.from_columns([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def test_scale_to_zero_makes_the_first_request_wait_for_a_whole_cold_start() -> None:
    result = simulate(_trace((0.0, 1000, 100)), COLD, Policy("s2z", idle_timeout_s=5.0), SPEED)
    assert result.ttft.tolist() == pytest.approx([180.0 + 1.0])
    assert result.cold_starts == 1
    assert result.requests_queued == 1
    # billed from the ask (t=0) to the last completion (180 + 1 + 1 = 182 s): the horizon, the replica still up
    assert result.horizon_s == pytest.approx(182.0)
    assert result.cost == pytest.approx(182.0)
    assert result.idle_cost == pytest.approx(180.0)


def test_a_warm_replica_answers_at_prefill_speed() -> None:
    result = simulate(_trace((0.0, 1000, 100)), COLD, Policy("warm", min_replicas=1), SPEED)
    assert result.ttft.tolist() == pytest.approx([1.0])
    assert result.cold_starts == 0


def test_each_pattern_shortens_the_stage_it_targets() -> None:
    trace = _trace((0.0, 100, 1))
    ttft = {
        name: float(simulate(trace, COLD, policy, SPEED).ttft[0])
        for name, policy in {
            "plain": Policy("plain"),
            "cache": Policy("cache", node_cache=True),  # no download: 180 - 50
            "quant": Policy("quant", quantized=True),  # (50 + 20) / 2 saved
            "pool": Policy("pool", warm_pool=1),  # no provisioning: 180 - 100
        }.items()
    }
    assert ttft == pytest.approx({"plain": 180.1, "cache": 130.1, "quant": 145.1, "pool": 80.1})


def test_requests_queue_behind_a_busy_replica() -> None:
    # one slot; the second request waits for the first to finish (1 s prefill + 1 s decode)
    result = simulate(
        _trace((0.0, 1000, 100), (0.5, 1000, 100)), COLD, Policy("w", min_replicas=1, max_replicas=1), SPEED
    )
    assert result.ttft.tolist() == pytest.approx([1.0, 2.0 - 0.5 + 1.0])


def test_an_idle_replica_stops_after_the_timeout_and_the_next_request_pays_a_cold_start() -> None:
    trace = _trace((0.0, 1000, 100), (1000.0, 1000, 100))
    result = simulate(trace, COLD, Policy("s2z", idle_timeout_s=60.0), SPEED)
    assert result.cold_starts == 2
    assert result.ttft.tolist() == pytest.approx([181.0, 181.0])
    # two replicas billed: 0..(182 + 60) and 1000..1182
    assert result.cost == pytest.approx(242.0 + 182.0)


def test_warm_pool_nodes_are_paid_for_all_the_time_and_spot_is_cheaper() -> None:
    trace = _trace((0.0, 1000, 100), (0.0, 1000, 100))
    pool = simulate(trace, COLD, Policy("pool", warm_pool=1, max_replicas=2), SPEED)
    # two replicas asked for: one on the pool node (ready at 80 s), one on a new node (ready at 180 s); the pool
    # replica serves both (the second after the first's 2 s) before the new node is up, yet it is billed
    assert sorted(pool.ttft.tolist()) == pytest.approx([81.0, 83.0])
    assert pool.cold_starts == 2
    spot = simulate(trace, COLD, Policy("spot", warm_pool=1, spot_burst=True, max_replicas=2), SPEED)
    assert spot.cost < pool.cost
    assert pool.accelerator_hours * 3600 == pytest.approx(pool.horizon_s + pool.horizon_s)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 3600), st.integers(0, 4000), st.integers(0, 500)), min_size=1, max_size=80),
    st.sampled_from(sorted(PRESETS)),
    st.integers(1, 4),
    st.floats(0, 600),
)
def test_every_request_is_served_exactly_once(
    rows: list[tuple[float, int, int]], preset: str, slots: int, idle: float
) -> None:
    policy = parse_policy(f"{preset}:idle={idle},max=3")
    result = simulate(_trace(*rows), COLD, policy, SimSettings(slots=slots))
    assert result.served.tolist() == [1] * len(rows)
    assert not np.isnan(result.ttft).any()
    assert (result.ttft >= 0).all()
    assert result.idle_cost <= result.cost + 1e-9
    assert result.peak_replicas <= 3


@pytest.mark.parametrize("preset", ["warm-replicas", "node-cache", "quantized"])
def test_cost_rises_with_min_replicas_when_the_trace_is_idle(preset: str) -> None:
    trace = _trace((0.0, 100, 10), (3 * 3600.0, 100, 10))  # two requests three hours apart
    costs = [simulate(trace, COLD, parse_policy(f"{preset}:min={n}"), SPEED).cost for n in range(4)]
    assert costs == sorted(costs)
    assert costs[0] < costs[-1]


def test_policy_text_is_checked() -> None:
    assert parse_policy("mine:min=2,max=5,cache,spot,pool=1") == Policy(
        "mine:min=2,max=5,cache,spot,pool=1",
        min_replicas=2,
        max_replicas=5,
        node_cache=True,
        spot_burst=True,
        warm_pool=1,
    )
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        parse_policy("mine:colour")
    with pytest.raises(ConfigError, match="min=x"):
        parse_policy("mine:min=x")
    with pytest.raises(ConfigError, match="min"):
        parse_policy("mine:min=9,max=2")


def test_headroom_starts_a_replica_before_the_slots_run_out() -> None:
    trace = _trace((0.0, 1000, 100), (0.1, 1000, 100), (0.2, 1000, 100))
    settings = SimSettings(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, slots=4)
    full = simulate(trace, COLD, Policy("w", min_replicas=1), replace(settings, target_utilization=1.0))
    assert full.cold_starts == 0
    headroom = simulate(trace, COLD, Policy("w", min_replicas=1), replace(settings, target_utilization=0.5))
    assert headroom.cold_starts == 1  # 3 requests > 4 slots x 50%: a second replica is asked for
    assert headroom.ttft.tolist() == full.ttft.tolist()  # the first replica still served them all at once


def test_a_standby_replica_starts_after_its_activation_only_and_is_billed_all_along() -> None:
    # COLD with a start phase: a standby replica has done provision, image and start; it pays download + load.
    cold = ColdStart({**COLD.phases, "start": 5.0, "warmup": 1.0})
    trace = _trace((0.0, 100, 1))
    standby = simulate(trace, cold, Policy("standby", standby=1), SPEED)
    assert standby.ttft.tolist() == pytest.approx([50.0 + 20.0 + 1.0 + 0.1])
    assert standby.cold_start_s["standby"] == pytest.approx(71.0)
    cached = simulate(trace, cold, Policy("standby-cache", standby=1, node_cache=True), SPEED)
    assert cached.ttft.tolist() == pytest.approx([20.0 + 1.0 + 0.1])
    # Billed like a warm pool node: the standby node for the whole horizon, the replica on it not again.
    assert cached.cost == pytest.approx(cached.horizon_s)
    assert parse_policy("mine:standby=3,cache").standby == 3
    with pytest.raises(ConfigError):
        Policy("bad", standby=-1)
