"""The performance goals (docs/benchmarks.md, "Where the goals stand"), read from one run.

A goal is fedgate's figure, its target, the ratio of the two in the
direction that says "met" at 1.0 or more, and whether it was met; beside
it the published figure it is held against (its anchor) and what the
baseline (Mosquitto and its bridge into the same Kafka) measured in the
same run.  A goal whose benchmark did not run, or whose figure the run
could not measure, says so instead of passing.
"""

from __future__ import annotations

from typing import Any

#: fedgate's p99 at this offered rate is held to P99_TARGET_MS.
P99_AT = 2000
P99_TARGET_MS = 50.0
#: QoS 1 readings/s carried with nothing lost and a p99 under 2 s, the army on this machine.
SUSTAINED_PER_S = 8_000.0
GATEWAY_KB_PER_DEVICE = 30.0
ROUTER_MSGS_PER_S = 30_000.0
#: devices connected to one region at once (`BENCH=scale`).
SCALE_DEVICES = 100_000
#: the tables at a trickle (`BENCH=spark`, its full run at 300 readings/s)
SPARK_STEADY_CORES = 0.2
SPARK_FRESHNESS_P95_MS = 5000.0
SPARK_IDLE_CORES = 0.05
#: the job's backlog ingest, of one warm Spark batch query doing the same work
SPARK_INGEST_OF_BATCH = 0.8

#: The field's published figures each goal is read beside (CPU per reading is CPU% x cores /
#: readings per second); docs/benchmarks.md names their sources.
ANCHORS = {
    "cpu": "EMQX 5.1 into Kafka ~243 µs a reading, all in; TBMQ ~224",
    "sustained": "EMQX 5.1 into Kafka: 100,000 QoS 1/s on 32 cores at 76 % (~4,100/s a busy core)",
    "router": "librdkafka < 5 µs a record; a RabbitMQ 4.0 quorum queue ~43 µs a publish and consume",
    "none": "-",
}


def _row(
    goal: str, target: str, anchor: str, measured: Any, baseline: str, ratio: float | None
) -> dict[str, Any]:
    return {
        "goal": goal,
        "target": target,
        "anchor": ANCHORS[anchor],
        "measured": measured,
        "baseline": baseline,
        "ratio": None if ratio is None else round(ratio, 3),
        "met": None if ratio is None else ratio >= 1.0,
    }


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _p99_at(side: dict[str, Any], rate: int) -> float | None:
    at = next((s for s in side.get("steps", []) if s["offered"] == rate), None)
    return at["latency_ms"]["p99"] if at else None


def goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cost = results.get("cost")
    for g in (cost or {}).get("goals", []):
        rows.append(
            _row(
                f"the whole federation's CPU at {g['rate']}/s, warm (gateway, backend, routers, Kafka)",
                f"<= {g['goal_cores']} cores ({g['goal_cores'] * 1e6 / g['rate']:,.0f} µs a reading)",
                "cpu",
                f"{g['fedgate_cores']} cores, {g['fedgate_us']} µs a reading"
                + (f", {g['lost']} lost" if g.get("lost") else ""),
                f"{g['baseline_cores']} cores, {g['baseline_us']} µs a reading",
                0.0 if g.get("lost") else g["ratio_to_goal"],  # cheap by losing is not met
            )
        )
    army = results.get("army")
    if army is not None:
        f, b = army["fedgate"], army["baseline"]
        # the baseline's figure is its own only if a step it did not carry was offered in full
        ceiling = (
            "its ceiling"
            if b.get("ceiling") == "target"
            else f"the army's ceiling ({b.get('ceiling_offered')}/s)"
        )
        rows.append(
            _row(
                "sustained QoS 1 rate, nothing lost (the army on the same two cores)",
                f">= {SUSTAINED_PER_S:,.0f}/s",
                "sustained",
                f"{f.get('sustained_per_s')}/s ({f.get('per_core_at_sustained')}/s a core used)",
                f"{b.get('sustained_per_s')}/s ({b.get('per_core_at_sustained')}/s a core used; {ceiling})",
                _div(f.get("sustained_per_s"), SUSTAINED_PER_S),
            )
        )
        p99, base_p99 = _p99_at(f, P99_AT), _p99_at(b, P99_AT)
        rows.append(
            _row(
                f"p99 from a device's publish to its reading in Kafka at {P99_AT}/s",
                f"<= {P99_TARGET_MS:g} ms",
                "none",
                f"{p99} ms" if p99 is not None else "not measured",
                f"{base_p99} ms" if base_p99 is not None else "not measured",
                _div(P99_TARGET_MS, p99) if p99 is not None and p99 > 0 else None,
            )
        )
        fm, bm = ((side.get("memory") or {}).get("qos0") or {} for side in (f, b))
        kb = fm.get("kb_per_device_last")
        rows.append(
            _row(
                "gateway memory per connected device with its command subscription",
                f"<= {GATEWAY_KB_PER_DEVICE:g} KB",
                "none",
                f"{kb} KB ({fm.get('devices')} devices)" if kb is not None else "not measured",
                f"{bm.get('kb_per_device_last')} KB" if bm else "not measured",
                _div(GATEWAY_KB_PER_DEVICE, kb) if kb and kb > 0 else None,
            )
        )
    router = results.get("router")
    if router is not None:
        # the readings as the gateways send them (batched, the default); one a message beside
        batched = router.get("router_batched") or {}
        rows.append(
            _row(
                "router: device readings/s per process, ack after Kafka",
                f">= {ROUTER_MSGS_PER_S:,.0f}",
                "router",
                f"{batched.get('per_s')}/s in batches of {batched.get('readings_per_batch')} "
                f"({router.get('router_bridged_per_s')}/s one a message)",
                "-",
                _div(batched.get("per_s"), ROUTER_MSGS_PER_S),
            )
        )
    scale = results.get("scale")
    if scale is not None:
        held = scale.get("held") or {}
        uplink = held.get("uplink") or {}
        down = held.get("downlink") or {}
        nodes = (scale.get("cluster") or {}).get("nodes_running")
        # held, and every reading in Kafka and every command of the sample delivered
        whole = not uplink.get("lost") and down.get("sent") and not down.get("lost")
        rows.append(
            _row(
                "devices connected to one region at once, every reading counted in Kafka",
                f">= {SCALE_DEVICES:,}",
                "none",
                f"{held.get('held')} held of {scale.get('devices_wanted')} on {nodes} gateway node(s) "
                f"({held.get('connect_per_s')} connects/s; readings lost {uplink.get('lost')}; "
                f"commands {down.get('received')}/{down.get('sent')}, lost {down.get('lost')})",
                "-",
                _div(held.get("held"), SCALE_DEVICES) if whole else 0.0,
            )
        )
    spark = results.get("spark")
    if spark is not None:
        rows += _spark_goals(spark)
    ha = results.get("ha")
    if ha is not None:
        rows += _ha_goals(ha)
    return rows


