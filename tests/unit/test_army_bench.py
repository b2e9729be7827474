"""How the army benchmark decides what rate fedgate sustains, where its backlog sits, and how it
reports the brokers' memory per device."""

from __future__ import annotations

from typing import Any

from bench.army_bench import (
    BACKLOG_FLOOR,
    MEMORY_MODES,
    breakdown_per_device,
    carried,
    ceiling,
    connections,
    cpu_markdown,
    held_at,
    measure_memory,
    memory_markdown,
    memory_ratios,
    next_probe,
    next_step_up,
    per_core_at,
    steady,
    sustained,
    to_markdown,
    wait_settled,
)


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


# --- memory per device -------------------------------------------------------------------------


def test_a_fresh_nodes_memory_is_waited_for_until_it_stops_falling():
    mb = 1 << 20
    falling = iter([150 * mb, 146 * mb, 141 * mb, 137 * mb, 136 * mb, 136 * mb, 135.5 * mb, 135.5 * mb])
    sleeps: list[float] = []
    taken, settled = wait_settled(
        lambda: int(next(falling)), samples=3, within=mb, max_samples=60, sleep=sleeps.append
    )
    assert (taken, settled) == (6, True), "137, 136, 136 MB: within 1 MB over three samples"
    assert sleeps == [1.0] * 5, "a second apart"


def test_waiting_for_the_memory_to_settle_gives_up_after_the_most_samples():
    values = iter(range(100, 0, -5))
    taken, settled = wait_settled(
        lambda: next(values) << 20, samples=3, within=1 << 20, max_samples=4, sleep=lambda s: None
    )
    assert (taken, settled) == (4, False)


def memory_before() -> dict[str, Any]:
    return {
        "queue_procs": 18 * 1024,
        "connection_other": 500 * 1024,
        "other_proc": 16_000 * 1024,
        "strategy": "rss",
        "total": {"erlang": 60_000 * 1024, "rss": 120_000 * 1024, "allocated": 58_000 * 1024},
    }


def test_the_breakdown_per_device_is_what_each_category_grew_by_over_the_devices():
    peak = memory_before()
    peak["queue_procs"] += 2000 * 60 * 1024  # 60 KB per device: a classic queue process each
    peak["connection_other"] += 2000 * 10 * 1024
    peak["total"] = {**peak["total"], "rss": peak["total"]["rss"] + 2000 * 80 * 1024}
    per = breakdown_per_device(memory_before(), peak, 2000)
    assert per["queue_procs"] == 60.0 and per["connection_other"] == 10.0 and per["other_proc"] == 0.0
    assert per["total_rss"] == 80.0 and per["total_erlang"] == 0.0
    assert "strategy" not in per and "total" not in per, "only figures, flat"


def mode(kb: float, qos: int | None, *, devices: int = 2000, **extra: Any) -> dict[str, Any]:
    return {
        "command_qos": qos,
        "devices": devices,
        "connected": devices,
        "subscribed": 0 if qos is None else devices,
        "subscribe_refused": 0,
        "connect_per_s": 2400.0,
        "connect_ms": {"p50": 40.0, "p99": 300.0},
        "held_s": 5.0,
        "rss_mb_before": 130.0,
        "rss_mb_peak": 130.0 + kb * devices / 1024,
        "kb_per_device": kb,
        "kb_per_device_last": round(kb * 0.8, 1),
        **extra,
    }


def memory_results() -> dict[str, Any]:
    f = {
        "idle": mode(11.0, None, breakdown_kb_per_device={"connection_other": 8.1, "queue_procs": 0.0}),
        "qos0": mode(19.0, 0, breakdown_kb_per_device={"connection_other": 8.3, "queue_procs": 0.2}),
        "qos1": mode(89.0, 1, breakdown_kb_per_device={"connection_other": 8.2, "queue_procs": 60.4}),
    }
    b = {"idle": mode(2.0, None), "qos0": mode(2.5, 0), "qos1": mode(0.0, 1)}
    r: dict[str, Any] = {
        "fedgate": {"broker": "RabbitMQ 4.0.5", "memory": f},
        "baseline": {"broker": "Mosquitto 2.0.21", "memory": b},
    }
    r["ratios"] = memory_ratios(f, b)
    return r


