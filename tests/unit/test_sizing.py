"""The sizing model: per-hop costs fitted from the army's steps, their check, and fleets sized."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench import sizing


def step(rate: float, **cores: float) -> dict[str, Any]:
    return {"offered": int(rate), "acked_per_s": rate, "cpu_cores": {**cores, "army": 0.1 + rate / 10_000}}


def linear_steps() -> list[dict[str, Any]]:
    # gateway: 0.1 cores idle + 100 µs a reading; Kafka 0.2 idle + 20 µs; routers 80 µs, no idle cost
    return [
        step(r, gateway=0.1 + r * 100e-6, kafka=0.2 + r * 20e-6, routers=r * 80e-6) for r in (500, 1000, 2000)
    ]


def test_each_parts_cost_is_its_fixed_cores_and_its_cpu_per_reading_and_the_army_is_not_a_part():
    costs = sizing.fit_costs(linear_steps())
    assert set(costs) == {"gateway", "kafka", "routers"}, "the load generator is not the system"
    assert costs["gateway"].us_per_reading == pytest.approx(100, abs=0.1)
    assert costs["gateway"].fixed_cores == pytest.approx(0.1, abs=0.001)
    assert costs["kafka"].us_per_reading == pytest.approx(20, abs=0.1)
    assert costs["routers"].fixed_cores == pytest.approx(0, abs=0.001)
    assert costs["routers"].cores(4000) == pytest.approx(0.32, abs=0.001)


def test_noise_that_would_give_a_part_a_negative_fixed_cost_is_fitted_through_zero():
    steps = [step(500, backend=0.01), step(1000, backend=0.1), step(2000, backend=0.3)]
    c = sizing.fit_costs(steps)["backend"]
    assert c.fixed_cores == 0.0 and c.us_per_reading > 0
    assert sizing.fit_costs(steps[:1]) == {}, "one step is no line"
    # a JVM warming up: more CPU at the lower rate
    falling = sizing.fit_costs([step(200, kafka=0.44), step(400, kafka=0.34)])["kafka"]
    assert (falling.fixed_cores, falling.us_per_reading) == (0.39, 0.0), "fixed cost only"


def test_a_steps_own_cpu_per_reading_spreads_its_fixed_costs_over_it():
    s = step(1000, gateway=0.2)
    assert sizing.per_step_us(s)["gateway"] == 200.0
    assert sizing.system_cores(s) == 0.2, "the army's CPU is left out"


def test_the_models_check_predicts_the_highest_step_from_the_others():
    steps = [*linear_steps(), step(4000, gateway=0.1 + 0.4, kafka=0.2 + 0.08, routers=0.32 * 1.1)]
    k = sizing.check(steps)
    assert k is not None
    assert k["fitted_on"] == [500, 1000, 2000] and k["predicted_at"] == 4000
    assert k["predicted_cores"] == pytest.approx(1.1, abs=0.01)
    assert k["measured_cores"] == pytest.approx(1.132, abs=0.01)
    assert k["error"] == pytest.approx(1.1 / 1.132 - 1, abs=0.01), "the routers cost 10% more at 4,000"
    assert sizing.check(linear_steps()[:2]) is None, "two steps: nothing left to check against"


def test_a_fleet_is_sized_from_the_costs_memory_per_device_and_the_ha_factors():
    costs = sizing.fit_costs(linear_steps())
    fleet = sizing.size_fleet(
        1_000_000, costs, gateway_kb_per_device=30.0, gateway_base_mb=150, backend_base_mb=900
    )
    assert fleet["readings_per_s"] == 100_000
    region = fleet["per_region"]
    assert region["devices"] == 333_333 and region["readings_per_s"] == 33_333
    # 0.1 + 33,333 x 100 µs = 3.43 cores, x 1.9 for three replicas of the quorum queue
    assert region["cores"] == pytest.approx(6.5, abs=0.1)
    # 333,333 x 30 KB = 9.5 GB + three nodes' base
    assert region["memory_gb"] == pytest.approx(9.5 + 3 * 150 / 1024, abs=0.1)
    assert region["nodes"] == sizing.MIN_NODES
    # backend: Kafka (0.2 + 2 cores) x 2.7 + routers 8 cores x 1.5
    assert fleet["backend"]["cores"] == pytest.approx(2.2 * 2.7 + 8 * 1.5, abs=0.1)
    assert fleet["backend"]["nodes"] == math.ceil(fleet["backend"]["cores"] / (sizing.NODE_CORES * 0.5))
    assert fleet["kafka_disk_tb"] > 0


def test_the_model_sizes_each_fleet_and_its_markdown_says_the_assumptions():
    m = sizing.model(linear_steps(), 28.0, gateway_base_mb=150, backend_base_mb=900)
    assert [f["devices"] for f in m["fleets"]] == list(sizing.FLEETS)
    cores = [f["per_region"]["cores"] for f in m["fleets"]]
    assert cores == sorted(cores) and cores[-1] > 10 * cores[0] * 0.9, (
        "ten times the fleet, ~ten times the cores"
    )
    # the upper bound: every reading at the highest step's average cost (its fixed share included)
    top = m["fleets"][1]["at_average"]["per_region"]
    assert m["average_at"] == 2000 and top["cores"] > m["fleets"][1]["per_region"]["cores"]
    md = "\n".join(sizing.to_markdown(m))
    assert "| gateway | 100.0 | 0.1 | 3 |" in md
    assert "| 1,000,000 | 100,000 |" in md and "on average at 2000/s" in md
    assert "1 reading per 10 s per device, 3 regions" in md
    assert sizing.model(linear_steps(), None, 0, 0)["fleets"] == [], "no memory figure: no fleet sized"


def test_with_one_step_carried_no_cost_is_fitted_and_the_model_says_why():
    """A busy machine may carry one step of the quick run's two (the other's p99 over 2 s)."""
    m = sizing.model(linear_steps()[:1], 28.0, gateway_base_mb=150, backend_base_mb=900)
    assert m["costs"] == {} and m["fleets"] == []
    assert m["why_not"] == "1 step(s) carried: fitting each hop's cost takes two"
    assert "Per-hop cost: not fitted (1 step(s) carried" in "\n".join(sizing.to_markdown(m))
