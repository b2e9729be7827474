"""Each performance goal is read from a run's results, with its ratio, and says when it was not measured."""

from __future__ import annotations

from typing import Any

from bench import cost_bench
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
    router = {"router_bridged_per_s": 7500.0, "router_batched": {"readings_per_batch": 50, "per_s": 36000.0}}
    rows = goals({"army": army(), "router": router})
    absolute, against_baseline = (r for r in rows if r["goal"].startswith("sustained QoS 1 rate"))
    assert absolute["ratio"] == 0.375 and absolute["met"] is False, "3,000/s against 8,000"
    assert against_baseline["ratio"] == 0.5 and against_baseline["met"] is False, "3,000/s against 6,000"
    rows = by_goal(rows)
    assert rows["fedgate's p99 at 2000/s"]["ratio"] == 1.0 and rows["fedgate's p99 at 2000/s"]["met"], "50 ms"
    assert rows["gateway memory per connected device with its command subscription"]["met"] is True
    # the readings as gateways send them, in batches, are the router's goal
    assert rows["router"]["ratio"] == 1.2 and rows["router"]["met"] is True
    assert rows["router"]["measured"] == "36000.0/s in batches of 50 (7500.0/s one a message)"
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
    assert "| fedgate's p99 at 2000/s | <= 50 ms | not measured | None | not measured |" in md


def cost_step(rate: int, cores: float, lost: int = 0) -> dict[str, Any]:
    return {"offered": rate, "system_cores": cores, "system_us_per_reading": cores * 1e6 / rate, "lost": lost}


def test_the_federations_cpu_per_rate_is_held_to_its_goal_beside_the_baseline():
    r = {
        "fedgate": {"steps": [cost_step(500, 0.7), cost_step(2000, 0.5)]},
        "baseline": {"steps": [cost_step(500, 0.35), cost_step(2000, 0.6)]},
    }
    g = {row["rate"]: row for row in cost_bench.goal_rows(r)}
    assert g[500]["ratio_to_goal"] == 0.5 and g[500]["ratio_to_baseline"] == 0.5, "0.35 of 0.7 cores"
    assert g[2000]["ratio_to_goal"] == 1.2 and g[2000]["fedgate_us"] == 250.0
    rows = by_goal(goals({"cost": {"goals": list(g.values())}}))
    at500 = rows["the whole federation's CPU at 500/s"]
    assert at500["met"] is False and "baseline: 0.35 cores" in at500["measured"]
    assert rows["the whole federation's CPU at 2000/s"]["met"] is True


def scale(held: int, lost: int, commands_lost: int = 0, commands: int = 3000) -> dict[str, Any]:
    return {
        "devices_wanted": 100_000,
        "cluster": {"nodes_running": 6},
        "held": {
            "held": held,
            "connect_per_s": 450.0,
            "uplink": {"sent": held, "acked": held - lost, "lost": lost},
            "downlink": {"sent": commands, "received": commands - commands_lost, "lost": commands_lost},
        },
    }


def test_a_region_holds_its_hundred_thousand_devices_only_if_nothing_is_lost():
    goal = "devices connected to one region at once"
    row = by_goal(goals({"scale": scale(60_000, 0)}))[goal]
    assert row["ratio"] == 0.6 and row["met"] is False and "60000 held of 100000" in row["measured"]
    assert "on 6 gateway node(s)" in row["measured"]
    assert by_goal(goals({"scale": scale(100_000, 0)}))[goal]["met"]
    lossy = by_goal(goals({"scale": scale(100_000, 3)}))[goal]
    assert lossy["met"] is False and "readings lost 3" in lossy["measured"]
    commands_lost = by_goal(goals({"scale": scale(100_000, 0, commands_lost=2)}))[goal]
    assert commands_lost["met"] is False and "commands 2998/3000, lost 2" in commands_lost["measured"]
    no_commands = by_goal(goals({"scale": scale(100_000, 0, commands=0)}))[goal]
    assert no_commands["met"] is False, "a sample of the devices gets commands"
