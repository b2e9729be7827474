"""The name devices resolve, `mqtt.<domain>`, answered as Route53 latency records with health
checks answer it in the cloud, by PowerDNS Authoritative (4.7, Debian 12's) -- for the local
federation and for anyone who runs regions outside AWS.

What a device gets: the healthy gateway addresses of the region nearest to its client network
that has one; the next nearest region's when none of them is healthy; the nearest again once
one is back; the nearest region's whole list when no region has a healthy gateway (as Route53
answers when every record is unhealthy: devices keep trying where they belong).  "Nearest" is
an order of regions per client network, given here: the local federation puts each region's
own client network first (infra/local), an operator lists them as their networks reach their
sites.

How: one LUA record.  PowerDNS runs its Lua per query with `bestwho` the client's address (or
its EDNS client subnet); the record holds, for each client network, the answer already
decided, so the Lua only finds the network.  Health is an input here (`ZoneSpec.healthy`):
the MQTT checks of infra/dns/health.py decide it, and the zone is written again when it
changes.  PowerDNS's own `ifportup` is not used: it only opens a TCP connection, which the
kernel of a hung broker still completes.  Checked on PowerDNS 4.7.3
(tests/integration/test_dns.py).

The alternative the issue names -- a GeoIP database of the federation's own networks for
`pickclosest` -- needs the geoip backend and a MaxMind file written for each change; this
needs neither, and its order is the operator's, not a distance.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backend import contract as c

#: The name devices resolve, under the zone's domain.
MQTT_LABEL = "mqtt"


class ZoneError(ValueError):
    pass


@dataclass(frozen=True)
class ZoneSpec:
    """What the zone answers: for each client network (CIDR) its regions nearest first; for
    each region its gateways' addresses; the MQTT port the health checks connect to; and
    which of the addresses are healthy now."""

    domain: str
    regions: Mapping[str, Sequence[str]]
    client_networks: Sequence[tuple[str, Sequence[str]]]
    mqtt_port: int = 1883
    #: seconds a resolver keeps an answer (the cloud's `dns_ttl`)
    ttl: int = 5
    #: the zone's own name server's address (its NS record)
    nameserver: str = "127.0.0.1"
    #: each region's addresses that answered their last checks (a region left out has none);
    #: None: every address counts as healthy (a zone written before any check)
    healthy: Mapping[str, Sequence[str]] | None = None

    def check(self) -> ZoneSpec:
        labels = self.domain.split(".")
        if not self.domain or not all(lb and lb.replace("-", "").isalnum() for lb in labels):
            raise ZoneError(f"domain: not a DNS name: {self.domain!r}")
        for region, addresses in self.regions.items():
            c.validate_region(region)
            if not addresses:
                raise ZoneError(f"{region}: no gateway address")
            for a in addresses:
                _address(a, region)
        for cidr, order in self.client_networks:
            try:
                ipaddress.ip_network(cidr)
            except ValueError as e:
                raise ZoneError(f"client network {cidr!r}: {e}") from e
            unknown = [r for r in order if r not in self.regions]
            if not order or unknown:
                raise ZoneError(f"client network {cidr}: regions {list(order)} (unknown: {unknown})")
        for region, up in (self.healthy or {}).items():
            stray = [a for a in up if region not in self.regions or a not in self.regions[region]]
            if stray:
                raise ZoneError(f"healthy: {region}: {stray} is no gateway address of the region")
        if not 0 < self.mqtt_port < 65536:
            raise ZoneError(f"mqtt_port: {self.mqtt_port} is not a TCP port")
        if self.ttl < 0:
            raise ZoneError(f"ttl: {self.ttl} < 0")
        _address(self.nameserver, "nameserver")
        return self

    def default_order(self) -> list[str]:
        """What a client in no listed network gets: the regions in their listed order."""
        return list(self.regions)

    def order_for(self, client: str) -> list[str]:
        """The regions nearest first for a client address (the first network that holds it)."""
        ip = ipaddress.ip_address(client)
        for cidr, order in self.client_networks:
            if ip in ipaddress.ip_network(cidr):
                return list(order)
        return self.default_order()

    def healthy_addresses(self, region: str) -> list[str]:
        """The region's healthy addresses, in the region's own order (answers stay the same
        whatever order the checks came back in)."""
        if self.healthy is None:
            return list(self.regions[region])
        up = set(self.healthy.get(region, ()))
        return [a for a in self.regions[region] if a in up]

    def answer(self, order: Sequence[str]) -> list[str]:
        """What a client with regions `order` (nearest first) is told: the first region's with a
        healthy address, its healthy ones; with none healthy, all of the nearest's."""
        for region in order:
            if up := self.healthy_addresses(region):
                return up
        return list(self.regions[order[0]]) if order else []

    def answer_for(self, client: str) -> list[str]:
        return self.answer(self.order_for(client))


def _address(a: str, who: str) -> str:
    try:
        return str(ipaddress.ip_address(a))
    except ValueError as e:
        raise ZoneError(f"{who}: {a!r} is not an IP address") from e


def _lua_list(items: Sequence[str]) -> str:
    # every item was checked (an IP address, a region name, a CIDR): no quote can be in it
    return "{" + ", ".join(f"'{i}'" for i in items) + "}"


def lua_answer(spec: ZoneSpec) -> str:
    """The Lua of the record: each client network's answer, decided here (see the module
    docstring); a client in no listed network gets the default order's."""
    spec.check()
    nets = ", ".join(f"{{'{cidr}', {_lua_list(spec.answer(order))}}}" for cidr, order in spec.client_networks)
    return (
        f"local nets = {{{nets}}} "
        "local client = bestwho:toString() "
        "for _, n in ipairs(nets) do "
        "if newNetmask(n[1]):match(client) then return n[2] end "
        "end "
        f"return {_lua_list(spec.answer(spec.default_order()))}"
    )


def zone_file(spec: ZoneSpec, serial: int = 1) -> str:
    """The zone in BIND format (PowerDNS's bind backend reads it)."""
    spec.check()
    d = spec.domain.rstrip(".") + "."
    lines = [
        f"$TTL {spec.ttl}",
        f"@ IN SOA ns1.{d} hostmaster.{d} {serial} 3600 600 86400 {spec.ttl}",
        f"@ IN NS ns1.{d}",
        f"ns1 IN A {spec.nameserver}",
    ]
    if spec.regions:  # a federation without a region has no gateway to name
        lines.append(f'{MQTT_LABEL} {spec.ttl} IN LUA A ";{lua_answer(spec)}"')
    return "\n".join([*lines, ""])
