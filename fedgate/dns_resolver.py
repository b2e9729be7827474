"""How a simulated device finds its gateway: it asks DNS, as a real device does.

A device resolves the fleet's one MQTT name (`mqtt.<domain>`) at its DNS server, from its own
address -- the address is what tells the server which client network, so which region, it
is in -- keeps the answer for its TTL, and connects to an address of the answer at the MQTT
port.  The server decides: the nearest region whose gateway is healthy (infra/dns/zone.py
locally, Route53 latency records in the cloud).  When its connection drops the device
connects to the answer it holds until the TTL runs out, then asks again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype

from fedgate.resolver import Endpoint, NoHealthyGatewayError

#: (addresses, ttl) for one question; raises on no answer.
Ask = Callable[[], tuple[list[str], int]]


@dataclass(frozen=True)
class DnsServer:
    host: str
    port: int


def ask_server(
    server: DnsServer, name: str, source: str | None, timeout: float = 2.0
) -> tuple[list[str], int]:
    """One A question to `server`, from `source` (the device's address): (addresses, TTL)."""
    query = dns.message.make_query(name, dns.rdatatype.A)
    try:
        reply = dns.query.udp(query, server.host, port=server.port, source=source, timeout=timeout)
    except (dns.exception.Timeout, OSError) as e:
        raise NoHealthyGatewayError(
            f"DNS server {server.host}:{server.port} did not answer {name}: {e}"
        ) from e
    if reply.rcode() != dns.rcode.NOERROR:
        raise NoHealthyGatewayError(
            f"{name}: {dns.rcode.to_text(reply.rcode())} from {server.host}:{server.port}"
        )
    answers = [rrset for rrset in reply.answer if rrset.rdtype == dns.rdatatype.A]
    addresses = [rr.address for rrset in answers for rr in rrset]
    if not addresses:
        raise NoHealthyGatewayError(f"{name}: no address in the answer of {server.host}:{server.port}")
    return addresses, min(rrset.ttl for rrset in answers)


class DnsResolver:
    """A device's resolver: the answer for `name`, kept for its TTL (the interface of
    fedgate.resolver.NearestHealthyResolver: `resolve(exclude)` gives the endpoint to dial)."""

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
    ):
        self.server, self.name, self.mqtt_port, self.source = server, name, mqtt_port, source
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
                addresses, ttl = self._ask()
                self.questions += 1
                self._cached = (addresses, now + ttl)
            return list(self._cached[0])

    def resolve(self, exclude: Iterable[Endpoint] = ()) -> Endpoint:
        """The first address of the answer (asked anew once its TTL ran out) that is not one
        the device just lost; the first anyway when the answer holds nothing else: a device
        dials what DNS gave it until DNS gives something else."""
        skip = {(e.host, e.port) for e in exclude}
        answer = self._answer()
        fresh = [a for a in answer if (a, self.mqtt_port) not in skip]
        return self._endpoint((fresh or answer)[0])
