"""What a reading costs: each part's CPU at a steady rate, warm, beside the baseline's.

The yardstick of "A reading costs what the field's best pay for it": the
cores the whole uplink uses (gateway, backend, both routers, Kafka) while
the same 500 devices offer 500 and 2,000 QoS 1 readings/s, and the same for
the single-broker baseline (bench/baseline.py: Mosquitto, a Python bridge,
the same Kafka and the router's producer settings) in the same run.

Unlike the army benchmark's first steps, these are measured warm: a
freshly started Kafka spends as much CPU compiling its hot paths (the
JVM's C2 compiler) as serving the first minute's records (at 2,000/s on a
broker two minutes old: 4.5 of its 9.1 CPU s over 20 s went to C2), which
would be charged to the first step's readings.  Each target is first driven
at the top rate for `WARMUP_S`, and each step is long enough (`STEP_S`) for
a second's sampling to be a small error.  The federation's idle cost (no
devices, nothing flowing) is measured too, so that what a reading wakes can
be told from what the federation costs anyway.

Goals (issue "A reading costs what the field's best pay for it"):
the whole federation <= 0.35 cores at 500/s and <= 0.6 cores (300 µs a
reading) at 2,000/s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench import sizing
from bench.army_bench import BASELINE_PORT_OFFSET, StepSampler, _brief, _plan, _subset
from bench.baseline import Baseline
from bench.router_bench import progress
from fedgate import army
from infra.local.driver import LocalFederation

#: Offered readings/s, each a step of its own for each target.
RATES = {"full": [500, 2000], "quick": [200]}
#: Seconds of traffic in a step (the first WARMUP of the army's own is left out of its latency).
STEP_S = {"full": 30, "quick": 3}
#: Seconds each target runs at the top rate before anything is measured (quick: none).
WARMUP_S = {"full": 45, "quick": 0}
#: Seconds the idle federation is sampled.
IDLE_S = {"full": 20, "quick": 2}
DEVICES = {"full": 500, "quick": 100}
#: The goals: the whole federation's cores at each rate.
GOAL_CORES = {500: 0.35, 2000: 0.6}

#: The federation as a fleet meets it: both routers; the Spark job would only take CPU.
SERVICES = {"routers": True, "spark": False}


def _step(
    target: army.Target, sampler: StepSampler, devices: int, rate: int, seconds: float, quick: bool
) -> dict[str, Any]:
    sampler.start()
    try:
        r = army.run_fleet(
            _subset(target, devices),
            _plan(devices, quick, rate=rate, duration_s=seconds, prefix="cost"),
        )
    finally:
        sampler.stop.set()
        sampler.join()
    row = {"offered": rate, **_brief(r), "cpu_cores": sampler.cpu_cores()}
    for k in ("latency_cdf_ms", "latency_p50_by_third_ms", "commands", "connect_ms"):
        row.pop(k, None)
    row["system_cores"] = sizing.system_cores(row)
    row["us_per_reading"] = sizing.per_step_us(row)
    row["system_us_per_reading"] = (
        round(row["system_cores"] * 1e6 / row["acked_per_s"], 1) if row["acked_per_s"] else None
    )
    return row


def idle_cores(sampler: StepSampler, seconds: float) -> dict[str, float]:
    """Each part's cores with nothing connected and nothing flowing."""
    sampler.start()
    time.sleep(seconds)
    sampler.stop.set()
    sampler.join()
    return sampler.cpu_cores()


