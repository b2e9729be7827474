"""How an army device finds its gateway by DNS, as the simulated devices of the tests do
(fedgate/dns_resolver.py).

Each device lives in a client network (its region's, DeviceSpec.networks) and asks the
federation's DNS server for `mqtt.<domain>`.  The devices of one network in one worker share
one cached answer, asked from the network's first address: a site's recursive resolver, the
way thousands of devices behind one carrier resolve -- so a worker asks each network once per
TTL, not each device.  A device's connection goes out from its own address in that network,
and roaming is a change of network: the device asks anew from the other one.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from fedgate.dns_resolver import DnsResolver, device_address
from fedgate.resolver import Endpoint
from infra.dns.query import DnsServer


@dataclass(frozen=True)
class DnsConfig:
    """Where the army's devices resolve their gateway (pickled to each worker)."""

    host: str
    port: int
    name: str
    mqtt_port: int
    #: gateway address -> region, to name where a device landed
    regions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_federation(cls, ep: dict, port_kind: str = "mqtt") -> DnsConfig:
        """From a local federation's endpoints(): its DNS server, for MQTT or MQTT over TLS."""
        dns = ep["dns"]
        regions = {n["address"]: r for r, gw in ep["gateways"].items() for n in (gw.get("nodes") or [gw])}
        first = next(iter(ep["gateways"].values()))
        return cls(dns["host"], dns["port"], dns["name"], first[port_kind], regions)


class SiteResolvers:
    """One DNS cache per client network, shared by a worker's devices in it."""

    def __init__(self, config: DnsConfig):
        self.config = config
        self._by_network: dict[str, DnsResolver] = {}

    def resolver(self, network: str) -> DnsResolver:
        r = self._by_network.get(network)
        if r is None:
            cfg = self.config
            site = str(ipaddress.ip_network(network).network_address + 1)
            r = DnsResolver(
                DnsServer(cfg.host, cfg.port), cfg.name, cfg.mqtt_port, source=site, regions=cfg.regions
            )
            self._by_network[network] = r
        return r

    def where(
        self, device_id: str, network: str, lost: tuple[str, int] | None, pick: int
    ) -> tuple[Endpoint, str]:
        """The gateway a device of `network` dials now (not the one it just lost if the answer
        holds another), and the device's own address to dial from.  NoHealthyGatewayError when
        the server does not answer."""
        exclude = [Endpoint("?", *lost)] if lost else []
        return self.resolver(network).resolve(exclude, pick=pick), device_address(network, device_id)

    @property
    def questions(self) -> int:
        return sum(r.questions for r in self._by_network.values())
