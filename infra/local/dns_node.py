"""The local federation's DNS server: PowerDNS answering `mqtt.<dns_domain>` for its devices
(infra/dns), as Route53 does in the cloud.

Its zone follows the federation's record: each region's gateway addresses (each gateway node
takes MQTT on a loopback address of its own, infra/local/layout.py), and each region's client
network -- the addresses that region's devices ask from -- with that region first and the
others after it in the federation's order.  A region added or removed rewrites the zone and
the running server reads it again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from infra.dns.powerdns import PowerDNS, missing
from infra.dns.query import DnsQueryError, DnsServer, ask_server
from infra.dns.zone import MQTT_LABEL, ZoneSpec
from infra.local.layout import (
    NodeSpec,
    StateFiles,
    client_network,
    gateway_clusters,
    gateway_slot,
)
from infra.local.nodes import Node, NodeError
from infra.local.settings import LocalSettings


def zone_spec(settings: LocalSettings, specs: Iterable[NodeSpec]) -> ZoneSpec:
    """What the federation's zone answers (see the module docstring)."""
    clusters = gateway_clusters(specs)
    regions = {r: [m.bind_address("mqtt", settings.host) for m in members] for r, members in clusters.items()}
    networks = [
        (
            client_network(settings.address_block, gateway_slot(members[0], settings.port_base)),
            [r, *(o for o in clusters if o != r)],
        )
        for r, members in clusters.items()
    ]
    return ZoneSpec(
        domain=settings.dns_domain,
        regions=regions,
        client_networks=networks,
        mqtt_port=settings.mqtt_port,
        ttl=settings.dns_ttl,
        nameserver=settings.host,
    ).check()


def dns_endpoint(settings: LocalSettings, node: NodeSpec, specs: Iterable[NodeSpec]) -> dict[str, Any]:
    """What a device needs to resolve its gateway: the server, the name, each region's network."""
    clusters = gateway_clusters(specs)
    return {
        "host": settings.host,
        "port": node.ports["dns"],
        "name": f"{MQTT_LABEL}.{settings.dns_domain}",
        "ttl": settings.dns_ttl,
        "health_check_interval": settings.health_check_interval,
        "client_networks": {
            r: client_network(settings.address_block, gateway_slot(members[0], settings.port_base))
            for r, members in clusters.items()
        },
    }


class DnsNode(Node):
    """PowerDNS in the foreground, its files in the node's folder."""

    def server(self) -> PowerDNS:
        specs = StateFiles(self.settings.state_dir).recorded().values()
        return PowerDNS(
            self.dir / "pdns",
            zone_spec(self.settings, specs),
            address=self.host,
            port=self.spec.ports["dns"],
            health_check_interval=self.settings.health_check_interval,
        )

    def preflight(self) -> None:
        if why := missing():
            raise NodeError(f"{self.name}: {why}")
        super().preflight()

    def prepare(self) -> None:
        self.server().write()

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        return self.server().argv(), self.base_env(), None

    def ready(self) -> bool:
        """It answers the name: from each region's client network once, which also starts the
        health checks of that network's gateways (PowerDNS starts a check at its first question
        and counts the address down until the check ran)."""
        server = DnsServer(self.host, self.spec.ports["dns"])
        specs = StateFiles(self.settings.state_dir).recorded().values()
        try:
            for cidr in dns_endpoint(self.settings, self.spec, specs)["client_networks"].values():
                ask_server(server, f"{MQTT_LABEL}.{self.settings.dns_domain}", cidr.rsplit(".", 1)[0] + ".1")
        except DnsQueryError:
            return False
        return True

    def answers(self) -> dict[str, str]:
        """What it answers each region's client network now (`fedgate status`)."""
        specs = list(StateFiles(self.settings.state_dir).recorded().values())
        ep = dns_endpoint(self.settings, self.spec, specs)
        server = DnsServer(self.host, self.spec.ports["dns"])
        out = {}
        for region, cidr in ep["client_networks"].items():
            try:
                out[region] = ", ".join(ask_server(server, ep["name"], cidr.rsplit(".", 1)[0] + ".1")[0])
            except DnsQueryError as e:
                out[region] = f"no answer ({e})"
        return out

    def status_line(self) -> str:
        """One line for `fedgate status`: the name, the server, and each network's answer."""
        if not self.is_running():
            return f"dns: {self.name} is not running: devices cannot resolve their gateway"
        specs = list(StateFiles(self.settings.state_dir).recorded().values())
        ep = dns_endpoint(self.settings, self.spec, specs)
        answers = self.answers()
        return (
            f"dns: {ep['name']} at {self.host}:{ep['port']} (TTL {ep['ttl']} s, checks every "
            f"{ep['health_check_interval']} s); "
            + "; ".join(f"{r} ({ep['client_networks'][r]}) -> {a}" for r, a in answers.items())
        )

    def reload(self, serial: int) -> None:
        """The zone rewritten from the federation's record and read again (a region added or removed)."""
        server = self.server()
        server.reload(server.spec, serial)
        self.settle()

    def settle(self) -> bool:
        """Wait until each region's network is answered its own region's gateways: PowerDNS
        starts checking an address at the first question that needs it and counts it down
        until then, so a region just added (or a server just started) would send its devices
        to the next region for one check interval.  False if that did not happen in time."""
        specs = list(StateFiles(self.settings.state_dir).recorded().values())
        zone = zone_spec(self.settings, specs)
        ep = dns_endpoint(self.settings, self.spec, specs)
        server = DnsServer(self.host, self.spec.ports["dns"])
        deadline = time.monotonic() + 2 * self.settings.health_check_interval + 3
        while True:
            try:
                wrong = [
                    r
                    for r, cidr in ep["client_networks"].items()
                    if not set(ask_server(server, ep["name"], cidr.rsplit(".", 1)[0] + ".1")[0])
                    <= set(zone.regions[r])
                ]
            except DnsQueryError:
                wrong = ["?"]
            if not wrong:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
