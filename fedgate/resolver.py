"""What a device's resolver gives it: the gateway endpoint to dial.

Devices find their gateway through DNS (fedgate/dns_resolver.py): the fleet's one MQTT name,
answered with the nearest healthy region -- by the federation's PowerDNS locally
(infra/dns), by Route53 latency records in the cloud.  (The simulator once probed every
gateway's port itself and picked the fastest; a real device meets DNS, so the tests do too.)
"""

from __future__ import annotations

from dataclasses import dataclass


class NoHealthyGatewayError(ConnectionError):
    """The device's resolver has no gateway to give (the DNS server did not answer)."""


@dataclass(frozen=True)
class Endpoint:
    region: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.region} ({self.host}:{self.port})"
