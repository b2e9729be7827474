"""The device army against fedgate and against the single-broker baseline, side by side.

One run, one machine, the same devices and offered load for both targets:

fedgate   devices -> gateway -> federation -> backend -> two routers -> Kafka
baseline  devices -> one Mosquitto broker -> a plain Python bridge -> Kafka (bench/baseline.py;
          Mosquitto 2.0 from Debian 13, the release the gateway's RabbitMQ 4.0 comes from)

Every figure is counted by the army (fedgate/army/): readings the
broker acknowledged are looked up in Kafka, commands the next hop
confirmed are looked up on the devices.  Scenarios:

- **sustained QoS 1 rate**: offered load in steps; per step the rate
  acknowledged, what was lost, the device -> Kafka latency.  The highest
  step carried with nothing lost, at least 95% of the offered rate and a
  p99 under 2 s is the sustained rate;
- **latency** at a moderate rate (the first step);
- **memory per device**: the broker's resident memory per connected
  device, in three modes -- idle (no subscription), with a QoS 0 and with a
  QoS 1 command subscription -- each on a fresh broker (the gateway node
  restarted, a new Mosquitto), and the connect rate of idle devices; for the
  gateway also RabbitMQ's memory breakdown, to say where it goes;
- **downlink**: commands/s through fedgate's router and straight into
  Mosquitto, with their latency.

Physical references in the same run: Python producing to Kafka with the
router's settings (router_bench.kafka_produce), and MQTT QoS 1 publishing
into one RabbitMQ node with nothing consuming (the backend stopped, so the
gateway only stores; not counted against Kafka).

Results: bench/results/army-<stamp>.json and .md, and PNG plots
(throughput and latency against offered load, the latency CDF at the
moderate rate) in bench/results/; a full
run also puts them in docs/img/ for docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from backend import contract as c
from backend.rabbitmq_admin import AdminError, RabbitAdmin, prometheus_queue_messages
from bench import sizing
from bench.baseline import Baseline, Mosquitto, mosquitto_target
from bench.router_bench import cpu_seconds, kafka_produce, progress
from fedgate import army
from infra.local import processes
from infra.local.broker import debian13_runtime
from infra.local.driver import LocalFederation
from infra.local.nodes import ROLE_ROUTER, RabbitNode
from infra.local.settings import PROJECT_ROOT

#: The baseline broker's port, beside the bench federation's block (the next one: the fresh
#: Mosquitto of each memory mode).
BASELINE_PORT_OFFSET = 600
SUSTAINED_P99_MS = 2000.0
#: The second headline: the highest rate carried with a p99 a person would not notice.
LOW_LATENCY_P99_MS = 250.0
STEADY_SLACK_MS = 100.0
#: Extra steps that narrow the ceiling down once a step was not carried.
CEILING_PROBES = 2
#: The offered load in steps, then doubled for a target while it carries its highest step, up
#: to MAX_OFFERED, so that each target, the baseline included, is driven to its own ceiling.
RATES = {"full": [500, 1000, 2000, 4000], "quick": [200, 400]}
MAX_OFFERED = {"full": 32_000, "quick": 400}
#: A step whose devices sent less than this share of its offered load measured the army, not the
#: target: the ceiling it sets is the load generator's.
OFFERED_IN_FULL = 0.95


#: Left out of each step's latency percentiles: the devices have just connected, and the
#: router is still taking their presence events (the whole run's figures are kept as well).
#: The quick run's steps are short, and its figures only say that every path works.
WARMUP_S = {"full": 3.0, "quick": 1.0}
#: How long each run waits for a duplicate after the drain.
SETTLE_S = {"full": 3.0, "quick": 1.0}

#: The broker's memory per connected device, by what each device holds: nothing, or a command
#: subscription of either QoS (fedgate's devices hold QoS 0 and acknowledge; on RabbitMQ 4.0 a QoS 1
#: subscription is a classic queue process, a QoS 0 one a queue type without a process).
MEMORY_MODES: dict[str, int | None] = {"idle": None, "qos0": 0, "qos1": 1}
MEMORY_MODE_TEXT = {
    "idle": "idle (no subscription)",
    "qos0": "QoS 0 command subscription",
    "qos1": "QoS 1 command subscription",
}
#: How long the devices stay connected while the broker's memory is sampled (once a second).
#: The headline figure is the last sample: by then the garbage of the connect burst (in the
#: peak) is collected, and what is left is what a connected device costs (settled).
MEMORY_HOLD_S = {"full": 30.0, "quick": 2.0}
#: Devices connected at once for each memory mode (the full run).
MEMORY_DEVICES = 4000
#: A freshly booted node's RSS falls for ~20 s (its allocators hand back what booting used,
#: ~20 MB): a mode is measured once the RSS stayed within this many bytes over this many
#: samples a second apart, or after the most samples (quick runs do not wait it out).
SETTLED_WITHIN = 1 << 20
SETTLED_SAMPLES = {"full": 5, "quick": 3}
SETTLE_MAX_SAMPLES = {"full": 60, "quick": 8}
#: A per-device figure of RabbitMQ's memory breakdown shown in the Markdown from this size up.
BREAKDOWN_FLOOR_KB = 0.5


def _plan(devices: int, quick: bool, **kw: Any) -> army.ArmyPlan:
    mode = "quick" if quick else "full"
    return army.ArmyPlan(
        devices=devices,
        processes=2,
        connect_rate=0,
        drain_timeout_s=60,
        warmup_s=WARMUP_S[mode],
        settle_s=SETTLE_S[mode],
        **kw,
    )


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    up, down, conn = r["uplink"], r["downlink"], r["connections"]
    return {
        "sent_per_s": round(up["sent"] / r["plan"]["duration_s"], 1),
        "acked_per_s": up["acked_per_s"],
        "acked": up["acked"],
        "lost": up["lost"],
        "duplicated": up["duplicated"],
        "latency_ms": up["latency_ms"],
        "latency_all_ms": up["latency_all_ms"],
        "latency_p50_by_third_ms": up["latency_p50_by_third_ms"],
        "latency_cdf_ms": up["latency_cdf_ms"],
        "commands": {k: down[k] for k in ("sent", "received", "lost", "latency_ms")},
        "connect_per_s": conn["connect_per_s"],
        "connect_ms": conn["connect_ms"],
        "workers_failed": r["workers_failed"],
    }


def steady(thirds: list[float | None]) -> bool:
    """The latency did not grow through the step: the median of its last third is at most
    twice that of its first, plus 100 ms.  A queue building up at some hop fails this long
    before its p99 reaches 2 s within a 15 s step."""
    first, last = thirds[0], thirds[-1]
    if first is None or last is None:
        return True  # too few readings to tell (a very low rate)
    return last <= 2 * first + STEADY_SLACK_MS


def carried(s: dict[str, Any], p99_ms: float = SUSTAINED_P99_MS) -> bool:
    """A step carried its offered load: nothing lost, 95% acknowledged, p99 under 2 s, and
    no queue building up (steady)."""
    return bool(
        s["lost"] == 0
        and s["acked_per_s"] >= 0.95 * s["offered"]
        and (s["latency_ms"]["p99"] or 0) <= p99_ms
        and steady(s.get("latency_p50_by_third_ms", [None]))
    )


def sustained(steps: list[dict[str, Any]], p99_ms: float = SUSTAINED_P99_MS) -> float | None:
    ok = [s["offered"] for s in steps if carried(s, p99_ms)]
    return max(ok) if ok else None


def next_probe(steps: list[dict[str, Any]], resolution: float) -> int | None:
    """The rate halfway between the highest step carried and the lowest above it that was not,
    while they are more than `resolution` apart (a bisection of the ceiling)."""
    best = sustained(steps) or 0
    above = [s["offered"] for s in steps if s["offered"] > best and not carried(s)]
    if not above or min(above) - best <= resolution:
        return None
    return int(round((best + min(above)) / 2 / 50) * 50)


def offered_in_full(s: dict[str, Any]) -> bool:
    """The army sent the step's load (a step without the figure is taken as offered)."""
    return s.get("sent_per_s", s["offered"]) >= OFFERED_IN_FULL * s["offered"]


