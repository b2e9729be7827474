"""How the army benchmark decides what rate fedgate sustains, and where its backlog sits."""

from __future__ import annotations

from typing import Any

from bench.army_bench import BACKLOG_FLOOR, carried, held_at, next_probe, steady, sustained


def step(offered: int, acked: float, *, lost: int = 0, p99: float = 50.0) -> dict[str, Any]:
    return {"offered": offered, "acked_per_s": acked, "lost": lost, "latency_ms": {"p99": p99}}


def test_a_step_is_carried_only_with_nothing_lost_95_percent_acked_and_p99_under_2_s():
    assert carried(step(1000, 990))
    assert not carried(step(1000, 990, lost=1)), "one reading lost"
    assert not carried(step(1000, 900)), "10% short of the offered rate"
    assert not carried(step(1000, 1000, p99=2500)), "p99 over 2 s"


def test_the_sustained_rate_is_the_highest_step_carried():
    steps = [step(500, 500), step(1000, 1000), step(2000, 1990), step(4000, 2700)]
    assert sustained(steps) == 2000
    assert sustained(steps, p99_ms=40) is None, "p99 50 ms: none carried under 40 ms"
    assert sustained([step(500, 100)]) is None


def test_the_ceiling_is_bisected_between_the_last_step_carried_and_the_first_not_carried():
    steps = [step(500, 500), step(1000, 1000), step(2000, 1990), step(4000, 2700)]
    assert next_probe(steps, resolution=500) == 3000
    steps.append(step(3000, 2600))
    assert next_probe(steps, resolution=500) == 2500
    steps.append(step(2500, 2490))
    assert next_probe(steps, resolution=500) is None, "2,500 carried, 3,000 not: within the resolution"


def test_no_probe_when_every_step_was_carried():
    assert next_probe([step(500, 500), step(4000, 4000)], resolution=500) is None


def test_the_backlog_is_named_where_the_most_readings_wait_and_nowhere_below_the_floor():
    queued = {"devices": 900, "gateway_federation": 120, "backend_shards": 30_000}
    assert held_at(queued, 1000) == "backend_shards"
    assert held_at({"devices": BACKLOG_FLOOR - 1, "gateway_federation": 0, "backend_shards": 5}, 100) is None
    # 1,300 readings in flight at 4,000/s is a third of a second of load: on their way, not queued
    assert held_at({"devices": 1300, "gateway_federation": 40, "backend_shards": 100}, 4000) is None
    assert held_at({"devices": 1300, "gateway_federation": 40, "backend_shards": 100}, 2000) == "devices"


def test_a_step_whose_latency_grows_through_it_is_a_queue_building_up_not_carried():
    growing = {**step(3000, 3020, p99=1480), "latency_p50_by_third_ms": [650.0, 1200.0, 1750.0]}
    assert not carried(growing), "p99 under 2 s, but the queue grows: a longer step would exceed it"
    flat = {**step(2000, 2010, p99=205), "latency_p50_by_third_ms": [30.0, 41.0, 36.0]}
    assert carried(flat)
    assert steady([None, None, None]), "too few readings to tell"
