"""The HA profile through a sequence of faults: one node of each engine SIGKILLed in turn.

Under steady readings and commands the army runs while, FAULT_GAP_S apart, this kills

1. a gateway node of the first region (its devices move to the region's other nodes),
2. the Kafka broker leading most of the telemetry topic's partitions,
3. the router that routes commands (the other one takes over),
4. a backend node (the first: the one the backend cluster was formed on),

and leaves each down until the run ends, so that at the end every cluster runs on two
nodes of its three: what a production fleet lives through when a machine of each kind
fails within minutes, with nobody there to start it again.  Then it starts them again
and waits for the federation links, so the federation is whole afterwards.

What it reports is what a user would check: readings acknowledged and every one of them
in Kafka (lost 0), commands sent and delivered (lost 0, copies counted), and the commands'
latency from `send` to the device, p50 / p99 / max, which the goal bounds
(ha_bench.FAULT_COMMAND_P99_MS).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka.admin import AdminClient

from backend import contract as c
from fedgate import army
from infra.local.driver import LocalFederation
from infra.local.layout import kafka_broker_id
from infra.local.nodes import Node
from infra.local.services import RouterNode

#: readings/s, commands/s, seconds between kills, seconds of the run (by quick): the run
#: outlasts the last kill by a gap, so that what the last one disturbed is measured too
FAULT_PLAN = {True: (200, 10, 6.0, 30), False: (600, 20, 35.0, 175)}
KINDS = ("gateway", "kafka", "router", "backend")


def leading_broker(fed: LocalFederation) -> Node:
    """The Kafka node leading most partitions of the telemetry topic."""
    bootstrap = fed.endpoints()["kafka"]["bootstrap"]
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(c.KAFKA_TELEMETRY_TOPIC, timeout=10)
    leaders = [p.leader for p in md.topics[c.KAFKA_TELEMETRY_TOPIC].partitions.values()]
    most = max(set(leaders), key=leaders.count)
    return next(n for n in fed.nodes() if n.spec.role == "kafka" and kafka_broker_id(n.name) == most)


def leading_router(fed: LocalFederation) -> Node:
    """The router that routes commands now; the first router if none answers."""
    routers = [n for n in fed.nodes() if isinstance(n, RouterNode)]
    for r in routers:
        try:
            if r.metrics().get("fedgate_router_leading") == 1.0:
                return r
        except OSError:
            continue
    return routers[0]


def victim(fed: LocalFederation, kind: str) -> Node:
    """The node of `kind` to kill, chosen when it is killed (a leader may have moved)."""
    if kind == "gateway":
        return fed.gateways()[0]
    if kind == "kafka":
        return leading_broker(fed)
    if kind == "router":
        return leading_router(fed)
    return fed.backend()


def run(
    fed: LocalFederation,
    target: army.Target,
    plan_for: Callable[..., army.ArmyPlan],
    quick: bool,
    progress: Callable[[str], None],
    kinds: tuple[str, ...] = KINDS,
    plan: tuple[int, int, float, int] | None = None,
) -> dict[str, Any]:
    """The army through the fault sequence (`kinds`, in turn; `plan` the readings/s,
    commands/s, seconds between kills and of the run, FAULT_PLAN's by default); the killed
    nodes started again after it."""
    readings, commands, gap, seconds = plan or FAULT_PLAN[quick]
    running = threading.Event()
    killed: list[dict[str, Any]] = []
    nodes: list[Node] = []
    stop = threading.Event()

    def line(text: str) -> None:
        if text.startswith("running"):
            running.set()
        progress(text)

    def kill_in_turn() -> None:
        running.wait()
        t0 = time.monotonic()
        for i, kind in enumerate(kinds, start=1):
            if stop.wait(max(0.0, t0 + i * gap - time.monotonic())):
                return
            node = victim(fed, kind)
            progress(f"faults: SIGKILL {node.name} ({kind}), {i * gap:.0f} s into the run")
            node.kill()
            nodes.append(node)
            killed.append({"kind": kind, "node": node.name, "at_s": round(time.monotonic() - t0, 1)})

    killer = threading.Thread(target=kill_in_turn, name="ha-faults", daemon=True)
    killer.start()
    try:
        r = army.run_fleet(
            target,
            plan_for(rate=readings, duration_s=seconds, commands_per_s=commands),
            progress=progress,
            line=line,
        )
    finally:
        stop.set()
        running.set()
        killer.join()
        for node in nodes:  # the router last, as killed: it starts once the others answer
            fed.start_node(node.name)
        if nodes:
            fed.wait_for_links(timeout=120)
    up, down = r["uplink"], r["downlink"]
    return {
        "readings_per_s": readings,
        "commands_per_s": commands,
        "seconds": seconds,
        "killed": killed,
        "acked": up["acked"],
        "lost": up["lost"],
        "readings_latency_ms": up["latency_ms"],
        "commands": {
            k: down[k]
            for k in ("sent", "received", "lost", "duplicated", "latency_ms", "lost_sent_at_s", "lost_first")
        },
    }
