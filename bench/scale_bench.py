"""How many devices one gateway node holds, and what each costs it.

100,000 devices of the army (`make bench`; 1,000 in a quick run), each as
fedgate's devices are -- a QoS 0 command subscription -- connect to the
benchmarks' one gateway node, freshly restarted and settled, at a paced
rate, and stay connected while each sends a reading every
READING_EVERY_S seconds (1,000 readings/s from 100,000 devices), every
reading looked up in Kafka.  Reported: how many connected and
subscribed, the connect rate, the gateway's resident memory per device at
the end of the hold (and its peak), RabbitMQ's memory breakdown, the CPU
each part used over the run, and the readings' loss and latency.

One source address has ~28,000 ports towards one gateway address, so the
devices dial from several addresses of 127.0.0.0/8 (PER_SOURCE each).  The
node's descriptor limit and memory watermark come from the benchmarks'
federation (bench/suite.py raises both for this benchmark).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.army_bench import (
    StepSampler,
    fedgate_parts,
    measure_memory,
    memory_breakdown,
    restart_gateway,
    wait_gateway_settled,
)
from bench.router_bench import progress
from fedgate import army
from infra.local import processes
from infra.local.driver import LocalFederation

#: The federation as a fleet meets it; the Spark job would only take CPU.
SERVICES = {"routers": True, "spark": False}
DEVICES = {"full": 100_000, "quick": 1_000}
#: Devices per source address (~28,000 ephemeral ports each towards one gateway address).
PER_SOURCE = 20_000
#: Each device sends a reading this often while held (100,000 devices: 1,000 readings/s).
READING_EVERY_S = 100.0
HOLD_S = {"full": 60.0, "quick": 5.0}
#: Devices connecting per second: the gateway's listen backlog takes bursts of 4,096.
CONNECT_RATE = {"full": 2_500.0, "quick": 0.0}
#: The benchmarks' federation's gateway descriptor limit and RabbitMQ memory watermark (MB).
GATEWAY_MAX_FDS = 131_072
GATEWAY_MEMORY_MB = 8_192
#: Worker processes of the army (each holds its share of the devices on one event loop).
PROCESSES = {"full": 4, "quick": 2}


#: Descriptors a gateway node keeps for itself: its files, AMQP connections, the management API.
NODE_DESCRIPTORS = 500


def descriptor_ceiling(wanted: int) -> int:
    """The most descriptors a node started from here can have: `wanted` if this process may
    raise its hard limit that far (root with CAP_SYS_RESOURCE; then it has), else its hard
    limit, which every child inherits as its ceiling."""
    return processes.set_descriptor_limit(wanted)


def devices_to_hold(wanted: int) -> tuple[int, str | None]:
    """How many devices the gateway node can hold here, and why fewer than `wanted` if so."""
    ceiling = descriptor_ceiling(wanted + NODE_DESCRIPTORS)
    if ceiling >= wanted + NODE_DESCRIPTORS:
        return wanted, None
    held = ceiling - NODE_DESCRIPTORS
    return held, (
        f"this machine lets no process have more than {ceiling:,} descriptors (a hard limit that "
        f"only CAP_SYS_RESOURCE may raise, which this sandbox's root lacks): one gateway node can "
        f"hold {held:,} devices here, not {wanted:,}"
    )


def source_address(i: int) -> str:
    """The address device i dials from: PER_SOURCE devices on each of 127.0.0.2, .3, ..."""
    return f"127.0.0.{2 + i // PER_SOURCE}"


def gateway_target(fed: LocalFederation, devices: int) -> army.Target:
    """`devices` devices registered in the federation, each dialling the first gateway node
    straight (no DNS: the figure is the node's) from its source address."""
    ep = fed.endpoints()
    region = sorted(ep["gateways"])[0]
    gw = ep["gateways"][region]
    ids = [f"scale-{i:06d}" for i in range(devices)]
    progress(f"registering {devices} devices on the gateway (one definitions import per 500)")
    started = time.monotonic()
    secrets = fed.add_devices(ids, rotate=True)
    progress(f"registered {devices} devices in {time.monotonic() - started:.0f} s")
    specs = [
        army.DeviceSpec(d, secrets[d], ((region, gw["address"], gw["mqtt"]),), source=source_address(i))
        for i, d in enumerate(ids)
    ]
    return army.Target("fedgate", specs, [region], ep["kafka"]["bootstrap"])


def run(fed: LocalFederation, workdir: Path, quick: bool = False) -> dict[str, Any]:
    mode = "quick" if quick else "full"
    n, limited_by = devices_to_hold(DEVICES[mode])
    if limited_by:
        progress(limited_by)
    gateway = fed.gateways()[0]
    admin = gateway.admin(timeout=30)
    target = gateway_target(fed, n)
    progress(f"restarting {gateway.name}: a fresh node holds the devices")
    restart_gateway(fed, gateway)
    settled = wait_gateway_settled(gateway, mode)

    plan = army.ArmyPlan(
        devices=n,
        rate=n / READING_EVERY_S,
        duration_s=HOLD_S[mode],
        processes=PROCESSES[mode],
        command_qos=0,
        connect_rate=CONNECT_RATE[mode],
        drain_timeout_s=120,
        warmup_s=1.0,
        settle_s=1.0,
        prefix="scale",
    )
    progress(
        f"{n} devices with QoS 0 command subscriptions connecting at {plan.connect_rate:g}/s "
        f"from {1 + (n - 1) // PER_SOURCE} source addresses, "
        f"then {plan.rate:g} readings/s for {plan.duration_s:g} s"
    )
    # CPU and memory only: the queue depths' scrape of every queue, once a second, would load the
    # gateway holding a QoS 0 queue per device
    sampler = StepSampler(fedgate_parts(fed))
    sampler.start()
    try:
        held = measure_memory(
            target, plan, lambda: processes.marked_pids(gateway.marker), memory_breakdown(gateway, admin)
        )
    finally:
        sampler.stop.set()
        sampler.join()
    return {
        "quick": quick,
        "devices_wanted": DEVICES[mode],
        "devices": n,
        "limited_by": limited_by,
        "gateway_settled_before": settled,
        "held": held,
        "cpu_cores": sampler.cpu_cores(),
        "rss_mb": sampler.rss_mb,
        "broker": f"RabbitMQ {admin.get('overview').get('rabbitmq_version')}",
    }


def to_markdown(r: dict[str, Any]) -> str:
    h = r["held"]
    up = h.get("uplink") or {}
    lat = up.get("latency_ms") or {}
    cores = ", ".join(f"{k} {v}" for k, v in r["cpu_cores"].items())
    limit = [f"Fewer than {r['devices_wanted']:,}: {r['limited_by']}.", ""] if r.get("limited_by") else []
    return "\n".join(
        [
            f"# One gateway node, {r['devices']:,} devices "
            f"({'quick' if r['quick'] else 'full'}; {r['broker']})",
            "",
            *limit,
            "| figure | value |",
            "|---|---|",
            f"| devices held / subscribed (QoS 0 commands) | {h['held']:,} / {h['subscribed']:,} "
            f"of {h['devices']:,} |",
            f"| connect rate | {h['connect_per_s']}/s (p99 {h['connect_ms'].get('p99')} ms) |",
            f"| gateway memory per device, end of the hold (peak) | {h['kb_per_device_last']} KB "
            f"({h['kb_per_device']} KB) |",
            f"| gateway resident memory before / peak | {h['rss_mb_before']} MB / {h['rss_mb_peak']} MB |",
            f"| readings sent / acknowledged / lost "
            f"| {up.get('sent')} / {up.get('acked')} / {up.get('lost')} |",
            f"| reading latency p50 / p99 | {lat.get('p50')} / {lat.get('p99')} ms |",
            f"| CPU over the run, cores | {cores} |",
            "",
        ]
    )
