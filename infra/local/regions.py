"""Regions of a running local federation: adding one, removing one, telling the routers.

A region joins with its own gateway (one node, or a cluster of three in the ha
profile); nothing else restarts.  The
backend gets the region's upstream and downlink exchange and registers the
region (re-wiring); the routers read the registry every few seconds
(router/region_watch.py), and the driver waits until each has the region
before DNS sends devices there.  Removing is the reverse, in the order
RabbitMQ 3.10 needs.  Apart from booting because it changes a federation that
is already up, and keeps federation.json, secrets.json and the façade's
settings in step while it does.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from typing import TYPE_CHECKING

from backend import contract as c
from backend.polling import wait_until
from backend.rabbitmq_admin import AdminError
from infra.local.dns_node import DnsNode
from infra.local.layout import ROLE_GATEWAY, FederationError, gateway_node_name, port_layout
from infra.local.nodes import Node, NodeError, start_and_wait, stop_started
from infra.local.prometheus_node import PrometheusNode
from infra.local.services import RouterNode

if TYPE_CHECKING:
    from infra.local.driver import LocalFederation
    from infra.local.status import NodeStatus


class RegionChanges:
    """Adds and removes the regions of `fed`, a running LocalFederation."""

    def __init__(self, fed: LocalFederation):
        self.fed = fed

    def add(self, region: str) -> list[NodeStatus]:
        """Start a gateway for `region` and join it to the running federation."""
        fed = self.fed
        c.validate_region(region)
        recorded = fed.recorded()
        name = gateway_node_name(region)
        if not recorded or not fed.backend().is_running():
            raise FederationError("the local federation is not running; start it with `fedgate up`")
        if name in recorded and fed.node(name).is_running():
            fed.progress(f"region {region} is already part of the federation")
            return fed.status()
        if region not in fed.settings.regions:
            fed.settings = dataclasses.replace(fed.settings, regions=(*fed.settings.regions, region))
        specs = port_layout(fed.settings, recorded)
        nodes = fed.nodes(specs)
        # the region's gateway: one node, or a cluster of them (the ha profile)
        members = [n for n in nodes if n.spec.role == ROLE_GATEWAY and n.spec.region == region]
        gateway = next(n for n in members if n.name == name)
        try:
            for n in members:
                n.preflight()
        except NodeError as e:
            raise FederationError(str(e)) from e
        fed.files.write_record(specs, fed.settings.host)
        t0 = time.monotonic()
        started: list[Node] = []
        try:
            start_and_wait(members, started, boot_timeout=fed.settings.boot_timeout, progress=fed.progress)
            fed.wire(nodes)
            self.wait_for_routers(nodes)
            self.reload_dns(nodes)
        except (NodeError, AdminError, TimeoutError) as e:
            fed.progress(f"error: {e}; removing {region} again")
            stop_started(started)
            self.forget(region)
            raise FederationError(str(e)) from e
        fed.progress(
            f"region {region} joined in {time.monotonic() - t0:.1f}s "
            f"(MQTT on {gateway.spec.bind_address('mqtt', fed.settings.host)}:{gateway.spec.ports['mqtt']})"
        )
        return fed.status()

    def remove(self, region: str) -> None:
        """Stop a region's gateway and remove every trace of it from the federation."""
        fed = self.fed
        name = gateway_node_name(region)
        if name not in fed.recorded():
            fed.progress(f"region {region} is not part of the federation")
            return
        gateways = [g for g in fed.gateways() if g.spec.region != region]
        if not gateways:
            raise FederationError(f"{region} is the last region; a federation needs one gateway")
        members = [g for g in fed.gateways() if g.spec.region == region]
        for node in members:
            fed.progress(f"stopping {node.name}")
            node.stop()
        self.forget(region)
        self.reload_dns(fed.nodes())  # its devices' answers move to the next region at once
        for node in members:
            shutil.rmtree(node.dir, ignore_errors=True)
        backend = fed.backend()
        if backend.is_running():
            # The reverse of joining: the upstream sets drop the region first (RabbitMQ
            # stops its links) and the registry forgets it, the routers stop sending there,
            # and only then do its upstream and exchange go.  Deleting the upstream while a
            # set still named it made RabbitMQ 3.10 fail the next set update (HTTP 500,
            # link not_found).
            fed.wire(fed.nodes())
            self.wait_for_routers(fed.nodes())
            backend.admin().remove_gateway(region, c.gateway_upstream_name(region))
        fed.progress(f"region {region} removed")

    def forget(self, region: str) -> None:
        """Drop `region` from federation.json, the settings and secrets.json."""
        fed = self.fed
        specs = [s for s in fed.recorded().values() if not (s.role == ROLE_GATEWAY and s.region == region)]
        fed.files.write_record(specs, fed.settings.host)
        fed.settings = dataclasses.replace(
            fed.settings, regions=tuple(r for r in fed.settings.regions if r != region)
        )
        fed.files.forget_gateway(region)

    def reload_dns(self, nodes: list[Node]) -> None:
        """The DNS server's zone rewritten from federation.json and read again; Prometheus's
        targets too."""
        for n in nodes:
            if isinstance(n, PrometheusNode) and n.is_running():
                n.reload()
        for n in nodes:
            if isinstance(n, DnsNode) and n.is_running():
                n.reload()
                self.fed.progress(f"{n.name} answers for {', '.join(self.fed.settings.regions)}")

    #: How long the routers have to read a change of the registry (their regions_poll_s is
    #: 5 s by default).
    ROUTERS_TIMEOUT_S = 60.0

    def wait_for_routers(self, nodes: list[Node]) -> None:
        """Until every running router routes to exactly the federation's regions (its
        /regions), which it reads from the backend's registry by itself."""
        fed = self.fed
        want = sorted(fed.settings.regions)
        for r in nodes:
            if not (isinstance(r, RouterNode) and r.is_running()):
                continue
            if (have := self._routes_once_right(r, want)) != want:
                raise TimeoutError(
                    f"{r.name} routes to {have}, not {want}, after {self.ROUTERS_TIMEOUT_S:g}s"
                )
            fed.progress(f"{r.name} routes to {', '.join(want)}")

    def _routes_once_right(self, r: RouterNode, want: list[str]) -> list[str] | None:
        """What `r` routes to: `want` once it does, else the last it said at the timeout."""
        have: list[str] | None = None

        def right() -> bool:
            nonlocal have
            have = r.regions()
            return have == want

        wait_until(right, self.ROUTERS_TIMEOUT_S, 0.5)
        return have