def test_memory_ratios_are_fedgate_over_the_baseline_per_mode_and_none_without_a_figure():
    r = memory_results()
    assert set(MEMORY_MODES) == {"idle", "qos0", "qos1"}
    assert r["ratios"] == {
        "memory_per_device_idle_fedgate_vs_baseline": 5.5,
        "memory_per_device_qos0_fedgate_vs_baseline": 7.6,
        "memory_per_device_qos1_fedgate_vs_baseline": None,  # the baseline grew by nothing measurable
    }


def test_the_memory_table_names_both_brokers_each_mode_and_where_the_gateways_memory_goes():
    md = "\n".join(memory_markdown(memory_results()))
    assert "| fedgate (RabbitMQ 4.0.5 gateway) | baseline (Mosquitto 2.0.21) | fedgate / baseline |" in md
    assert "| idle (no subscription) | 8.8 KB (peak 11.0) | 1.6 KB (peak 2.0) | 5.5 |" in md
    assert "| QoS 0 command subscription | 15.2 KB (peak 19.0) | 2.0 KB (peak 2.5) | 7.6 |" in md
    assert "| QoS 1 command subscription | 71.2 KB (peak 89.0) | 0.0 KB (peak 0.0) | None |" in md
    # the breakdown: the categories that grew, the largest with the QoS 1 subscription first
    rows = [
        line
        for line in md.splitlines()
        if line.startswith("| queue_procs") or line.startswith("| connection_other")
    ]
    assert rows == ["| queue_procs | 0.0 | 0.2 | 60.4 |", "| connection_other | 8.1 | 8.3 | 8.2 |"]


def test_a_mode_that_fell_short_says_so_beside_its_figure():
    r = memory_results()
    r["fedgate"]["memory"]["qos1"].update(subscribed=1990, settled=False)
    r["baseline"]["memory"]["idle"]["connected"] = 1999
    md = "\n".join(memory_markdown(r))
    assert "| QoS 1 command subscription | 71.2 KB (peak 89.0) (1990 subscribed, RSS not settled) |" in md
    assert "| 1.6 KB (peak 2.0) (1999 connected) |" in md


def test_the_connect_figures_come_from_the_idle_mode():
    assert connections(mode(11.0, None)) == {
        "devices": 2000,
        "connected": 2000,
        "connect_per_s": 2400.0,
        "connect_ms": {"p50": 40.0, "p99": 300.0},
    }


def army_results() -> dict[str, Any]:
    r = memory_results()
    lat = {"p50": 4.0, "p99": 40.0}
    s = {
        **step(500, 503),
        "latency_ms": lat,
        "latency_all_ms": {"p50": 4.0, "p99": 900.0},
        "latency_p50_by_third_ms": [4.0, 4.0, 4.0],
    }
    down = {"sent": 1500, "received": 1500, "lost": 0, "latency_ms": lat}
    for name in ("fedgate", "baseline"):
        r[name].update(
            steps=[dict(s)],
            sustained_per_s=500,
            low_latency_per_s=500,
            latency_at_moderate_ms=lat,
            downlink=down,
            connections=connections(r[name]["memory"]["idle"]),
        )
    r["fedgate"]["steps"][0].update(
        backlog_peak={"devices": 10, "gateway_federation": 0, "backend_shards": 0},
        held_at=None,
        cpu_cores={"gateway": 0.5, "backend": 0.3},
    )
    r.update(
        quick=False,
        devices=500,
        step_s=15,
        machine={"cpus": 2},
        kafka_produce_raw_per_s=100_000,
        rabbitmq_mqtt_raw={"offered": 8000, "acked_per_s": 8000},
    )
    r["ratios"].update(
        sustained_fedgate_vs_baseline=1.0,
        low_latency_fedgate_vs_baseline=1.0,
        p99_latency_fedgate_vs_baseline=1.0,
        sustained_fedgate_vs_kafka_produce=0.005,
        sustained_fedgate_vs_rabbitmq_raw=0.06,
    )
    return r


def test_the_army_report_names_the_brokers_and_carries_the_memory_per_mode():
    md = to_markdown(army_results())
    assert md.startswith(
        "## Device army: fedgate (RabbitMQ 4.0.5) against Mosquitto 2.0.21 + a Python bridge (full)"
    )
    assert "| 2000 idle connections: connect rate | 2400.0/s | 2400.0/s | |" in md
    qos0 = "| broker memory per device, QoS 0 command subscription (fedgate's devices), settled |"
    assert f"{qos0} 15.2 KB | 2.0 KB | 7.6 |" in md
    assert "| QoS 0 command subscription | 15.2 KB (peak 19.0) | 2.0 KB (peak 2.5) | 7.6 |" in md


