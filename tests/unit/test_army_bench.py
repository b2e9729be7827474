"""How the army benchmark decides what rate fedgate sustains, and where its backlog sits."""

from __future__ import annotations

from typing import Any

from bench.army_bench import BACKLOG_FLOOR, carried, held_at, next_probe, sustained


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
    assert held_at({"devices": 900, "gateway_federation": 120, "backend_shards": 30_000}) == "backend_shards"
    assert held_at({"devices": BACKLOG_FLOOR - 1, "gateway_federation": 0, "backend_shards": 5}) is None
