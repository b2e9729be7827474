"""The local federation's DNS server: PowerDNS answering `mqtt.<dns_domain>` for its devices
(infra/dns), as Route53 does in the cloud, with the MQTT health checks that decide its answers;
one process, `python -m infra.dns.serve` (infra/dns/serve.py), PowerDNS its child.

Its zone follows the federation's record: each region's gateway addresses (each gateway node
takes MQTT on a loopback address of its own, infra/local/layout.py), and each region's client
network -- the addresses that region's devices ask from -- with that region first and the
others after it in the federation's order.  A region added or removed rewrites the node's
config file and the running server reads it again (SIGHUP).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from backend.polling import wait_until
from infra.dns.health import HealthChecks
from infra.dns.powerdns import missing
from infra.dns.query import DnsQueryError, DnsServer, ask_server
from infra.dns.serve import ServeConfig
from infra.dns.zone import MQTT_LABEL, ZoneSpec
from infra.local.layout import (
    NodeSpec,
    StateFiles,
    client_network_of,
    gateway_clusters,
)
from infra.local.nodes import Node, NodeError
from infra.local.settings import PROJECT_ROOT, LocalSettings


def zone_spec(settings: LocalSettings, specs: Iterable[NodeSpec]) -> ZoneSpec:
    """What the federation's zone answers (see the module docstring)."""
    clusters = gateway_clusters(specs)
    regions = {r: [m.bind_address("mqtt", settings.host) for m in members] for r, members in clusters.items()}
    networks = [
        (
            client_network_of(members[0], settings.address_block, settings.port_base),
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


def health_checks(settings: LocalSettings) -> HealthChecks:
    """How the DNS server checks the gateways: every `health_check_interval`, the timeout and
    failure threshold of infra/dns/health.py."""
    return HealthChecks(interval_s=float(settings.health_check_interval))


def dns_endpoint(settings: LocalSettings, node: NodeSpec, specs: Iterable[NodeSpec]) -> dict[str, Any]:
    """What a device needs to resolve its gateway: the server, the name, each region's network."""
    zone = zone_spec(settings, specs)
    checks = health_checks(settings)
    return {
        "host": settings.host,
        "port": node.ports["dns"],
        "name": f"{MQTT_LABEL}.{settings.dns_domain}",
        "ttl": settings.dns_ttl,
        "health_check_interval": settings.health_check_interval,
        "health_check_timeout": checks.timeout_s,
        "health_check_failure_threshold": checks.failure_threshold,
        # the longest a hung gateway is still answered, before a device's TTL
        "health_check_worst_case_s": checks.worst_case_down_s(),
        # each network's regions start with its own (zone_spec)
        "client_networks": {order[0]: cidr for cidr, order in zone.client_networks},
    }


class DnsNode(Node):
    """The DNS server and its health checks in the foreground, their files in the node's folder."""

    @property
    def config_path(self) -> Path:
        return self.dir / "serve.json"

    def _ask_each_network(self) -> tuple[ZoneSpec, dict[str, list[str]]]:
        """The zone, and what the server answers each region's network now (DnsQueryError if
        it does not answer), asked from the network's first address."""
        zone = zone_spec(self.settings, StateFiles(self.settings.state_dir).recorded().values())
        server = DnsServer(self.host, self.spec.ports["dns"])
        name = f"{MQTT_LABEL}.{zone.domain}"
        answers = {
            order[0]: ask_server(server, name, str(ipaddress.ip_network(cidr).network_address + 1))[0]
            for cidr, order in zone.client_networks
        }
        return zone, answers

    def config(self) -> ServeConfig:
        specs = StateFiles(self.settings.state_dir).recorded().values()
        return ServeConfig(
            folder=self.dir / "pdns",
            address=self.host,
            port=self.spec.ports["dns"],
            zone=zone_spec(self.settings, specs),
            checks=health_checks(self.settings),
            # what the federation's Prometheus scrapes (infra/local/prometheus_node.py)
            metrics_port=self.spec.ports.get("metrics", 0),
            webserver_port=self.spec.ports.get("webserver", 0),
        )

    def preflight(self) -> None:
        if why := missing():
            raise NodeError(f"{self.name}: {why}")
        super().preflight()

    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config().write(self.config_path)

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        env = self.base_env()
        env["PYTHONPATH"] = str(PROJECT_ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        return [sys.executable, "-m", "infra.dns.serve", "--config", str(self.config_path)], env, None

    def ready(self) -> bool:
        """It answers the name, from each region's client network (the server checked every
        gateway before it started answering)."""
        try:
            self._ask_each_network()
        except DnsQueryError:
            return False
        return True

    def answers(self) -> dict[str, str]:
        """What it answers each region's client network now (`fedgate status`)."""
        try:
            return {r: ", ".join(a) for r, a in self._ask_each_network()[1].items()}
        except DnsQueryError as e:
            specs = StateFiles(self.settings.state_dir).recorded().values()
            return dict.fromkeys(gateway_clusters(specs), f"no answer ({e})")

    def status_line(self) -> str:
        """One line for `fedgate status`: the name, the server, and each network's answer."""
        if not self.is_running():
            return f"dns: {self.name} is not running: devices cannot resolve their gateway"
        specs = list(StateFiles(self.settings.state_dir).recorded().values())
        ep = dns_endpoint(self.settings, self.spec, specs)
        answers = self.answers()
        return (
            f"dns: {ep['name']} at {self.host}:{ep['port']} (TTL {ep['ttl']} s, MQTT checks every "
            f"{ep['health_check_interval']} s); "
            + "; ".join(f"{r} ({ep['client_networks'][r]}) -> {a}" for r, a in answers.items())
        )

    def reload(self) -> None:
        """The zone rewritten from the federation's record and read again (a region added or
        removed): the server reads its config file again on SIGHUP and checks new gateways at once."""
        self.prepare()
        if (pid := self.pid()) is not None and self.is_running():
            os.kill(pid, signal.SIGHUP)
        self.settle()

    def settle(self) -> bool:
        """Wait until each region's network is answered its own region's gateways: a gateway
        (re)started counts up at its first check that passes, an interval at most after its
        listener opened; a region just added is checked as the server reads its config.  False
        if that did not happen in time."""
        checks = health_checks(self.settings)

        def right() -> bool:
            try:
                zone, answers = self._ask_each_network()
            except DnsQueryError:
                return False
            return all(set(got) <= set(zone.regions[r]) for r, got in answers.items())

        return wait_until(right, 2 * checks.interval_s + checks.timeout_s + 3, 0.2)