def next_step_up(steps: list[dict[str, Any]], max_offered: int) -> int | None:
    """Twice the highest step, while that step was carried, offered in full, and twice it is
    within max_offered: the target has not shown its ceiling yet."""
    top = max(steps, key=lambda s: s["offered"])
    if not (carried(top) and offered_in_full(top)) or 2 * top["offered"] > max_offered:
        return None
    return 2 * top["offered"]


def ceiling(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the steps found the target's own ceiling: a step above the sustained rate that
    the army offered in full and the target did not carry.  If the lowest such step the target
    did not carry was short of its offer, the ceiling is the army's (the load generator's)."""
    best = sustained(steps) or 0
    above = sorted((s for s in steps if s["offered"] > best and not carried(s)), key=lambda s: s["offered"])
    if not above:
        return {"ceiling": "not reached", "ceiling_offered": None}
    first = above[0]
    who = "target" if offered_in_full(first) else "army"
    return {"ceiling": who, "ceiling_offered": first["offered"]}


def per_core_at(steps: list[dict[str, Any]], rate: float | None) -> float | None:
    """Readings/s per core the system used (every part but the army) at the step offered `rate`."""
    return next((s.get("per_core") for s in steps if s["offered"] == rate), None)


#: The hops of fedgate's uplink where readings can wait, in path order.
HOPS = {
    "devices": "the gateway acknowledges slower than the devices publish (MQTT in-flight window)",
    "gateway_federation": "gateway -> backend: the federation link's queue on the gateway",
    "backend_shards": "backend -> Kafka: the uplink shard queues, read by the routers",
}
#: RabbitMQ names the queue an exchange federation link reads from on the upstream so.
FEDERATION_QUEUE_PREFIX = "federation:"
#: A backlog smaller than this is noise, not a queue; nor is one under half a second of
#: the offered load (readings on their way, e.g. the devices' in-flight window at the
#: gateway's round trip).
BACKLOG_FLOOR = 200
BACKLOG_FLOOR_S = 0.5


def fedgate_parts(fed: LocalFederation) -> dict[str, list[int]]:
    """The processes of each part of fedgate's uplink: the (first) gateway, the backend, the
    routers and Kafka."""
    return {
        part: [pid for n in nodes for pid in processes.marked_pids(n.marker)]
        for part, nodes in {
            "gateway": [fed.gateways()[0]],
            "backend": [fed.backend()],
            "routers": [fed.node(s.name) for s in fed.specs() if s.role == ROLE_ROUTER],
            "kafka": [fed.kafka()],
        }.items()
    }


class StepSampler(threading.Thread):
    """Once a second during a step: the CPU each part of the machine used (two cores, shared by
    all of them) and its resident memory, and, for fedgate, the readings waiting at each hop of
    its uplink (queue depths, from each node's Prometheus endpoint)."""

    def __init__(self, parts: dict[str, list[int]], depths: dict[str, Callable[[], int]] | None = None):
        super().__init__(daemon=True, name="step-sampler")
        # a part's processes stay the same through a step: looked up once
        self.pids = parts
        self.depths = depths or {}
        self.peak = dict.fromkeys(self.depths, 0)
        self.rss_mb: dict[str, float] = {}
        #: (part, pid) -> CPU seconds when first and last seen: the army's workers exit
        #: before the sampler stops, so their last reading is kept
        self.cpu_first: dict[tuple[str, int], float] = {}
        self.cpu_last: dict[tuple[str, int], float] = {}
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    @classmethod
    def fedgate(cls, fed: LocalFederation) -> StepSampler:
        # queue depths from the nodes' Prometheus endpoints (no node collects management statistics)
        gateway, backend = fed.gateways()[0], fed.backend()
        shards = {c.uplink_shard_queue(i) for i in range(fed.settings.uplink_shards)}

        def depth(node: Any, wanted: Callable[[str], bool]) -> Callable[[], int]:
            url = f"http://{node.host}:{node.spec.ports['prometheus']}"

            def read() -> int:
                try:
                    queues = prometheus_queue_messages(url, timeout=3)
                except AdminError:
                    return 0  # the backend stopped for the raw reference: nothing to read
                return sum(n for name, n in queues.items() if wanted(name))

            return read

        return cls(
            fedgate_parts(fed),
            {
                "gateway_federation": depth(gateway, lambda n: n.startswith(FEDERATION_QUEUE_PREFIX)),
                "backend_shards": depth(backend, lambda n: n in shards),
            },
        )

    @classmethod
    def baseline(cls, baseline: Baseline, fed: LocalFederation) -> StepSampler:
        return cls(
            {
                "mosquitto": baseline.broker_pids(),
                "bridge": baseline.bridge_pids(),
                "kafka": processes.marked_pids(fed.kafka().marker),
            }
        )

    def _sample(self) -> None:
        # the army's worker processes come and go with each run
        army_pids = [p.pid for p in mp.active_children() if p.pid is not None]
        for part, pids in {**self.pids, "army": army_pids}.items():
            for pid in pids:
                cpu = cpu_seconds([pid])
                self.cpu_first.setdefault((part, pid), cpu)
                self.cpu_last[(part, pid)] = cpu
        for part, pids in self.pids.items():
            self.rss_mb[part] = round(processes.rss_bytes(pids) / 2**20, 1)

    def cpu_cores(self) -> dict[str, float]:
        """Cores each part used over the step (2.0 = both cores all the time)."""
        elapsed = max(time.monotonic() - self.t0, 1e-3)
        used: dict[str, float] = dict.fromkeys([*self.pids, "army"], 0.0)
        for key, last in self.cpu_last.items():
            used[key[0]] += last - self.cpu_first[key]
        return {part: round(sec / elapsed, 3) for part, sec in used.items()}

    def run(self) -> None:
        self._sample()
        while not self.stop.wait(1.0):
            self._sample()
            for hop, read in self.depths.items():
                self.peak[hop] = max(self.peak[hop], read())


def held_at(backlog: dict[str, int], offered: float) -> str | None:
    """The hop holding the largest backlog, None when no hop holds one."""
    hop, depth = max(backlog.items(), key=lambda kv: kv[1])
    return hop if depth >= max(BACKLOG_FLOOR, BACKLOG_FLOOR_S * offered) else None


#: The federation as a fleet meets it: both routers; the Spark job would only take CPU.
SERVICES = {"routers": True, "spark": False}


def run(fed: LocalFederation, workdir: Path, quick: bool = False) -> dict[str, Any]:
    mode = "quick" if quick else "full"
    devices = 100 if quick else 500
    rates = RATES[mode]
    step_s = 3 if quick else 15
    # devices held for the memory modes: a fresh node also grows once, whatever the number of
    # devices (tables, allocator carriers); 4,000 spread that as a gateway of a fleet would
    idle = 300 if quick else MEMORY_DEVICES
    cmd_rate, cmd_s = (20, 3) if quick else (100, 15)
    results: dict[str, Any] = {
        "quick": quick,
        "devices": devices,
        "step_s": step_s,
        "machine": {"cpus": os.cpu_count()},
        "fedgate": {"steps": []},
        "baseline": {"steps": []},
    }
    ep = fed.endpoints()
    bootstrap = ep["kafka"]["bootstrap"]
    fed_target = army.federation_target(fed, _plan(idle, quick, prefix="bench"), progress)
    with Baseline(
        workdir, fed.settings.port_base + BASELINE_PORT_OFFSET, bootstrap, fed.settings.cache_dir
    ) as baseline:
        base_target = baseline.target(fed_target.specs)
        targets = {"fedgate": fed_target, "baseline": base_target}

        def step(name: str, rate: int) -> None:
            progress(f"{name}: {devices} devices offering {rate} readings/s for {step_s} s")
            sampler = StepSampler.fedgate(fed) if name == "fedgate" else StepSampler.baseline(baseline, fed)
            sampler.start()
            try:
                r = army.run_fleet(
                    _subset(targets[name], devices),
                    _plan(devices, quick, rate=rate, duration_s=step_s, prefix="bench"),
                )
            finally:
                sampler.stop.set()
                sampler.join()
            backlog = {"devices": r["uplink"]["inflight_peak"], **sampler.peak}
            row = {
                "offered": rate,
                **_brief(r),
                "backlog_peak": backlog,
                "held_at": held_at(backlog, rate),
                "cpu_cores": sampler.cpu_cores(),
                "rss_mb": sampler.rss_mb,
            }
            row["system_cores"] = sizing.system_cores(row)
            row["per_core"] = round(row["acked_per_s"] / row["system_cores"]) if row["system_cores"] else None
            row["us_per_reading"] = sizing.per_step_us(row)
            results[name]["steps"].append(row)
            results[name]["steps"].sort(key=lambda x: x["offered"])

        # sustained rate and latency: the same devices, the same steps, one target after the other
        for rate in rates:
            for name in targets:
                step(name, rate)
        # each target driven to its own ceiling: doubled while it carries its highest step (and
        # the army offers it), then the ceiling between the last step carried and the first that
        # was not, to 1/8 of that step
        for name in targets:
            while (higher := next_step_up(results[name]["steps"], MAX_OFFERED[mode])) is not None:
                step(name, higher)
            for _ in range(0 if quick else CEILING_PROBES):
                top = max(s["offered"] for s in results[name]["steps"])
                probe = next_probe(results[name]["steps"], resolution=top / 8)
                if probe is None:
                    break
                step(name, probe)
        for name in targets:
            results[name].update(ceiling(results[name]["steps"]))
            results[name]["sustained_per_s"] = sustained(results[name]["steps"])
            results[name]["low_latency_per_s"] = sustained(results[name]["steps"], LOW_LATENCY_P99_MS)
            results[name]["latency_at_moderate_ms"] = results[name]["steps"][0]["latency_ms"]
            results[name]["per_core_at_sustained"] = per_core_at(
                results[name]["steps"], results[name]["sustained_per_s"]
            )

        # downlink: commands through the router, and straight into Mosquitto
        for name, target in targets.items():
            progress(f"{name}: {cmd_rate} commands/s for {cmd_s} s to {devices} devices")
            r = army.run_fleet(
                _subset(target, devices),
                _plan(devices, quick, rate=0, duration_s=cmd_s, commands_per_s=cmd_rate, prefix="bench"),
            )
            results[name]["downlink"] = {
                k: r["downlink"][k] for k in ("sent", "received", "lost", "duplicated", "latency_ms")
            }

        results["baseline"]["broker"] = f"Mosquitto {baseline.version}"

    # memory per device, idle and with either command subscription: a fresh broker for each mode
    memory_modes(fed, fed_target, workdir, quick, idle, results)
    for name in ("fedgate", "baseline"):
        results[name]["connections"] = connections(results[name]["memory"]["idle"])

    # reference: QoS 1 into one RabbitMQ node, nothing consuming (the backend is stopped)
    progress("reference: MQTT QoS 1 into one RabbitMQ node, backend stopped (the gateway only stores)")
    fed.stop_node("backend")
    ref_rate = 2 * rates[-1]  # above what fedgate sustains: the node's own ceiling shows
    r = army.run_fleet(
        _unverified(fed_target, devices),
        _plan(devices, quick, rate=ref_rate, duration_s=step_s, prefix="bench"),
    )
    results["rabbitmq_mqtt_raw"] = {"offered": ref_rate, "acked_per_s": r["uplink"]["acked_per_s"]}
    # left stopped: the suite starts it again if another benchmark follows (bench/suite.py)
    # last: Kafka works on for a while after 100,000 records at once (its log, its JVM), which
    # would load the next step's CPU figures
    progress("reference: Kafka produce from Python (the router's settings)")
    results["kafka_produce_raw_per_s"] = round(kafka_produce(bootstrap, 20_000 if quick else 100_000))
    f, b = results["fedgate"], results["baseline"]
    results["ratios"] = {
        "sustained_fedgate_vs_baseline": _ratio(f.get("sustained_per_s"), b.get("sustained_per_s")),
        "low_latency_fedgate_vs_baseline": _ratio(f.get("low_latency_per_s"), b.get("low_latency_per_s")),
        "sustained_fedgate_vs_rabbitmq_raw": _ratio(
            f.get("sustained_per_s"), results["rabbitmq_mqtt_raw"]["acked_per_s"]
        ),
        "sustained_fedgate_vs_kafka_produce": _ratio(
            f.get("sustained_per_s"), results["kafka_produce_raw_per_s"]
        ),
        "p99_latency_fedgate_vs_baseline": _ratio(
            f["latency_at_moderate_ms"]["p99"], b["latency_at_moderate_ms"]["p99"]
        ),
        "per_core_fedgate_vs_baseline": _ratio(
            f.get("per_core_at_sustained"), b.get("per_core_at_sustained")
        ),
        **memory_ratios(f["memory"], b["memory"]),
    }
    results["sizing"] = fleet_model(results)
    results["plots"] = plots(results, publish=not quick)
    return results


def fleet_model(results: dict[str, Any]) -> dict[str, Any]:
    """The per-hop costs of fedgate's carried steps and the fleets sized from them (bench/sizing.py):
    the gateway's memory per device from its QoS 0 mode, the nodes' base memory from the steps."""
    f = results["fedgate"]
    steps = [s for s in f["steps"] if carried(s)]
    qos0 = f["memory"].get("qos0") or {}
    top = max(steps, key=lambda s: s["offered"]) if steps else {}
    rss = top.get("rss_mb") or {}
    return sizing.model(
        steps,
        qos0.get("kb_per_device_last"),
        gateway_base_mb=qos0.get("rss_mb_before", 0.0),
        backend_base_mb=sum(rss.get(p, 0.0) for p in sizing.BACKEND_PARTS),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def wait_settled(
    sample: Callable[[], int],
    *,
    samples: int,
    within: int,
    max_samples: int,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[int, bool]:
    """Sample once a second until the last `samples` values lie within `within` of each other,
    or `max_samples` were taken; returns how many were taken and whether it settled."""
    seen: list[int] = []
    while True:
        seen.append(sample())
        last = seen[-samples:]
        if len(last) == samples and max(last) - min(last) <= within:
            return len(seen), True
        if len(seen) >= max_samples:
            return len(seen), False
        sleep(1.0)


def flat_breakdown(memory: dict[str, Any]) -> dict[str, float]:
    """RabbitMQ's memory breakdown (GET /api/nodes/<node>/memory) as one level of bytes: its
    categories, and its totals as total_erlang, total_rss and total_allocated."""
    out = {k: v for k, v in memory.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    for k, v in (memory.get("total") or {}).items():
        if isinstance(v, int | float):
            out[f"total_{k}"] = v
    return out


def breakdown_per_device(before: dict[str, Any], peak: dict[str, Any], devices: int) -> dict[str, float]:
    """KB per device each category of the breakdown grew by, from before the devices to the peak."""
    b, p = flat_breakdown(before), flat_breakdown(peak)
    return {k: round((v - b.get(k, 0)) / 1024 / devices, 1) for k, v in p.items()}


def measure_memory(
    target: army.Target,
    plan: army.ArmyPlan,
    pids: Callable[[], list[int]],
    breakdown: Callable[[], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """Connect plan.devices devices to a settled broker and hold them: the broker's resident
    memory at its peak while they are connected (sampled once a second) minus before, per
    device; with `breakdown` also RabbitMQ's memory breakdown before and at that peak.  The
    peak holds the connect burst's garbage too: the last sample (the devices still connected)
    is kept beside it."""
    breakdown_before = breakdown() if breakdown else None
    before = processes.rss_bytes(pids())
    peak: dict[str, Any] = {"rss": before, "last": before, "breakdown": None}

    def line(text: str) -> None:
        progress(text)
        rss = peak["last"] = processes.rss_bytes(pids())
        if rss > peak["rss"]:
            peak["rss"] = rss
            # a breakdown the node was too busy to give: the last one it gave stands in
            if breakdown is not None and (b := breakdown()) is not None:
                peak["breakdown"] = b

    r = army.run_fleet(target, plan, line=line)
    conn = r["connections"]
    # per device held: those the workers still had connected at the end, not those planned (a
    # region that held 17,843 of 100,000 once read as holding all of them)
    n = sum(conn.get("connected_at_end", {}).values())
    out: dict[str, Any] = {
        "command_qos": plan.command_qos,
        "devices": plan.devices,
        "held": n,
        "connected": conn["connects"],
        "subscribed": conn["subscribed"],
        "subscribe_refused": conn["subscribe_refused"],
        "connect_per_s": conn["connect_per_s"],
        "connect_ms": conn["connect_ms"],
        "held_s": plan.duration_s,
        "rss_mb_before": round(before / 2**20, 1),
        "rss_mb_peak": round(peak["rss"] / 2**20, 1),
        "kb_per_device": round((peak["rss"] - before) / 1024 / n, 1) if n else None,
        "kb_per_device_last": round((peak["last"] - before) / 1024 / n, 1) if n else None,
        "uplink": {k: r["uplink"][k] for k in ("sent", "acked", "lost", "duplicated", "latency_ms")},
    }
    if plan.commands_per_s:
        out["downlink"] = {k: r["downlink"][k] for k in ("sent", "received", "lost", "duplicated")}
    if breakdown_before is not None and peak["breakdown"] is not None and n:
        out["breakdown_kb_per_device"] = breakdown_per_device(breakdown_before, peak["breakdown"], n)
        out["breakdown_mb_peak"] = {
            k: round(v / 2**20, 1) for k, v in flat_breakdown(peak["breakdown"]).items()
        }
    return out


def restart_gateway(fed: LocalFederation, gateway: RabbitNode) -> float:
    """A fresh gateway node (a node's RSS grows with its allocators' caches), its federation links
    up again; returns when (time.monotonic())."""
    fed.stop_node(gateway.name)
    fed.start_node(gateway.name)
    fed.wait_for_links()
    return time.monotonic()


def cluster_pids(nodes: list[Any]) -> list[int]:
    """The processes of every node of `nodes` (each found by its marker)."""
    return [pid for n in nodes for pid in processes.marked_pids(n.marker)]


def wait_gateway_settled(gateway: RabbitNode | list[RabbitNode], mode_key: str) -> bool:
    """Wait until a freshly booted node's RSS (a cluster's: their sum) stopped falling (or
    gave up: False)."""
    nodes = gateway if isinstance(gateway, list) else [gateway]
    _, settled = wait_settled(
        lambda: processes.rss_bytes(cluster_pids(nodes)),
        samples=SETTLED_SAMPLES[mode_key],
        within=SETTLED_WITHIN,
        max_samples=SETTLE_MAX_SAMPLES[mode_key],
    )
    return settled


def memory_breakdown(gateway: RabbitNode, admin: RabbitAdmin) -> Callable[[], dict[str, Any] | None]:
    """RabbitMQ's memory breakdown of the node, or None while it is too busy to give it."""
    path = f"nodes/{quote(gateway.erlang_node, safe='')}/memory"

    def breakdown() -> dict[str, Any] | None:
        try:
            return dict(admin.get(path)["memory"])
        except AdminError:  # busy with thousands of subscribing devices: the next sample's
            return None

    return breakdown


def memory_modes(
    fed: LocalFederation,
    fed_target: army.Target,
    workdir: Path,
    quick: bool,
    devices: int,
    results: dict[str, Any],
) -> None:
    """results[name]["memory"][mode] for fedgate's gateway and Mosquitto, each mode on a fresh
    broker: a node's RSS grows with its allocators' caches, so modes measured one after another
    on the same process read low (and the first high).  Before each mode the gateway restarts
    (its federation links up again) and Mosquitto's fresh broker is measured while the gateway
    settles; then the gateway, once its RSS is steady."""
    mode_key = "quick" if quick else "full"
    gateway = fed.gateways()[0]
    admin = gateway.admin(timeout=15)
    breakdown = memory_breakdown(gateway, admin)
    runtime = debian13_runtime(fed.settings.cache_dir)
    port = fed.settings.port_base + BASELINE_PORT_OFFSET + 1
    base_target = mosquitto_target(fed_target.specs[:devices], "127.0.0.1", port, fed_target.kafka_bootstrap)

    def gateway_pids() -> list[int]:
        return processes.marked_pids(gateway.marker)

    for name in ("fedgate", "baseline"):
        results[name]["memory"] = {}
    for mode, qos in MEMORY_MODES.items():
        plan = _plan(
            devices, quick, rate=0, duration_s=MEMORY_HOLD_S[mode_key], command_qos=qos, prefix="bench"
        )
        progress(f"memory, {MEMORY_MODE_TEXT[mode]}: restarting {gateway.name} (a fresh node per mode)")
        restarted = restart_gateway(fed, gateway)
        progress(f"baseline: {devices} devices, {MEMORY_MODE_TEXT[mode]}, on a fresh Mosquitto")
        with Mosquitto(workdir / f"memory-{mode}", port, runtime) as mosquitto:
            results["baseline"]["memory"][mode] = measure_memory(base_target, plan, mosquitto.pids)
        progress(f"fedgate: waiting for {gateway.name}'s memory to settle after its boot")
        settled = wait_gateway_settled(gateway, mode_key)
        settle_s = round(time.monotonic() - restarted, 1)
        state = "settled" if settled else "not settled"
        progress(
            f"fedgate: {devices} devices, {MEMORY_MODE_TEXT[mode]} ({state} {settle_s} s after the restart)"
        )
        m = measure_memory(fed_target, plan, gateway_pids, breakdown)
        results["fedgate"]["memory"][mode] = {**m, "settle_s": settle_s, "settled": settled}
    results["fedgate"]["broker"] = f"RabbitMQ {admin.get('overview').get('rabbitmq_version')}"


def connections(idle: dict[str, Any]) -> dict[str, Any]:
    """The connect figures, from the idle devices of the memory modes."""
    return {k: idle[k] for k in ("devices", "connected", "connect_per_s", "connect_ms")}


def memory_ratios(f: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """fedgate's memory per device over the baseline's, per mode."""
    return {
        f"memory_per_device_{mode}_fedgate_vs_baseline": _ratio(
            f.get(mode, {}).get("kb_per_device_last"), b.get(mode, {}).get("kb_per_device_last")
        )
        for mode in MEMORY_MODES
    }


def memory_markdown(r: dict[str, Any]) -> list[str]:
    """The memory per device per mode, fedgate against the baseline, and where the gateway's
    memory goes (RabbitMQ's breakdown, the categories that grew by BREAKDOWN_FLOOR_KB or more)."""
    f, b = r["fedgate"], r["baseline"]
    fm, bm = f["memory"], b["memory"]
    devices = fm["idle"]["devices"]

    def cell(m: dict[str, Any] | None) -> str:
        if m is None:
            return ""
        text = f"{m['kb_per_device_last']} KB (peak {m['kb_per_device']})"
        short = []
        if m["connected"] < m["devices"]:
            short.append(f"{m['connected']} connected")
        if m["command_qos"] is not None and m["subscribed"] < m["devices"]:
            short.append(f"{m['subscribed']} subscribed")
        if m.get("settled") is False:
            short.append("RSS not settled")
        return text + (f" ({', '.join(short)})" if short else "")

    lines = [
        "",
        f"Broker memory per connected device ({devices} devices held {fm['idle']['held_s']:g} s; "
        "resident memory at the end of the hold, the devices still connected and the connect "
        "burst's garbage collected, minus before, per device; in brackets the peak while they "
        "connected; each mode on a fresh broker: the gateway node restarted and settled, a new "
        "Mosquitto):",
        "",
        f"| memory per device | fedgate ({f.get('broker', 'RabbitMQ')} gateway) "
        f"| baseline ({b.get('broker', 'Mosquitto')}) | fedgate / baseline |",
        "|---|---|---|---|",
    ]
    for mode in MEMORY_MODES:
        ratio = r["ratios"].get(f"memory_per_device_{mode}_fedgate_vs_baseline")
        lines.append(f"| {MEMORY_MODE_TEXT[mode]} | {cell(fm.get(mode))} | {cell(bm.get(mode))} | {ratio} |")
    per_mode = {mode: fm[mode].get("breakdown_kb_per_device") or {} for mode in MEMORY_MODES if mode in fm}
    categories = {k for d in per_mode.values() for k, v in d.items() if abs(v) >= BREAKDOWN_FLOOR_KB}
    if categories:
        biggest = list(per_mode)[-1]
        totals = sorted(k for k in categories if k.startswith("total_"))
        rows = sorted(categories - set(totals), key=lambda k: -per_mode[biggest].get(k, 0)) + totals
        lines += [
            "",
            "Where the gateway's memory goes: RabbitMQ's memory breakdown (`/api/nodes/<node>/memory`), "
            "KB per device from before the devices to the peak (categories from "
            f"{BREAKDOWN_FLOOR_KB:g} KB; `total_rss` is the Erlang VM's own RSS):",
            "",
            "| category | " + " | ".join(MEMORY_MODE_TEXT[m] for m in per_mode) + " |",
            "|---|" + "---|" * len(per_mode),
        ]
        for k in rows:
            lines.append(f"| {k} | " + " | ".join(str(per_mode[m].get(k, "")) for m in per_mode) + " |")
    return lines


def _subset(t: army.Target, n: int) -> army.Target:
    return dataclasses.replace(t, specs=t.specs[:n])


def _unverified(t: army.Target, n: int) -> army.Target:
    """The gateway alone: readings stay in it, so the Kafka check is not asked for."""
    return dataclasses.replace(t, specs=t.specs[:n], verify=False)


def plots(results: dict[str, Any], publish: bool = True) -> list[str]:
    """Throughput against offered load, and the latency of each step: PNGs in bench/results, and
    with `publish` (full runs) also docs/img, which docs/benchmarks.md shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("plots skipped: matplotlib is not installed (make setup installs it)")
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("fedgate", "baseline"):
        steps = results[name]["steps"]
        # what reached Kafka: a broker that drops readings it acknowledged (Mosquitto when its
        # queue overflows) must not be drawn as carrying them
        stored = [s["acked_per_s"] * (1 - s["lost"] / s["acked"]) if s["acked"] else 0.0 for s in steps]
        line = ax.plot([s["offered"] for s in steps], stored, marker="o", label=name)[0]
        not_carried = [(s["offered"], y) for s, y in zip(steps, stored, strict=True) if not carried(s)]
        if not_carried:
            ax.scatter(*zip(*not_carried, strict=True), s=90, facecolors="none", edgecolors=line.get_color())
    offered = sorted({s["offered"] for name in ("fedgate", "baseline") for s in results[name]["steps"]})
    ax.plot(offered, offered, linestyle=":", color="grey", label="offered")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered QoS 1 readings/s")
    ax.set_ylabel("acknowledged readings/s in Kafka")
    ax.set_title("Throughput against offered load (circled: not carried)")
    ax.legend()
    out.append(_save(fig, f"army-throughput-{stamp}.png", "army-throughput.png" if publish else None))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("fedgate", "baseline"):
        steps = results[name]["steps"]
        ax.plot(
            [s["offered"] for s in steps],
            [s["latency_ms"]["p99"] for s in steps],
            marker="o",
            label=f"{name} p99",
        )
        ax.plot(
            [s["offered"] for s in steps],
            [s["latency_ms"]["p50"] for s in steps],
            marker=".",
            linestyle="--",
            label=f"{name} p50",
        )
    ax.set_yscale("log")
    ax.set_xlabel("offered QoS 1 readings/s")
    ax.set_ylabel("device -> Kafka latency (ms)")
    ax.set_title("Latency against offered load")
    ax.legend()
    out.append(_save(fig, f"army-latency-{stamp}.png", "army-latency.png" if publish else None))
    # the CDF at the moderate rate (the first step)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("fedgate", "baseline"):
        cdf = results[name]["steps"][0]["latency_cdf_ms"]
        ax.plot([max(x, 0.01) for x in cdf], [(i + 1) / len(cdf) for i in range(len(cdf))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("device -> Kafka latency (ms)")
    ax.set_ylabel("share of readings")
    ax.set_title(f"Latency CDF at {results['fedgate']['steps'][0]['offered']} readings/s")
    ax.legend()
    out.append(_save(fig, f"army-latency-cdf-{stamp}.png", "army-latency-cdf.png" if publish else None))
    plt.close("all")
    return out


def _save(fig: Any, name: str, latest: str | None) -> str:
    results_dir = PROJECT_ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(results_dir / name, dpi=100)
    if latest is not None:
        img_dir = PROJECT_ROOT / "docs" / "img"
        img_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(img_dir / latest, dpi=100)
    return str(results_dir / name)


def cpu_markdown(name: str, steps: list[dict[str, Any]], cpus: int | None) -> list[str]:
    """Per step: the cores each part used, the readings/s per core of the system (every part but
    the army), and each part's CPU µs per reading acknowledged."""
    with_cpu = [x for x in steps if x.get("cpu_cores")]
    if not with_cpu:
        return []
    parts = list(with_cpu[0]["cpu_cores"])
    lines = [
        "",
        f"CPU of each part during {name}'s steps, in cores ({cpus} on this machine; the system is "
        "every part but the army, the load generator), and in µs per reading acknowledged:",
        "",
        "| offered/s | sent/s | "
        + " | ".join(parts)
        + " | system | readings/s per core | "
        + " | ".join(f"{p} µs" for p in parts if p != "army")
        + " |",
        "|---|---|" + "---|" * (2 * len(parts) + 1),
    ]
    for x in with_cpu:
        cores, us = x["cpu_cores"], x.get("us_per_reading") or {}
        lines.append(
            f"| {x['offered']} | {x.get('sent_per_s', '')} | "
            + " | ".join(str(round(cores[p], 2)) for p in parts)
            + f" | {round(x.get('system_cores') or 0, 2)} | {x.get('per_core')} | "
            + " | ".join(str(us.get(p, "")) for p in parts if p != "army")
            + " |"
        )
    return lines


def to_markdown(r: dict[str, Any]) -> str:
    f, b = r["fedgate"], r["baseline"]

    def lat(x: dict[str, Any]) -> str:
        return f"{x['p50']} / {x['p99']} ms"

    lines = [
        f"## Device army: fedgate ({f.get('broker', 'RabbitMQ')}) against {b.get('broker', 'Mosquitto')} "
        f"+ a Python bridge ({'quick' if r['quick'] else 'full'})",
        "",
        f"{r['devices']} devices, QoS 1, {r['step_s']} s per step, {r['machine']['cpus']} cores shared by "
        "everything; every acknowledged reading looked up in Kafka. Latency: device send to the Kafka "
        f"record's timestamp, after a {WARMUP_S['quick' if r['quick'] else 'full']:g} s warm-up "
        "(the whole step's p99 in brackets). A step is carried with nothing lost, 95% of the offered "
        "rate acknowledged, p99 under 2 s and the latency not growing through the step (the median "
        "of its last third at most twice that of its first + 100 ms). Kafka's record timestamps are "
        "whole milliseconds, so a latency under 1 ms can read as slightly negative.",
        "",
        "| offered/s | fedgate acked/s | lost | p50 / p99 | baseline acked/s | lost | p50 / p99 "
        "| fedgate's backlog held at (peak readings waiting per hop) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cells(x: dict[str, Any] | None) -> str:
        if x is None:
            return "| | | "
        return f"| {x['acked_per_s']} | {x['lost']} | {lat(x['latency_ms'])} ({x['latency_all_ms']['p99']}) "

    def where(x: dict[str, Any] | None) -> str:
        if x is None or "backlog_peak" not in x:
            return ""
        depth = ", ".join(f"{k} {v}" for k, v in x["backlog_peak"].items())
        text = f"**{x['held_at']}** ({depth})" if x["held_at"] else f"nowhere ({depth})"
        thirds = x.get("latency_p50_by_third_ms") or [None]
        if not steady(thirds):
            text += f"; latency growing, p50 {thirds[0]} -> {thirds[-1]} ms"
        return text

    by_rate = {name: {s["offered"]: s for s in r[name]["steps"]} for name in ("fedgate", "baseline")}
    for rate in sorted(set(by_rate["fedgate"]) | set(by_rate["baseline"])):
        fs, bs = by_rate["fedgate"].get(rate), by_rate["baseline"].get(rate)
        lines.append(f"| {rate} {cells(fs)}{cells(bs)}| {where(fs)} |")
    lines += [
        "",
        "Where readings wait, peak over a step: " + "; ".join(f"*{k}*: {v}" for k, v in HOPS.items()) + ".",
    ]
    for name in ("fedgate", "baseline"):
        lines += cpu_markdown(name, r[name]["steps"], r["machine"]["cpus"])
    fc, bc = f["connections"], b["connections"]
    fd, bd = f["downlink"], b["downlink"]
    lines += [
        "",
        "| figure | fedgate | baseline | fedgate / baseline |",
        "|---|---|---|---|",
        f"| sustained QoS 1 rate, nothing lost, p99 under 2 s | {f['sustained_per_s']}/s "
        f"| {b['sustained_per_s']}/s | {r['ratios']['sustained_fedgate_vs_baseline']} |",
        f"| the same with p99 under {LOW_LATENCY_P99_MS:g} ms | {f['low_latency_per_s']}/s "
        f"| {b['low_latency_per_s']}/s | {r['ratios']['low_latency_fedgate_vs_baseline']} |",
        f"| latency at {f['steps'][0]['offered']}/s, p50 / p99 | {lat(f['latency_at_moderate_ms'])} "
        f"| {lat(b['latency_at_moderate_ms'])} | {r['ratios']['p99_latency_fedgate_vs_baseline']} (p99) |",
        f"| readings/s per core the system used, at the sustained rate | {f.get('per_core_at_sustained')} "
        f"| {b.get('per_core_at_sustained')} | {r['ratios'].get('per_core_fedgate_vs_baseline')} |",
        f"| ceiling found | {f.get('ceiling')} ({f.get('ceiling_offered')}/s) "
        f"| {b.get('ceiling')} ({b.get('ceiling_offered')}/s) | |",
        f"| {fc['devices']} idle connections: connect rate | {fc['connect_per_s']}/s "
        f"| {bc['connect_per_s']}/s | |",
        f"| broker memory per device, {MEMORY_MODE_TEXT['qos0']} (fedgate's devices), settled "
        f"| {f['memory']['qos0']['kb_per_device_last']} KB | {b['memory']['qos0']['kb_per_device_last']} KB "
        f"| {r['ratios']['memory_per_device_qos0_fedgate_vs_baseline']} |",
        f"| downlink: commands sent / received / lost | {fd['sent']} / {fd['received']} / {fd['lost']} "
        f"| {bd['sent']} / {bd['received']} / {bd['lost']} | |",
        f"| downlink latency p50 / p99 | {lat(fd['latency_ms'])} | {lat(bd['latency_ms'])} | |",
        "",
        "| physical reference | rate | fedgate sustained / reference |",
        "|---|---|---|",
        f"| Python producing to Kafka (router settings) | {r['kafka_produce_raw_per_s']}/s "
        f"| {r['ratios']['sustained_fedgate_vs_kafka_produce']} |",
        f"| MQTT QoS 1 into one RabbitMQ node, nothing consuming "
        f"| {r['rabbitmq_mqtt_raw']['acked_per_s']}/s (offered {r['rabbitmq_mqtt_raw']['offered']}) "
        f"| {r['ratios']['sustained_fedgate_vs_rabbitmq_raw']} |",
    ]
    lines += memory_markdown(r)
    if r.get("sizing"):
        lines += sizing.to_markdown(r["sizing"])
    return "\n".join(lines) + "\n"
