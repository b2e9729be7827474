"""What a reading costs each hop of fedgate's uplink, and what a fleet would need: the sizing model.

Built from one army run's steps (bench/army_bench.py), where the CPU of
each part of the federation was read from /proc over each step:

- **per-hop cost** (`fit_costs`): for each part, the cores it used against
  the readings acknowledged per second, over the steps it carried, fitted
  to a line: `cores = fixed + rate * µs/reading`.  The slope is what one
  more reading costs (the marginal CPU µs), the intercept what the part
  costs with no readings (timers, heartbeats, Kafka's idle broker).  Each
  step's own average (cores / rate, fixed costs included) is reported too.
- **the model's check** (`check`): fitted on every carried step but the
  highest, the line predicts the highest step's cores; the error says how
  far it can be trusted to extrapolate.
- **sizing** (`size_fleet`): cores, memory and nodes per region and for the
  backend at 1 reading per 10 s per device, for 100k, 1M and 10M devices,
  from the fitted costs, the gateway's memory per device and the HA
  profile's CPU factors.  Every assumption is a named constant below,
  printed beside the result.

The parts are OS processes (gateway node, backend node, routers, Kafka): a
reading's federation link costs the gateway (the link's queue, its
consumer) and the backend (the link's publisher, the uplink shard
queues); /proc cannot split a node's CPU between them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

#: Where each part runs: a region's gateway cluster, or the backend (RabbitMQ, routers, Kafka).
REGION_PARTS = ("gateway",)
BACKEND_PARTS = ("backend", "routers", "kafka")

#: The fleets the model sizes, each device sending one reading every READING_INTERVAL_S.
FLEETS = (100_000, 1_000_000, 10_000_000)
READING_INTERVAL_S = 10.0
#: Regions the fleet is spread over, evenly.
REGIONS = 3
#: The machine a node runs on (a common 8 vCPU / 32 GiB cloud instance).
NODE_CORES = 8
NODE_MEMORY_GB = 32.0
#: Headroom: a node is sized to run at most this share of its cores and memory in steady state,
#: so that a node's failure (its devices reconnecting to the others) and bursts fit.
CPU_UTILISATION = 0.5
MEMORY_UTILISATION = 0.6
#: Three nodes of each engine: RabbitMQ quorum queues and Kafka's replication need three.
MIN_NODES = 3
#: CPU of the HA profile over the single one at the same rate (bench/ha_bench.py, 2026-11-24, 250
#: readings/s: gateway cluster 0.56 against one node's 0.29, Kafka 3 brokers with replication 3
#: 0.61 against 0.23, backend cluster 0.21 against 0.21, routers 0.24 against 0.16; docs/benchmarks.md
#: "The HA profile's cost").  A reading is replicated to every node of a quorum queue or partition.
HA_CPU_FACTOR = {"gateway": 1.9, "backend": 1.0, "routers": 1.5, "kafka": 2.7}
#: A Kafka record of a reading on disk (111 B JSON + key + headers + batch overhead, lz4) and how
#: long Kafka keeps it.
KAFKA_BYTES_PER_READING = 160
KAFKA_RETENTION_DAYS = 7
KAFKA_REPLICATION = 3


@dataclass
class HopCost:
    """A part's CPU as a line over the readings/s it carried."""

    fixed_cores: float
    us_per_reading: float
    steps: int

    def cores(self, rate: float) -> float:
        return self.fixed_cores + rate * self.us_per_reading / 1e6


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares: (intercept, slope)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0, my / mx if mx else 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def fit_costs(steps: list[dict[str, Any]]) -> dict[str, HopCost]:
    """Each part's cost line from steps (each with acked_per_s and cpu_cores), at least two.
    No part is modelled as costing less than nothing: a part whose CPU fell as the rate rose
    (its fixed costs, e.g. a JVM's warm-up, larger than what the readings added) is taken as
    fixed cost only, and a negative intercept (noise at low rates) as none, the line refitted
    through the origin."""
    usable = [s for s in steps if s.get("cpu_cores") and s["acked_per_s"] > 0]
    if len(usable) < 2:
        return {}
    names = [p for p in usable[0]["cpu_cores"] if p != "army"]
    out = {}
    for part in names:
        pts = [(s["acked_per_s"], s["cpu_cores"][part]) for s in usable]
        fixed, slope = _line(pts)
        if slope < 0:
            fixed, slope = sum(y for _, y in pts) / len(pts), 0.0
        elif fixed < 0:
            fixed = 0.0
            slope = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
        out[part] = HopCost(round(fixed, 3), round(slope * 1e6, 1), len(pts))
    return out


