"""The name devices resolve, `mqtt.<domain>`, answered as Route53 latency records with health
checks answer it in the cloud, by PowerDNS Authoritative (4.7, Debian 12's) -- for the local
federation and for anyone who runs regions outside AWS.

What a device gets: the gateway addresses of the region nearest to its client network whose
gateway is healthy; the next nearest region's when none of them is; the nearest again once it
is back; the nearest region's when no region is healthy (as Route53 answers when every record
is unhealthy).  "Nearest" is an order of regions per client network, given here: the local
federation puts each region's own client network first (infra/local), an operator lists them
as their networks reach their sites.

How: one LUA record.  PowerDNS runs its Lua per query, with `bestwho` the client's address (or
its EDNS client subnet), and `ifportup(port, addresses, options)` checks each address's TCP port
in the background every `lua-health-checks-interval` seconds.  PowerDNS 4.7 has no selector
that picks in order ("first healthy"), and ifportup returns *something* even when every
address is down (its backup selector), so a region's health is read with a sentinel: an
address nothing listens on is checked beside the region's gateways, with selector and backup
selector `all`.  The sentinel is in the answer only when every address is down -- then the
region is skipped.  Checked on PowerDNS 4.7.3 (tests/integration/test_dns.py).

The alternative the issue names -- a GeoIP database of the federation's own networks for
`pickclosest` -- needs the geoip backend and a MaxMind file written for each change; this
needs neither, and its order is the operator's, not a distance.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backend import contract as c

#: Nothing listens here (a loopback address no local node uses): checked beside a region's
#: gateways, it is answered only when all of them are down.
SENTINEL = "127.255.255.254"
#: The name devices resolve, under the zone's domain.
MQTT_LABEL = "mqtt"


class ZoneError(ValueError):
    pass


@dataclass(frozen=True)
class ZoneSpec:
    """What the zone answers: for each client network (CIDR) its regions nearest first; for
    each region its gateways' addresses; the MQTT port the health check connects to."""

    domain: str
    regions: Mapping[str, Sequence[str]]
    client_networks: Sequence[tuple[str, Sequence[str]]]
    mqtt_port: int = 1883
    #: seconds a resolver keeps an answer (the cloud's `dns_ttl`)
    ttl: int = 5
    #: the zone's own name server's address (its NS record)
    nameserver: str = "127.0.0.1"

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


def _address(a: str, who: str) -> str:
    try:
        return str(ipaddress.ip_address(a))
    except ValueError as e:
        raise ZoneError(f"{who}: {a!r} is not an IP address") from e


def _lua_list(items: Sequence[str]) -> str:
    # every item was checked (an IP address, a region name, a CIDR): no quote can be in it
    return "{" + ", ".join(f"'{i}'" for i in items) + "}"


def lua_answer(spec: ZoneSpec) -> str:
    """The Lua of the record (see the module docstring)."""
    spec.check()
    regions = ", ".join(f"['{r}'] = {_lua_list(a)}" for r, a in spec.regions.items())
    nets = ", ".join(f"{{'{cidr}', {_lua_list(order)}}}" for cidr, order in spec.client_networks)
    return (
        f"local port = {spec.mqtt_port} "
        f"local sentinel = '{SENTINEL}' "
        f"local regions = {{{regions}}} "
        f"local nets = {{{nets}}} "
        f"local order = {_lua_list(spec.default_order())} "
        "local client = bestwho:toString() "
        "for _, n in ipairs(nets) do "
        "if newNetmask(n[1]):match(client) then order = n[2] break end "
        "end "
        "for _, r in ipairs(order) do "
        "local candidates = {} "
        "for _, a in ipairs(regions[r]) do table.insert(candidates, a) end "
        "table.insert(candidates, sentinel) "
        "local up = ifportup(port, candidates, {selector = 'all', backupSelector = 'all'}) "
        "if #up < #candidates then return up end "
        "end "
        "return regions[order[1]]"
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
