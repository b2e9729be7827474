"""How a simulated device finds its gateway: it asks DNS, as a real device does.

A device resolves the fleet's one MQTT name (`mqtt.<domain>`) at its DNS server, from its own
address -- the address is what tells the server which client network, so which region, it
is in -- keeps the answer for its TTL, and connects to an address of the answer at the MQTT
port.  The server decides: the nearest region whose gateway is healthy (infra/dns/zone.py
locally, Route53 latency records in the cloud).  When its connection drops the device
connects to the answer it holds until the TTL runs out, then asks again.
"""

from __future__ import annotations

import ipaddress
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fedgate.resolver import Endpoint, NoHealthyGatewayError
from infra.dns.query import DnsQueryError, DnsServer, ask_server

#: (addresses, ttl) for one question; raises on no answer.
Ask = Callable[[], tuple[list[str], int]]


class DnsResolver:
    """A device's resolver: the answer for `name`, kept for its TTL; `resolve(exclude)` gives
    the endpoint to dial (SimDevice asks it at every connect)."""

    def __init__(
        self,
        server: DnsServer,
        name: str,
        mqtt_port: int,
        *,
        source: str | None = None,
        regions: Mapping[str, str] | None = None,
        ask: Ask | None = None,
        clock: Callable[[], float] = time.monotonic,
        pick: int = 0,
    ):
        self.server, self.name, self.mqtt_port, self.source = server, name, mqtt_port, source
        #: which address of an answer with several (a region's gateway cluster) this device
        #: dials: the answer sorted, then this index (devices spread over a cluster's nodes)
        self.pick = pick
        #: gateway address -> region, to name the region of an answer (tests, the army's report)
        self.regions = dict(regions or {})
        self._ask = ask or (lambda: ask_server(server, name, source))
        self._clock = clock
        self._cached: tuple[list[str], float] | None = None  # addresses, expiry
        self._lock = threading.Lock()
        #: questions sent to the server (a device honouring the TTL asks once per TTL at most)
        self.questions = 0

    @property
    def endpoints(self) -> list[Endpoint]:
        """What the last answer held (asked now if there is none)."""
        return [self._endpoint(a) for a in self._answer()]

    def _endpoint(self, address: str) -> Endpoint:
        return Endpoint(self.regions.get(address, "?"), address, self.mqtt_port)

    def _answer(self) -> list[str]:
        with self._lock:
            now = self._clock()
            if self._cached is None or now >= self._cached[1]:
                try:
                    addresses, ttl = self._ask()
                except DnsQueryError as e:
                    raise NoHealthyGatewayError(str(e)) from e
                self.questions += 1
                self._cached = (addresses, now + ttl)
            return list(self._cached[0])

    def resolve(self, exclude: Iterable[Endpoint] = (), pick: int | None = None) -> Endpoint:
        """An address of the answer (asked anew once its TTL ran out) that is not one the
        device just lost -- the answer sorted, then `pick` (self.pick by default) -- or one
        it lost when the answer holds nothing else: a device dials what DNS gave it until DNS
        gives something else."""
        skip = {(e.host, e.port) for e in exclude}
        answer = sorted(self._answer(), key=ipaddress.ip_address)
        fresh = [a for a in answer if (a, self.mqtt_port) not in skip] or answer
        return self._endpoint(fresh[(self.pick if pick is None else pick) % len(fresh)])


def device_address(network: str, device_id: str) -> str:
    """A device's own address in its client network (the same one every time for an id)."""
    net = ipaddress.ip_network(network)
    return str(net.network_address + 1 + zlib.crc32(device_id.encode()) % (net.num_addresses - 2))


def resolver_for(endpoints: Mapping[str, Any], region: str, device_id: str, *, pick: int = 0) -> DnsResolver:
    """The resolver of a device that lives in `region` of a local federation (its
    `endpoints()`): it asks the federation's DNS server from an address of the region's client
    network."""
    dns_ep = endpoints["dns"]
    regions = {
        node["address"]: r for r, gw in endpoints["gateways"].items() for node in (gw.get("nodes") or [gw])
    }
    return DnsResolver(
        DnsServer(dns_ep["host"], dns_ep["port"]),
        dns_ep["name"],
        endpoints["gateways"][region]["mqtt"],
        source=device_address(dns_ep["client_networks"][region], device_id),
        regions=regions,
        pick=pick,
    )
