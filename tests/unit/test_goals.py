"""Each performance goal is read from a run's results, with its ratio, and says when it was not measured."""

from __future__ import annotations

from typing import Any

from bench.goals import goals, to_markdown


def army(**baseline: Any) -> dict[str, Any]:
    fedgate_steps = [
        {"offered": 2000, "latency_ms": {"p99": 50.0}},
        {"offered": 4000, "latency_ms": {"p99": 900.0}},
    ]
    return {
        "fedgate": {
            "steps": fedgate_steps,
            "sustained_per_s": 3000,
            "per_core_at_sustained": 2000,
            "memory": {"qos0": {"kb_per_device_last": 27.3, "devices": 4000}},
        },
        "baseline": {
            "steps": [],
            "sustained_per_s": 6000,
            "per_core_at_sustained": 4000,
            "ceiling": "target",
            "ceiling_offered": 8000,
            **baseline,
        },
        "sizing": {"check": {"error": -0.1}},
    }


def by_goal(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["goal"].split(",")[0].split(":")[0]: r for r in rows}


def test_every_goal_has_its_ratio_and_whether_it_was_met():
    rows = by_goal(goals({"army": army(), "router": {"router_bridged_per_s": 7500.0}}))
    assert rows["sustained QoS 1 rate"]["ratio"] == 0.5 and rows["sustained QoS 1 rate"]["met"] is False
    assert rows["fedgate's p99 at 2000/s"]["ratio"] == 0.5, "50 ms against 25"
    assert rows["gateway memory per connected device with its command subscription"]["met"] is True
    assert rows["router"]["ratio"] == 0.25 and rows["router"]["measured"] == "7500.0/s"
    assert rows["the baseline driven to its own ceiling"]["met"] is True
    assert rows["per-hop CPU µs per reading and the sizing model"]["met"] is True, "10% off, within 25%"


def test_a_ceiling_the_army_set_is_not_the_baselines_and_an_unmeasured_figure_is_not_met():
    a = army(ceiling="army")
    a["fedgate"]["steps"] = a["fedgate"]["steps"][1:]  # no 2,000/s step
    rows = by_goal(goals({"army": a}))
    assert rows["the baseline driven to its own ceiling"]["met"] is False
    assert rows["fedgate's p99 at 2000/s"]["met"] is None
    assert "router" not in rows, "the router benchmark did not run"
    md = to_markdown(list(rows.values()), quick=False)
    assert "| fedgate's p99 at 2000/s | <= 25 ms | not measured | None | not measured |" in md
