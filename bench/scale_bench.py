"""How many devices one region's gateway cluster holds, and what each costs it.

100,000 devices of the army (`make bench`; 1,000 in a quick run), each as
fedgate's devices are -- a QoS 0 command subscription -- connect to one
region's gateway cluster at a paced rate and stay connected while each
sends a reading every READING_EVERY_S seconds (1,000 readings/s from
100,000), every reading looked up in Kafka, and the backend sends commands
to a sample of them through the routers.

A process here may have 20,000 descriptors (a hard limit only
CAP_SYS_RESOURCE raises), so the region is a cluster of as many gateway
nodes as its devices need (cluster_plan: 6 of 19,500 devices at most for
100,000; the quick run caps a node at 500 so that it checks a cluster of
two), and the army spreads its devices over as many worker processes.
The benchmark runs on a federation of its own, booted for it
(bench/suite.py), one region with that cluster.  Reported: how many
connected and subscribed, on each node; the connect rate; the cluster's
resident memory per device at the end of the hold (and its peak), and
RabbitMQ's memory breakdown summed over the nodes; the commands
delivered; the CPU each part used over the run; the readings' loss and
latency.

One source address has ~28,000 ports towards one gateway address, so the
devices dial from several addresses of 127.0.0.0/8 (PER_SOURCE each).  The
nodes' descriptor limit and memory watermark come from the benchmarks'
federation (bench/suite.py raises both for this benchmark).
"""

from __future__ import annotations

import math
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.army_bench import (
    StepSampler,
    cluster_pids,
    flat_breakdown,
    measure_memory,
    memory_breakdown,
    wait_gateway_settled,
)
from bench.router_bench import progress
from fedgate import army
from fedgate.army.target import router_commands
from infra.local import processes
from infra.local.driver import LocalFederation
from infra.local.nodes import ROLE_ROUTER, RabbitNode

#: The federation as a fleet meets it; the Spark job would only take CPU.
SERVICES = {"routers": True, "spark": False}
DEVICES = {"full": 100_000, "quick": 1_000}
#: Devices per source address (~28,000 ephemeral ports each towards one gateway address).
PER_SOURCE = 20_000
#: Each device sends a reading this often while held (100,000 devices: 1,000 readings/s).
READING_EVERY_S = 100.0
HOLD_S = {"full": 60.0, "quick": 5.0}
#: Commands per second the backend sends to the held devices, each to one picked in turn.
COMMANDS_PER_S = {"full": 50.0, "quick": 20.0}
#: Devices connecting per second: each node's listen backlog takes bursts of 4,096.
CONNECT_RATE = {"full": 2_500.0, "quick": 0.0}
#: The benchmarks' federation's gateway descriptor limit and RabbitMQ memory watermark (MB).
GATEWAY_MAX_FDS = 131_072
GATEWAY_MEMORY_MB = 8_192
#: Worker processes of the army at least (each holds its share of the devices on one event loop).
PROCESSES = {"full": 4, "quick": 2}
#: Devices a node holds at most whatever its descriptors: the quick run's need two nodes.
NODE_DEVICES_CAP = {"full": None, "quick": 500}

#: Descriptors a gateway node keeps for itself: its files, AMQP connections, the management API.
NODE_DESCRIPTORS = 500
#: Descriptors an army worker keeps for itself: its pipes, its Kafka-free bookkeeping.
WORKER_DESCRIPTORS = 200


def descriptor_ceiling(wanted: int) -> int:
    """The most descriptors a node started from here can have: `wanted` if this process may
    raise its hard limit that far (root with CAP_SYS_RESOURCE; then it has), else its hard
    limit, which every child inherits as its ceiling."""
    return processes.set_descriptor_limit(wanted)


@dataclass(frozen=True)
class ClusterPlan:
    devices: int
    #: gateway nodes of the region, and the devices each holds at most
    nodes: int
    per_node: int
    #: the army's worker processes
    processes: int
    #: descriptors a process may have here
    ceiling: int


def cluster_plan(mode: str) -> ClusterPlan:
    """As many gateway nodes and army workers as DEVICES[mode] need on this machine."""
    devices = DEVICES[mode]
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # never lowered: this process needs its own
    ceiling = descriptor_ceiling(max(soft, devices + NODE_DESCRIPTORS))
    per_node = ceiling - NODE_DESCRIPTORS
    cap = NODE_DEVICES_CAP[mode]
    per_node = min(per_node, cap) if cap else per_node
    return ClusterPlan(
        devices=devices,
        nodes=math.ceil(devices / per_node),
        per_node=per_node,
        processes=max(PROCESSES[mode], math.ceil(devices / (ceiling - WORKER_DESCRIPTORS))),
        ceiling=ceiling,
    )


def source_address(i: int) -> str:
    """The address device i dials from: PER_SOURCE devices on each of 127.0.0.2, .3, ..."""
    return f"127.0.0.{2 + i // PER_SOURCE}"


def cluster_target(fed: LocalFederation, devices: int) -> army.Target:
    """`devices` devices registered in the federation, device i dialling node i % nodes of the
    region's cluster straight (no DNS: the figures are the cluster's) from its source address;
    commands through the routers as `fedgate army` sends them."""
    ep = fed.endpoints()
    region = sorted(ep["gateways"])[0]
    members = ep["gateways"][region].get("nodes") or [ep["gateways"][region]]
    ids = [f"scale-{i:06d}" for i in range(devices)]
    progress(f"registering {devices} devices on the gateways (one definitions import per 500)")
    started = time.monotonic()
    secrets = fed.add_devices(ids, rotate=True)
    progress(f"registered {devices} devices in {time.monotonic() - started:.0f} s")
    specs = []
    for i, d in enumerate(ids):
        node = members[i % len(members)]
        specs.append(
            army.DeviceSpec(
                d, secrets[d], ((region, node["address"], node["mqtt"]),), source=source_address(i)
            )
        )
    commands = router_commands(ep["backend"]["urls"])
    return army.Target("fedgate", specs, [region], ep["kafka"]["bootstrap"], commands=commands)