def run(fed: LocalFederation, workdir: Path, quick: bool = False) -> dict[str, Any]:
    mode = "quick" if quick else "full"
    devices, rates, step_s = DEVICES[mode], RATES[mode], STEP_S[mode]
    results: dict[str, Any] = {
        "quick": quick,
        "devices": devices,
        "step_s": step_s,
        "warmup_s": WARMUP_S[mode],
        "machine": {"cpus": os.cpu_count()},
        "fedgate": {"steps": []},
        "baseline": {"steps": []},
    }
    ep = fed.endpoints()
    fed_target = army.federation_target(fed, _plan(devices, quick, prefix="cost"), progress)
    with Baseline(
        workdir,
        fed.settings.port_base + BASELINE_PORT_OFFSET,
        ep["kafka"]["bootstrap"],
        fed.settings.cache_dir,
    ) as baseline:
        targets = {"fedgate": fed_target, "baseline": baseline.target(fed_target.specs)}

        def sampler(name: str) -> StepSampler:
            return StepSampler.fedgate(fed) if name == "fedgate" else StepSampler.baseline(baseline, fed)

        if WARMUP_S[mode]:
            for name, target in targets.items():
                progress(
                    f"{name}: warming up at {rates[-1]} readings/s for {WARMUP_S[mode]} s (not measured)"
                )
                _step(target, sampler(name), devices, rates[-1], WARMUP_S[mode], quick)
        # warm, and after the warm-up's last records are through (Kafka's log flushes, the JIT)
        for name in targets:
            progress(f"{name}: idle for {IDLE_S[mode]} s")
            results[name]["idle_cores"] = idle_cores(sampler(name), IDLE_S[mode])
        for rate in rates:
            for name, target in targets.items():
                progress(f"{name}: {devices} devices offering {rate} readings/s for {step_s} s")
                row = _step(target, sampler(name), devices, rate, step_s, quick)
                results[name]["steps"].append(row)
                progress(
                    f"{name} at {rate}/s: {row['system_cores']} cores, {row['system_us_per_reading']} µs a "
                    f"reading, {row['lost']} lost, p99 {row['latency_ms'].get('p99')} ms"
                )
    results["goals"] = goal_rows(results)
    return results


def at(steps: list[dict[str, Any]], rate: int) -> dict[str, Any] | None:
    return next((s for s in steps if s["offered"] == rate), None)


def goal_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per goal rate: fedgate's system cores against the goal, and against the baseline's."""
    rows = []
    for rate, goal in GOAL_CORES.items():
        f, b = at(r["fedgate"]["steps"], rate), at(r["baseline"]["steps"], rate)
        if f is None:
            continue
        cores = f["system_cores"]
        rows.append(
            {
                "rate": rate,
                "goal_cores": goal,
                "fedgate_cores": cores,
                "fedgate_us": f["system_us_per_reading"],
                "lost": f["lost"],
                "baseline_cores": b["system_cores"] if b else None,
                "baseline_us": b["system_us_per_reading"] if b else None,
                "ratio_to_goal": round(goal / cores, 3) if cores else None,
                "ratio_to_baseline": round(b["system_cores"] / cores, 3) if b and cores else None,
            }
        )
    return rows


def _cores_table(name: str, steps: list[dict[str, Any]], idle: dict[str, float]) -> list[str]:
    if not steps:
        return []
    parts = [p for p in steps[0]["cpu_cores"] if p != "army"]
    lines = [
        "",
        f"{name}: cores of each part (and CPU µs per reading acknowledged), the army apart:",
        "",
        "| offered/s | acked/s | lost | p50 / p99 ms | "
        + " | ".join(parts)
        + " | system | µs a reading | army |",
        "|---:|---:|---:|---|" + "---:|" * (len(parts) + 3),
        "| idle | | | | "
        + " | ".join(str(idle.get(p, "")) for p in parts)
        + f" | {round(sum(idle.get(p, 0) for p in parts), 3)} | | |",
    ]
    for s in steps:
        c, us, lat = s["cpu_cores"], s["us_per_reading"], s["latency_ms"]
        lines.append(
            f"| {s['offered']} | {s['acked_per_s']} | {s['lost']} | {lat.get('p50')} / {lat.get('p99')} | "
            + " | ".join(f"{c[p]} ({us.get(p, '')})" for p in parts)
            + f" | {s['system_cores']} | {s['system_us_per_reading']} | {c.get('army')} |"
        )
    return lines


def to_markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# What a reading costs ({'quick' if r['quick'] else 'full'})",
        "",
        f"{r['devices']} devices, QoS 1, {r['step_s']} s a step after {r['warmup_s']} s at the top rate "
        f"for each target (the JVMs warm); {r['machine']['cpus']} cores shared by everything.",
        "",
        "| rate/s | goal | fedgate cores (µs a reading) | baseline cores (µs a reading) | goal / fedgate | "
        "baseline / fedgate | lost |",
        "|---:|---:|---|---|---:|---:|---:|",
    ]
    for g in r["goals"]:
        lines.append(
            f"| {g['rate']} | <= {g['goal_cores']} | {g['fedgate_cores']} ({g['fedgate_us']}) | "
            f"{g['baseline_cores']} ({g['baseline_us']}) | {g['ratio_to_goal']} | {g['ratio_to_baseline']} | "
            f"{g['lost']} |"
        )
    lines += _cores_table("fedgate", r["fedgate"]["steps"], r["fedgate"].get("idle_cores") or {})
    lines += _cores_table("baseline", r["baseline"]["steps"], r["baseline"].get("idle_cores") or {})
    return "\n".join(lines) + "\n"