def _spark_goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The tables' goals at a trickle (docs/benchmarks.md, "Spark"): the job's CPU and the
    rows' freshness at a steady rate, its CPU idle, its backlog ingest against one warm Spark
    batch query doing the same work (that reference in the baseline's column)."""
    steady, idle = r["steady"], r["idle"]
    rate = f"{steady['rate_per_s']:g} readings/s"
    p95 = steady.get("freshness_p95_ms")
    return [
        _row(
            f"the Spark job's CPU at a steady {rate}",
            f"<= {SPARK_STEADY_CORES} cores",
            "none",
            f"{steady['job_cpu_cores']} cores (its first minutes: {r['first_minutes']['job_cpu_cores']})",
            "-",
            _div(SPARK_STEADY_CORES, steady["job_cpu_cores"]),
        ),
        _row(
            f"a row queryable after its device sent it, p95 at {rate}",
            f"<= {SPARK_FRESHNESS_P95_MS:,.0f} ms",
            "none",
            f"{p95} ms (p50 {steady.get('freshness_p50_ms')}, max {steady.get('freshness_max_ms')})",
            "-",
            _div(SPARK_FRESHNESS_P95_MS, p95),
        ),
        _row(
            f"the Spark job's CPU idle ({idle['seconds']:g} s without a reading)",
            f"<= {SPARK_IDLE_CORES} cores",
            "none",
            f"{idle['job_cpu_cores']} cores",
            "-",
            # an idle job at 0.00 cores (below /proc's resolution) meets it
            SPARK_IDLE_CORES / max(idle["job_cpu_cores"], 0.001),
        ),
        _row(
            "the job's backlog ingest (rows/s landed in every table, exactly once)",
            f">= {SPARK_INGEST_OF_BATCH} of a warm Spark batch query",
            "none",
            f"{r['ingest']['all_tables_rows_per_s']:,}/s ({r['job_vs_spark_batch']} of it)",
            f"{r['spark_batch_per_s']:,}/s (the batch query, as Parquet)",
            _div(r["job_vs_spark_batch"], SPARK_INGEST_OF_BATCH),
        ),
    ]


def _ha_goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The HA profile's goals (docs/benchmarks.md, "The HA profile's cost"), the single
    profile's figure in the baseline's column."""
    from bench import ha_bench

    s, h, cpu = r["single"], r["ha"], r["cpu"]
    hc, sc = h["downlink"], s["downlink"]
    p99, twice = hc["latency_ms"]["p99"], hc["duplicated"]
    mixed = f"{h['mixed']['commands_per_s']} commands/s beside {h['mixed']['readings_per_s']} readings/s"
    return [
        _row(
            f"HA profile: sustained QoS 1, nothing lost, p99 under {ha_bench.SUSTAINED_P99_MS:g} ms",
            f">= {ha_bench.SUSTAINED_PER_S:,}/s",
            "none",
            ha_bench.sustained_text(h["sustained_fast_per_s"]),
            f"single profile {ha_bench.sustained_text(s['sustained_fast_per_s'])}",
            _div(h["sustained_fast_per_s"], ha_bench.SUSTAINED_PER_S) or 0.0,
        ),
        _row(
            "HA profile: the engines' CPU at a step both profiles carried, of the single profile's",
            f"<= {ha_bench.CPU_VS_SINGLE:g}x",
            "none",
            f"{cpu['ha_vs_single']}x at {cpu['offered']}/s ({cpu['ha_cores']} cores)",
            f"single profile {cpu['single_cores']} cores",
            _div(ha_bench.CPU_VS_SINGLE, cpu["ha_vs_single"]),
        ),
        _row(
            f"HA profile: command p99 from send to device, {mixed}, none sent twice",
            f"<= {ha_bench.COMMAND_P99_MS:g} ms",
            "none",
            f"{p99} ms, {hc['received']}/{hc['sent']} delivered, {twice} twice, {hc['lost']} lost",
            f"single profile {sc['latency_ms']['p99']} ms, {sc['received']}/{sc['sent']}",
            0.0 if twice or hc["lost"] else _div(ha_bench.COMMAND_P99_MS, p99),
        ),
        _fault_goal(h.get("faults")),
    ]


def _fault_goal(f: dict[str, Any] | None) -> dict[str, Any]:
    """Commands and readings through a node of each engine SIGKILLed in turn (bench/ha_faults.py)."""
    from bench import ha_bench

    goal = "HA profile: command p99 through a node of each engine SIGKILLed in turn, nothing lost"
    target = f"<= {ha_bench.FAULT_COMMAND_P99_MS:,.0f} ms"
    if f is None:
        return _row(goal, target, "none", "not measured", "-", None)
    d = f["commands"]
    p99 = d["latency_ms"]["p99"]
    lost = f["lost"] + d["lost"]
    return _row(
        goal,
        target,
        "none",
        f"{p99} ms; readings {f['lost']} lost of {f['acked']:,}, commands {d['lost']} lost of {d['sent']}",
        "-",
        0.0 if lost or p99 is None else _div(ha_bench.FAULT_COMMAND_P99_MS, p99),
    )


def to_markdown(rows: list[dict[str, Any]], quick: bool) -> str:
    lines = [
        f"# Goals ({'quick: figures only say that every path works' if quick else 'full'})",
        "",
        "| goal | target | anchor (published) | fedgate | baseline | ratio (>= 1 meets it) | met |",
        "|---|---|---|---|---|---:|---|",
    ]
    for g in rows:
        met = {True: "yes", False: "**no**", None: "not measured"}[g["met"]]
        lines.append(
            f"| {g['goal']} | {g['target']} | {g['anchor']} | {g['measured']} | {g['baseline']} "
            f"| {g['ratio']} | {met} |"
        )
    return "\n".join(lines) + "\n"
