"""How a device finds its gateway: the nearest healthy region, like Route53 latency records.

In the cloud, devices resolve the fleet's one MQTT hostname and Route53
answers with the lowest-latency region whose health check passes.  Locally
there is no DNS to ask, so the simulator does the same by hand: it probes each
candidate gateway's MQTT port (the TCP connect time is the latency, a refused
or timed-out connect is a failed health check) and takes the fastest healthy
one.  When its connection drops it resolves again without the gateway it
lost and connects to the next.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


class NoHealthyGatewayError(ConnectionError):
    """Every candidate gateway failed its probe."""


@dataclass(frozen=True)
class Endpoint:
    region: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.region} ({self.host}:{self.port})"


#: A probe returns the endpoint's latency in seconds, or None when it is unhealthy.
Probe = Callable[[Endpoint], float | None]


def tcp_connect_probe(timeout: float = 1.0) -> Probe:
    """Latency = time to open a TCP connection to the MQTT port; unhealthy if that fails."""

    def probe(ep: Endpoint) -> float | None:
        t0 = time.perf_counter()
        try:
            with socket.create_connection((ep.host, ep.port), timeout=timeout):
                return time.perf_counter() - t0
        except OSError:
            return None

    return probe


class NearestHealthyResolver:
    """`ordered`: the endpoints are the nodes of one region's gateway cluster, in the order
    this device tries them (as a client given a list of hosts, or a load balancer that keeps
    a device on one node while it is healthy): the first healthy one, not the fastest."""

    def __init__(self, endpoints: Sequence[Endpoint], probe: Probe | None = None, *, ordered: bool = False):
        if not endpoints:
            raise ValueError("no candidate gateways")
        self.endpoints = list(endpoints)
        self.probe = probe or tcp_connect_probe()
        self.ordered = ordered

    def rank(self, exclude: Iterable[Endpoint] = ()) -> list[tuple[Endpoint, float]]:
        """Healthy endpoints, nearest (or, ordered, first) first."""
        skip = set(exclude)
        measured = [(ep, self.probe(ep)) for ep in self.endpoints if ep not in skip]
        healthy = [(ep, lat) for ep, lat in measured if lat is not None]
        return healthy if self.ordered else sorted(healthy, key=lambda pair: pair[1])

    def resolve(self, exclude: Iterable[Endpoint] = ()) -> Endpoint:
        ranked = self.rank(exclude)
        if not ranked:
            raise NoHealthyGatewayError(
                "no healthy gateway among " + ", ".join(str(ep) for ep in self.endpoints)
            )
        return ranked[0][0]
