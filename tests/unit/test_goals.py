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
            "steps": [{"offered": 2000, "latency_ms": {"p99": 12.0}}],
            "sustained_per_s": 6000,
            "memory": {"qos0": {"kb_per_device_last": 2.6, "devices": 4000}},
            "per_core_at_sustained": 4000,
            "ceiling": "target",
            "ceiling_offered": 8000,
            **baseline,
        },
    }


def by_goal(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["goal"].split(",")[0].split(":")[0]: r for r in rows}


def test_every_goal_has_its_ratio_its_anchor_and_the_baselines_figure():
    router = {"router_bridged_per_s": 7500.0, "router_batched": {"readings_per_batch": 50, "per_s": 36000.0}}
    rows = by_goal(goals({"army": army(), "router": router}))
    sustained = rows["sustained QoS 1 rate"]
    assert sustained["ratio"] == 0.375 and sustained["met"] is False, "3,000/s against 8,000"
    assert sustained["baseline"] == "6000/s (4000/s a core used; its ceiling)"
    assert "EMQX 5.1 into Kafka" in sustained["anchor"], "held beside the field's published figure"
    p99 = rows["p99 from a device's publish to its reading in Kafka at 2000/s"]
    assert p99["ratio"] == 1.0 and p99["met"], "50 ms"
    assert p99["baseline"] == "12.0 ms"
    memory = rows["gateway memory per connected device with its command subscription"]
    assert memory["met"] is True and memory["baseline"] == "2.6 KB"
    # the readings as gateways send them, in batches, are the router's goal
    assert rows["router"]["ratio"] == 1.2 and rows["router"]["met"] is True
    assert rows["router"]["measured"] == "36000.0/s in batches of 50 (7500.0/s one a message)"
    assert "librdkafka" in rows["router"]["anchor"]


def test_a_ceiling_the_army_set_is_named_and_an_unmeasured_figure_is_not_met():
    a = army(ceiling="army")
    a["fedgate"]["steps"] = a["fedgate"]["steps"][1:]  # no 2,000/s step
    rows = by_goal(goals({"army": a}))
    assert (
        rows["sustained QoS 1 rate"]["baseline"] == "6000/s (4000/s a core used; the army's ceiling (8000/s))"
    )
    p99 = "p99 from a device's publish to its reading in Kafka at 2000/s"
    assert rows[p99]["met"] is None
    assert "router" not in rows, "the router benchmark did not run"
    md = to_markdown(list(rows.values()), quick=False)
    assert f"| {p99} | <= 50 ms | - | not measured | 12.0 ms | None | not measured |" in md


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
    assert at500["met"] is False and at500["baseline"] == "0.35 cores, 700.0 µs a reading"
    assert at500["target"] == "<= 0.35 cores (700 µs a reading)"
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


def test_the_ha_fault_goal_fails_on_any_loss_and_is_not_measured_without_its_run():
    from bench.goals import _fault_goal

    def faults(p99: float, readings_lost: int = 0, commands_lost: int = 0) -> dict:
        latency = {"p50": 20.0, "p95": 90.0, "p99": p99, "max": p99}
        commands = {
            "sent": 100,
            "received": 100,
            "lost": commands_lost,
            "duplicated": 0,
            "latency_ms": latency,
        }
        return {"acked": 5_000, "lost": readings_lost, "commands": commands}

    assert _fault_goal(faults(1_000.0))["met"] is True
    assert _fault_goal(faults(1_000.0))["ratio"] == 5.0
    assert _fault_goal(faults(6_000.0))["met"] is False, "slower than 5 s at p99"
    assert _fault_goal(faults(10.0, readings_lost=1))["ratio"] == 0.0, "a reading lost"
    assert _fault_goal(faults(10.0, commands_lost=1))["ratio"] == 0.0, "a command lost"
    assert _fault_goal(None)["met"] is None, "a run without the fault sequence"


def spark(**steady: Any) -> dict[str, Any]:
    return {
        "steady": {
            "rate_per_s": 300.0,
            "job_cpu_cores": 0.28,
            "freshness_p50_ms": 2269,
            "freshness_p95_ms": 3927,
            "freshness_max_ms": 6176,
            **steady,
        },
        "first_minutes": {"job_cpu_cores": 0.52},
        "idle": {"seconds": 60.0, "job_cpu_cores": 0.0},
        "ingest": {"all_tables_rows_per_s": 23170},
        "spark_batch_per_s": 32701,
        "job_vs_spark_batch": 0.709,
    }


def test_the_tables_goals_at_a_trickle_are_read_from_the_spark_run():
    rows = by_goal(goals({"spark": spark()}))
    cores = rows["the Spark job's CPU at a steady 300 readings/s"]
    assert cores["ratio"] == 0.714 and cores["met"] is False, "0.28 cores against 0.2"
    fresh = rows["a row queryable after its device sent it"]
    assert fresh["ratio"] == 1.273 and fresh["met"] is True, "p95 3,927 ms against 5,000"
    idle = rows["the Spark job's CPU idle (60 s without a reading)"]
    assert idle["met"] is True, "an idle job below /proc's resolution meets its goal"
    ingest = rows["the job's backlog ingest (rows/s landed in every table"]
    assert ingest["ratio"] == 0.886 and ingest["met"] is False, "0.709 of the batch against 0.8"
    assert ingest["baseline"] == "32,701/s (the batch query, as Parquet)"


def test_a_freshness_the_run_could_not_measure_is_not_met():
    row = by_goal(goals({"spark": spark(freshness_p95_ms=None)}))["a row queryable after its device sent it"]
    assert row["ratio"] is None and row["met"] is None
