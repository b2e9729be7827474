"""The backend's side of a cloud region, through the backend's management API.

The same definitions the local driver applies (backend/wiring.py), applied
with backend/rabbitmq_admin.py: an upstream per region pointing at the region's
load balancer, the region's downlink exchange and its link user, and the
upstream sets listing every registered region.  Idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from backend import contract as c
from backend.definitions import NodeDefinitions
from backend.rabbitmq_admin import VHOST, RabbitAdmin
from backend.wiring import (
    PRESENCE_POLICY,
    PRESENCE_UPSTREAM_SET,
    UPLINK_POLICY,
    UPLINK_UPSTREAM_SET,
    AmqpEndpoint,
    GatewayLink,
    backend_definitions,
)


def register_regions(
    admin: RabbitAdmin,
    links: Sequence[GatewayLink],
    *,
    admin_password: str,
    backend_link_password: str,
    router_password: str | None = None,
    uplink_shards: int = c.UPLINK_SHARDS,
) -> NodeDefinitions:
    """Make the backend hold every region in `links` (the full set: the upstream sets list exactly
    these), and the routers' user when `router_password` is given."""
    d = backend_definitions(
        links,
        admin_password=admin_password,
        backend_link_password=backend_link_password,
        router_password=router_password,
        uplink_shards=uplink_shards,
    )
    admin.apply(d)
    return d


def deregister_region(admin: RabbitAdmin, region: str) -> None:
    """Remove the region's upstream, downlink exchange, federation queue and link user (idempotent)."""
    admin.remove_gateway(region, c.gateway_upstream_name(region))


def drop_upstream_sets(admin: RabbitAdmin) -> None:
    """No region left: the sets would name upstreams that no longer exist."""
    v = quote(VHOST, safe="")
    for name in (UPLINK_UPSTREAM_SET, PRESENCE_UPSTREAM_SET):
        admin.delete(f"parameters/federation-upstream-set/{v}/{quote(name, safe='')}")
    for policy in (UPLINK_POLICY, PRESENCE_POLICY):
        admin.delete(f"policies/{v}/{policy}")


#: Where the Terraform modules put each node's CA, certificate and key (rabbitmq-nodes, tls_files).
NODE_TLS_DIR = "/etc/rabbitmq/tls"


def link_for(region: str, amqp_endpoint: dict[str, Any], gateway_password: str) -> GatewayLink:
    """A GatewayLink from the gateway-region module's `amqp_endpoint` output.

    With TLS the backend node checks the gateway's certificate against the
    CA the backend module put on it, and its name against `server_name`
    (the load balancer's DNS name is not in the certificate).
    """
    tls = bool(amqp_endpoint.get("tls"))
    ep = AmqpEndpoint(
        str(amqp_endpoint["host"]),
        int(amqp_endpoint["port"]),
        tls,
        ca_file=f"{NODE_TLS_DIR}/ca.pem" if tls else "",
        server_name=str(amqp_endpoint.get("server_name") or "") if tls else "",
    )
    return GatewayLink(region, ep, gateway_password)
