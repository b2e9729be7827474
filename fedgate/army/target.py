"""What the fleet runs against (Target), and fedgate's own federation as one.

A Target says where each device connects, how commands are sent and where
the readings must land; the benchmarks build another for their baseline
(bench/baseline.py), so the same army measures both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend import contract as c
from fedgate.army.plan import ArmyPlan, DeviceSpec
from fedgate.army.resolving import DnsConfig
from fedgate.army.verify import CommandOpener


def router_commands(url: str | list[str]) -> CommandOpener:
    """Commands through fedgate's router: fedgate.commands on the backend, publisher confirms."""

    def opener() -> tuple[Callable[[str, bytes], None], Callable[[], None]]:
        import pika

        from backend.amqp import connect

        conn = connect(url)
        ch = conn.channel()
        ch.confirm_delivery()

        def send(device: str, body: bytes) -> None:
            ch.basic_publish(
                c.COMMANDS_EXCHANGE,
                device,
                body,
                pika.BasicProperties(
                    delivery_mode=pika.DeliveryMode.Persistent,
                    headers={c.DEVICE_HEADER: device, c.TOPIC_HEADER: c.device_command_topic(device, "set")},
                ),
                mandatory=True,
            )

        return send, conn.close

    return opener


@dataclass
class Target:
    """What the fleet runs against: where each device connects, where its readings must land."""

    name: str
    specs: list[DeviceSpec]
    regions: list[str]
    kafka_bootstrap: str
    kafka_topic: str = c.KAFKA_TELEMETRY_TOPIC
    commands: CommandOpener | None = None
    ca_file: str | None = None
    #: kill(region) and restart(region) for plan.kill_gateway
    kill: Callable[[str], None] | None = None
    restart: Callable[[str], None] | None = None
    #: False: readings are not looked up in Kafka (a reference that stops short of it)
    verify: bool = True
    #: where devices with client networks (DeviceSpec.networks) resolve their gateway
    dns: DnsConfig | None = None


def federation_target(fed: Any, plan: ArmyPlan, say: Callable[[str], None]) -> Target:
    """The local federation `fed` (infra.local.driver.LocalFederation), devices registered in it."""
    from infra.local.driver import gateway_node_name

    ep = fed.endpoints()
    regions = plan.regions or sorted(ep["gateways"])
    missing = [r for r in regions if r not in ep["gateways"]]
    if missing:
        raise ValueError(f"no gateway for {missing}; the federation has {sorted(ep['gateways'])}")
    port_kind = "mqtts" if plan.tls else "mqtt"
    if plan.tls and not ep.get("tls"):
        raise ValueError("--tls: the federation runs without TLS (FEDGATE_TLS=0)")
    all_regions = sorted(ep["gateways"])
    ids = [f"{plan.prefix}-{i:05d}" for i in range(plan.devices)]
    say(f"registering {len(ids)} devices (fedgate devices add --rotate)")
    secrets = fed.add_devices(ids, rotate=True)

    dns = ep.get("dns")

    def nodes_of(region: str, i: int) -> list[tuple[str, str, int]]:
        # a region's gateway cluster (the ha profile): devices spread over its nodes, each
        # moving to the next node of its region before another region
        members = ep["gateways"][region].get("nodes") or [ep["gateways"][region]]
        k = i % len(members)
        return [(region, m["address"], m[port_kind]) for m in members[k:] + members[:k]]

    specs = []
    for i, d in enumerate(ids):
        home = regions[i % len(regions)]
        order = [home] + [r for r in all_regions if r != home]
        if dns:  # the device lives in its home region's client network and asks DNS from there
            networks = tuple((r, dns["client_networks"][r]) for r in order)
            specs.append(DeviceSpec(d, secrets[d], networks=networks, pick=i // len(regions)))
        else:  # a federation recorded before it had a DNS server: its gateways, nearest first
            endpoints = tuple(e for r in order for e in nodes_of(r, i // len(regions)))
            specs.append(DeviceSpec(d, secrets[d], endpoints))
    tls = ep.get("tls") if plan.tls else None
    return Target(
        "fedgate",
        specs,
        regions,
        ep["kafka"]["bootstrap"],
        commands=router_commands(ep["backend"]["urls"]),
        ca_file=tls["ca"] if tls else None,
        kill=lambda region: fed.node(gateway_node_name(region)).kill(),
        restart=lambda region: fed.start_node(gateway_node_name(region)),
        dns=DnsConfig.of_federation(ep, port_kind) if dns else None,
    )
