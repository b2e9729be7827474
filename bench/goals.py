"""The performance goals (docs/benchmarks.md, "Goals"), each read from one `make bench` run's results.

A goal is a figure, its target, the ratio of the two in the direction
that says "met" at 1.0 or more, and whether it was met; a goal whose
benchmark did not run, or whose figure the run could not measure, says so
instead of passing.
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


def _row(goal: str, target: str, measured: Any, ratio: float | None) -> dict[str, Any]:
    return {
        "goal": goal,
        "target": target,
        "measured": measured,
        "ratio": None if ratio is None else round(ratio, 3),
        "met": None if ratio is None else ratio >= 1.0,
    }


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    army = results.get("army")
    if army is not None:
        f, b = army["fedgate"], army["baseline"]
        rows.append(
            _row(
                "the baseline driven to its own ceiling",
                "a step the army offered in full that the baseline did not carry",
                f"{b.get('ceiling')} ({b.get('ceiling_offered')}/s)",
                1.0 if b.get("ceiling") == "target" else 0.0,
            )
        )
        rows.append(
            _row(
                "sustained QoS 1 rate, nothing lost",
                f">= {SUSTAINED_PER_S:,.0f}/s",
                f"{f.get('sustained_per_s')}/s",
                _div(f.get("sustained_per_s"), SUSTAINED_PER_S),
            )
        )
        rows.append(
            _row(
                "sustained QoS 1 rate, nothing lost, fedgate / baseline",
                ">= 1.0",
                f"{f.get('sustained_per_s')}/s against {b.get('sustained_per_s')}/s",
                _div(f.get("sustained_per_s"), b.get("sustained_per_s")),
            )
        )
        at = next((s for s in f["steps"] if s["offered"] == P99_AT), None)
        p99 = at["latency_ms"]["p99"] if at else None
        rows.append(
            _row(
                f"fedgate's p99 at {P99_AT}/s",
                f"<= {P99_TARGET_MS:g} ms",
                f"{p99} ms" if p99 is not None else "not measured",
                _div(P99_TARGET_MS, p99) if p99 is not None and p99 > 0 else None,
            )
        )
        rows.append(
            _row(
                "readings/s per core the system used at the sustained rate, fedgate / baseline",
                ">= 1.0",
                f"{f.get('per_core_at_sustained')} against {b.get('per_core_at_sustained')}",
                _div(f.get("per_core_at_sustained"), b.get("per_core_at_sustained")),
            )
        )
        qos0 = (f.get("memory") or {}).get("qos0") or {}
        kb = qos0.get("kb_per_device_last")
        rows.append(
            _row(
                "gateway memory per connected device with its command subscription",
                f"<= {GATEWAY_KB_PER_DEVICE:g} KB",
                f"{kb} KB ({qos0.get('devices')} devices)" if kb is not None else "not measured",
                _div(GATEWAY_KB_PER_DEVICE, kb) if kb and kb > 0 else None,
            )
        )
        model = army.get("sizing") or {}
        check = model.get("check") or {}
        rows.append(
            _row(
                "per-hop CPU µs per reading and the sizing model, checked against a measured step",
                "the model within 25% of the measured cores",
                f"error {check.get('error')}" if check else "not enough carried steps",
                _div(0.25, abs(check["error"])) if check.get("error") else (1.0 if check else None),
            )
        )
    cost = results.get("cost")
    for g in (cost or {}).get("goals", []):
        rows.append(
            _row(
                f"the whole federation's CPU at {g['rate']}/s, warm (gateway, backend, routers, Kafka)",
                f"<= {g['goal_cores']} cores",
                f"{g['fedgate_cores']} cores, {g['fedgate_us']} µs a reading (baseline: "
                f"{g['baseline_cores']} cores, {g['baseline_us']} µs)",
                g["ratio_to_goal"],
            )
        )
    router = results.get("router")
    if router is not None:
        # the readings as the gateways send them (batched, the default); one a message beside
        batched = router.get("router_batched") or {}
        rate = router.get("router_bridged_per_s")
        rows.append(
            _row(
                "router: device readings/s per process, ack after Kafka",
                f">= {ROUTER_MSGS_PER_S:,.0f}",
                f"{batched.get('per_s')}/s in batches of {batched.get('readings_per_batch')} "
                f"({rate}/s one a message)",
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
                f"{held.get('held')} held of {scale.get('devices_wanted')} on {nodes} gateway node(s) "
                f"({held.get('connect_per_s')} connects/s; readings lost {uplink.get('lost')}; "
                f"commands {down.get('received')}/{down.get('sent')}, lost {down.get('lost')})",
                _div(held.get("held"), SCALE_DEVICES) if whole else 0.0,
            )
        )
    return rows


def to_markdown(rows: list[dict[str, Any]], quick: bool) -> str:
    lines = [
        f"# Goals ({'quick: figures only say that every path works' if quick else 'full'})",
        "",
        "| goal | target | measured | ratio (>= 1 meets it) | met |",
        "|---|---|---|---:|---|",
    ]
    for g in rows:
        met = {True: "yes", False: "**no**", None: "not measured"}[g["met"]]
        lines.append(f"| {g['goal']} | {g['target']} | {g['measured']} | {g['ratio']} | {met} |")
    return "\n".join(lines) + "\n"
