"""The backend's side of a cloud region, through the backend's management API.

The same definitions the local driver applies (backend/wiring.py), applied
with infra/rabbitmq_admin.py: an upstream per region pointing at the region's
load balancer, the region's downlink exchange and its link user, and the
upstream sets listing every registered region.  Idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend import contract as c
from backend.definitions import NodeDefinitions
from backend.wiring import (
    PRESENCE_UPSTREAM_SET,
    UPLINK_UPSTREAM_SET,
    AmqpEndpoint,
    GatewayLink,
    backend_definitions,
)
from infra.rabbitmq_admin import VHOST, RabbitAdmin


def register_regions(
    admin: RabbitAdmin,
    links: Sequence[GatewayLink],
    *,
    admin_password: str,
    backend_link_password: str,
    uplink_shards: int = c.UPLINK_SHARDS,
) -> NodeDefinitions:
    """Make the backend hold every region in `links` (the full set: the upstream sets list exactly these)."""
    d = backend_definitions(
        links,
        admin_password=admin_password,
        backend_link_password=backend_link_password,
        uplink_shards=uplink_shards,
    )
    admin.apply(d)
    return d


def deregister_region(admin: RabbitAdmin, region: str) -> None:
    """Remove the region's upstream, downlink exchange, federation queue and link user (idempotent)."""
    admin.remove_gateway(region, c.gateway_upstream_name(region))


def drop_upstream_sets(admin: RabbitAdmin) -> None:
    """No region left: the sets would name upstreams that no longer exist."""
    from urllib.parse import quote

    v = quote(VHOST, safe="")
    for name in (UPLINK_UPSTREAM_SET, PRESENCE_UPSTREAM_SET):
        admin.delete(f"parameters/federation-upstream-set/{v}/{quote(name, safe='')}")
    for policy in ("fedgate-uplink", "fedgate-presence"):
        admin.delete(f"policies/{v}/{policy}")


def link_for(region: str, amqp_endpoint: dict[str, Any], gateway_password: str) -> GatewayLink:
    """A GatewayLink from the gateway-region module's `amqp_endpoint` output."""
    ep = AmqpEndpoint(str(amqp_endpoint["host"]), int(amqp_endpoint["port"]), bool(amqp_endpoint.get("tls")))
    return GatewayLink(region, ep, gateway_password)


def rabbitmq_definitions(d: NodeDefinitions, rabbit_version: str = "3.10.8") -> dict[str, Any]:
    """`d` in RabbitMQ's definitions-file format, for `load_definitions` at a cloud node's boot."""
    return {
        "rabbit_version": rabbit_version,
        "global_parameters": [{"name": "cluster_name", "value": d.cluster_name}],
        "vhosts": [{"name": VHOST}],
        "users": [{"name": u.name, "password": u.password, "tags": ",".join(u.tags)} for u in d.users],
        "permissions": [
            {"user": p.user, "vhost": VHOST, "configure": p.configure, "write": p.write, "read": p.read}
            for p in d.permissions
        ],
        "exchanges": [
            {
                "name": x.name,
                "vhost": VHOST,
                "type": x.type,
                "durable": x.durable,
                "auto_delete": False,
                "internal": x.internal,
                "arguments": x.arguments,
            }
            for x in d.exchanges
        ],
        "queues": [
            {
                "name": q.name,
                "vhost": VHOST,
                "durable": q.durable,
                "auto_delete": False,
                "arguments": q.arguments,
            }
            for q in d.queues
        ],
        "bindings": [
            {
                "source": b.source,
                "vhost": VHOST,
                "destination": b.destination,
                "destination_type": b.destination_type,
                "routing_key": b.routing_key,
                "arguments": {},
            }
            for b in d.bindings
        ],
        "parameters": [
            {"component": p.component, "name": p.name, "vhost": VHOST, "value": p.value} for p in d.parameters
        ],
        "policies": [
            {
                "name": p.name,
                "vhost": VHOST,
                "pattern": p.pattern,
                "apply-to": p.apply_to,
                "definition": p.definition,
                "priority": p.priority,
            }
            for p in d.policies
        ],
    }