def cluster_breakdown(gateways: list[RabbitNode]) -> Callable[[], dict[str, Any] | None]:
    """RabbitMQ's memory breakdown summed over the nodes, or None while one is too busy to give it."""
    nodes = [memory_breakdown(g, g.admin(timeout=30)) for g in gateways]

    def breakdown() -> dict[str, Any] | None:
        total: Counter[str] = Counter()
        for node in nodes:
            memory = node()
            if memory is None:
                return None
            total.update(flat_breakdown(memory))
        return dict(total)

    return breakdown


def run(fed: LocalFederation, workdir: Path, quick: bool = False) -> dict[str, Any]:
    mode = "quick" if quick else "full"
    cp = cluster_plan(mode)
    gateways = fed.gateways()
    n, limited_by = cp.devices, None
    if len(gateways) < cp.nodes:  # a federation not booted for it (bench/suite.py boots one)
        n = min(n, len(gateways) * cp.per_node)
        limited_by = f"the federation has {len(gateways)} gateway node(s), not the {cp.nodes} they need"
        progress(limited_by)
    target = cluster_target(fed, n)
    settled = wait_gateway_settled(gateways, mode)
    plan = army.ArmyPlan(
        devices=n,
        rate=n / READING_EVERY_S,
        duration_s=HOLD_S[mode],
        processes=cp.processes,
        command_qos=0,
        commands_per_s=COMMANDS_PER_S[mode],
        connect_rate=CONNECT_RATE[mode],
        drain_timeout_s=120,
        warmup_s=1.0,
        settle_s=1.0,
        prefix="scale",
    )
    progress(
        f"{n} devices with QoS 0 command subscriptions connecting at {plan.connect_rate:g}/s to "
        f"{len(gateways)} gateway node(s) from {1 + (n - 1) // PER_SOURCE} source address(es), "
        f"in {plan.processes} army processes; then {plan.rate:g} readings/s and "
        f"{plan.commands_per_s:g} commands/s for {plan.duration_s:g} s"
    )
    # CPU and memory only: the queue depths' scrape of every queue, once a second, would load the
    # gateways holding a QoS 0 queue per device
    sampler = StepSampler(
        {
            "gateways": cluster_pids(gateways),
            "backend": processes.marked_pids(fed.backend().marker),
            "routers": cluster_pids([fed.node(s.name) for s in fed.specs() if s.role == ROLE_ROUTER]),
            "kafka": processes.marked_pids(fed.kafka().marker),
        }
    )
    sampler.start()
    try:
        held = measure_memory(target, plan, lambda: cluster_pids(gateways), cluster_breakdown(gateways))
    finally:
        sampler.stop.set()
        sampler.join()
    admin = gateways[0].admin(timeout=30)
    return {
        "quick": quick,
        "devices_wanted": DEVICES[mode],
        "devices": n,
        "limited_by": limited_by,
        "cluster": asdict(cp) | {"nodes_running": len(gateways)},
        "devices_per_node": dict(Counter(s.endpoints[0][1] for s in target.specs)),
        "gateway_settled_before": settled,
        "held": held,
        "cpu_cores": sampler.cpu_cores(),
        "rss_mb": sampler.rss_mb,
        "broker": f"RabbitMQ {admin.get('overview').get('rabbitmq_version')}",
    }


def to_markdown(r: dict[str, Any]) -> str:
    h = r["held"]
    up = h.get("uplink") or {}
    down = h.get("downlink") or {}
    lat = up.get("latency_ms") or {}
    cores = ", ".join(f"{k} {v}" for k, v in r["cpu_cores"].items())
    limit = [f"Fewer than {r['devices_wanted']:,}: {r['limited_by']}.", ""] if r.get("limited_by") else []
    cluster = r["cluster"]
    per_node = ", ".join(f"{n:,}" for n in r["devices_per_node"].values())
    return "\n".join(
        [
            f"# One region, {r['devices']:,} devices on a gateway cluster of {cluster['nodes_running']} "
            f"node(s) ({'quick' if r['quick'] else 'full'}; {r['broker']})",
            "",
            f"A process here may have {cluster['ceiling']:,} descriptors: a node holds "
            f"{cluster['per_node']:,} devices at most, the army runs in {cluster['processes']} processes.",
            "",
            *limit,
            "| figure | value |",
            "|---|---|",
            f"| devices held / subscribed (QoS 0 commands) | {h['held']:,} / {h['subscribed']:,} "
            f"of {h['devices']:,} |",
            f"| devices dialling each node | {per_node} |",
            f"| connect rate | {h['connect_per_s']}/s (p99 {h['connect_ms'].get('p99')} ms) |",
            f"| gateways' memory per device, end of the hold (peak) | {h['kb_per_device_last']} KB "
            f"({h['kb_per_device']} KB) |",
            f"| gateways' resident memory before / peak | {h['rss_mb_before']} MB / {h['rss_mb_peak']} MB |",
            f"| readings sent / acknowledged / lost "
            f"| {up.get('sent')} / {up.get('acked')} / {up.get('lost')} |",
            f"| reading latency p50 / p99 | {lat.get('p50')} / {lat.get('p99')} ms |",
            f"| commands sent / received / lost | {down.get('sent')} / {down.get('received')} / "
            f"{down.get('lost')} |",
            f"| CPU over the run, cores | {cores} |",
            "",
        ]
    )