def per_step_us(step: dict[str, Any]) -> dict[str, float]:
    """A step's CPU µs per reading acknowledged, per part (its fixed costs spread over it)."""
    rate = step["acked_per_s"]
    return {p: round(c * 1e6 / rate, 1) for p, c in (step.get("cpu_cores") or {}).items() if rate > 0}


def system_cores(step: dict[str, Any]) -> float:
    """Cores the system used in a step: every part but the load generator (the army)."""
    return round(sum(v for k, v in (step.get("cpu_cores") or {}).items() if k != "army"), 3)


def check(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Fit on every step but the highest, predict the highest: the model's extrapolation error."""
    usable = sorted((s for s in steps if s.get("cpu_cores")), key=lambda s: s["acked_per_s"])
    if len(usable) < 3:
        return None
    *fit_on, last = usable
    costs = fit_costs(fit_on)
    predicted = sum(c.cores(last["acked_per_s"]) for c in costs.values())
    measured = system_cores(last)
    return {
        "fitted_on": [s["offered"] for s in fit_on],
        "predicted_at": last["offered"],
        "predicted_cores": round(predicted, 2),
        "measured_cores": round(measured, 2),
        "error": round(predicted / measured - 1, 3) if measured else None,
    }


@dataclass
class Tier:
    cores: float
    memory_gb: float
    nodes: int


def _nodes(cores: float, memory_gb: float) -> int:
    return max(
        MIN_NODES,
        math.ceil(cores / (NODE_CORES * CPU_UTILISATION)),
        math.ceil(memory_gb / (NODE_MEMORY_GB * MEMORY_UTILISATION)),
    )


def size_fleet(
    devices: int,
    costs: dict[str, HopCost],
    gateway_kb_per_device: float,
    gateway_base_mb: float,
    backend_base_mb: float,
) -> dict[str, Any]:
    """Cores, memory and nodes of one region's gateway cluster and of the backend for a fleet."""
    rate = devices / READING_INTERVAL_S
    region_rate, region_devices = rate / REGIONS, devices / REGIONS

    def cores(parts: tuple[str, ...], r: float) -> float:
        return sum(costs[p].cores(r) * HA_CPU_FACTOR[p] for p in parts if p in costs)

    gw_cores = cores(REGION_PARTS, region_rate)
    gw_memory = region_devices * gateway_kb_per_device / 2**20 + MIN_NODES * gateway_base_mb / 1024
    region = Tier(round(gw_cores, 1), round(gw_memory, 1), _nodes(gw_cores, gw_memory))
    be_cores = cores(BACKEND_PARTS, rate)
    be_memory = MIN_NODES * backend_base_mb / 1024
    backend = Tier(round(be_cores, 1), round(be_memory, 1), _nodes(be_cores, be_memory))
    kafka_tb = rate * 86400 * KAFKA_RETENTION_DAYS * KAFKA_BYTES_PER_READING * KAFKA_REPLICATION / 1e12
    return {
        "devices": devices,
        "readings_per_s": round(rate),
        "per_region": {
            "readings_per_s": round(region_rate),
            "devices": round(region_devices),
            **asdict(region),
        },
        "backend": asdict(backend),
        "kafka_disk_tb": round(kafka_tb, 1),
    }


def assumptions() -> dict[str, Any]:
    return {
        "reading_interval_s": READING_INTERVAL_S,
        "regions": REGIONS,
        "node": f"{NODE_CORES} cores, {NODE_MEMORY_GB:g} GB",
        "cpu_utilisation": CPU_UTILISATION,
        "memory_utilisation": MEMORY_UTILISATION,
        "min_nodes": MIN_NODES,
        "ha_cpu_factor": HA_CPU_FACTOR,
        "kafka": f"{KAFKA_BYTES_PER_READING} B a reading, {KAFKA_RETENTION_DAYS} days, "
        f"replication {KAFKA_REPLICATION}",
    }


def model(
    steps: list[dict[str, Any]],
    gateway_kb_per_device: float | None,
    gateway_base_mb: float,
    backend_base_mb: float,
) -> dict[str, Any]:
    """The per-hop costs of fedgate's carried steps, their check, and the fleets sized from them."""
    costs = fit_costs(steps)
    # the other bound: every reading costing what one cost on average at the highest step carried
    # (its share of the fixed costs included), as if nothing batched better at higher rates
    top = max(steps, key=lambda s: s["acked_per_s"], default=None)
    average = {p: HopCost(0.0, us, 1) for p, us in per_step_us(top).items() if p in costs} if top else {}
    out: dict[str, Any] = {
        "costs": {p: asdict(c) for p, c in costs.items()},
        "average_at": top["offered"] if top else None,
        "check": check(steps),
        "assumptions": assumptions(),
        "fleets": [],
    }
    if not costs:
        # a busy machine may carry one step of the quick run's two (its p99 over 2 s)
        out["why_not"] = f"{len(steps)} step(s) carried: fitting each hop's cost takes two"
    if costs and gateway_kb_per_device:
        for n in FLEETS:
            fleet = size_fleet(n, costs, gateway_kb_per_device, gateway_base_mb, backend_base_mb)
            upper = size_fleet(n, average, gateway_kb_per_device, gateway_base_mb, backend_base_mb)
            fleet["at_average"] = {"per_region": upper["per_region"], "backend": upper["backend"]}
            out["fleets"].append(fleet)
    return out


def to_markdown(m: dict[str, Any]) -> list[str]:
    costs, lines = m["costs"], []
    if not costs:
        return ["", f"Per-hop cost: not fitted ({m['why_not']})."] if m.get("why_not") else lines
    lines += [
        "",
        "Per-hop cost, fitted over fedgate's carried steps (cores = fixed + rate x µs per reading):",
        "",
        "| part | CPU µs per reading (marginal) | fixed cores | steps |",
        "|---|---:|---:|---:|",
    ]
    for part, c in costs.items():
        lines.append(f"| {part} | {c['us_per_reading']} | {c['fixed_cores']} | {c['steps']} |")
    total = round(sum(c["us_per_reading"] for c in costs.values()), 1)
    fixed = round(sum(c["fixed_cores"] for c in costs.values()), 2)
    lines.append(f"| **all parts** | **{total}** | {fixed} | |")
    if m["check"]:
        k = m["check"]
        lines += [
            "",
            f"The model's check: fitted on {', '.join(map(str, k['fitted_on']))}/s, it predicts "
            f"{k['predicted_cores']} cores at {k['predicted_at']}/s; measured {k['measured_cores']} "
            f"(error {k['error']:+.1%}).",
        ]
    if m["fleets"]:
        a = m["assumptions"]
        lines += [
            "",
            f"Sizing at 1 reading per {a['reading_interval_s']:g} s per device, {a['regions']} regions, "
            f"nodes of {a['node']} run at most {a['cpu_utilisation']:.0%} CPU and "
            f"{a['memory_utilisation']:.0%} memory, at least {a['min_nodes']} nodes per cluster, the HA "
            f"profile's CPU factors {a['ha_cpu_factor']}; Kafka {a['kafka']}. "
            f"Cores and nodes from the fitted line, and in brackets if every reading cost what one did "
            f"on average at {m.get('average_at')}/s (the upper bound):",
            "",
            "| devices | readings/s | per region: cores / memory / nodes "
            "| backend: cores / memory / nodes | Kafka disk |",
            "|---:|---:|---|---|---:|",
        ]
        for f in m["fleets"]:
            r, b = f["per_region"], f["backend"]
            ur, ub = (
                (f.get("at_average") or {}).get("per_region", r),
                (f.get("at_average") or {}).get("backend", b),
            )
            lines.append(
                f"| {f['devices']:,} | {f['readings_per_s']:,} "
                f"| {r['cores']} ({ur['cores']}) / {r['memory_gb']} GB / {r['nodes']} ({ur['nodes']}) "
                f"| {b['cores']} ({ub['cores']}) / {b['memory_gb']} GB / {b['nodes']} ({ub['nodes']}) "
                f"| {f['kafka_disk_tb']} TB |"
            )
    return lines