def test_no_breakdown_table_without_a_breakdown():
    r = memory_results()
    for m in r["fedgate"]["memory"].values():
        m.pop("breakdown_kb_per_device")
    assert "Where the gateway's memory goes" not in "\n".join(memory_markdown(r))


# --- each target driven to its own ceiling ------------------------------------------------------


def test_a_target_carrying_its_highest_step_is_offered_twice_that_up_to_the_most():
    steps = [step(2000, 2000), {**step(4000, 3990), "sent_per_s": 4001.0}]
    assert next_step_up(steps, 32_000) == 8000
    assert next_step_up(steps, 6000) is None, "8,000 is above the most offered"
    steps.append({**step(8000, 5100), "sent_per_s": 8000.0})
    assert next_step_up(steps, 32_000) is None, "8,000 not carried: its ceiling is below"


def test_no_step_up_when_the_army_could_not_offer_the_highest_step():
    short = {**step(8000, 7800), "sent_per_s": 7000.0}  # carried what it got, but 12% short
    assert next_step_up([step(4000, 4000), short], 32_000) is None


def test_the_ceiling_is_the_targets_only_when_the_army_offered_the_step_it_failed():
    assert ceiling([step(4000, 4000), {**step(8000, 5000), "sent_per_s": 8000.0}]) == {
        "ceiling": "target",
        "ceiling_offered": 8000,
    }
    assert ceiling([step(4000, 4000), {**step(8000, 5000), "sent_per_s": 5100.0}]) == {
        "ceiling": "army",
        "ceiling_offered": 8000,
    }, "the devices sent 5,100/s of 8,000: the load generator's limit, not the target's"
    assert ceiling([step(4000, 4000)])["ceiling"] == "not reached"


def test_readings_per_core_and_cpu_per_reading_are_reported_per_step_for_both_targets():
    s = {
        **step(2000, 2000),
        "sent_per_s": 2001.0,
        "cpu_cores": {"mosquitto": 0.1, "bridge": 0.3, "kafka": 0.1, "army": 0.4},
        "system_cores": 0.5,
        "per_core": 4000,
        "us_per_reading": {"mosquitto": 50.0, "bridge": 150.0, "kafka": 50.0, "army": 200.0},
    }
    assert per_core_at([s], 2000) == 4000 and per_core_at([s], 4000) is None
    md = "\n".join(cpu_markdown("baseline", [s], 2))
    assert "| offered/s | sent/s | mosquitto | bridge | kafka | army | system | readings/s per core |" in md
    assert "| 2000 | 2001.0 | 0.1 | 0.3 | 0.1 | 0.4 | 0.5 | 4000 | 50.0 | 150.0 | 50.0 |" in md


def test_the_devices_held_are_those_connected_at_the_end_not_those_planned(monkeypatch):
    """A run whose workers ended with 17,843 of 100,000 devices connected holds 17,843, and one
    that ended with none holds none: no per-device memory is made up from the plan."""
    from bench import army_bench
    from fedgate import army

    rss = iter([1000 * 2**20] + [1000 * 2**20 + 17_843 * 20 * 1024] * 10)
    monkeypatch.setattr(army_bench.processes, "rss_bytes", lambda pids: next(rss))

    def fleet(connected_at_end: dict[str, int]) -> Any:
        def run_fleet(target: Any, plan: Any, line: Any) -> dict[str, Any]:
            line("holding")
            conn = {"connected_at_end": connected_at_end, "connects": 49_527, "subscribed": 139}
            conn |= {"subscribe_refused": 0, "connect_per_s": None, "connect_ms": {}}
            up = {"sent": 0, "acked": 0, "lost": 0, "duplicated": 0, "latency_ms": {}}
            return {"connections": conn, "uplink": up}

        return run_fleet

    plan = army.ArmyPlan(devices=100_000, rate=0, duration_s=60)
    monkeypatch.setattr(army, "run_fleet", fleet({"local-eu": 17_843}))
    held = measure_memory(None, plan, lambda: [1])  # type: ignore[arg-type]
    assert held["held"] == 17_843 and held["devices"] == 100_000
    assert held["kb_per_device_last"] == 20.0, "the memory over the devices held"
    monkeypatch.setattr(army, "run_fleet", fleet({}))
    rss = iter([1000 * 2**20] * 10)
    none = measure_memory(None, plan, lambda: [1])  # type: ignore[arg-type]
    assert none["held"] == 0 and none["kb_per_device_last"] is None
