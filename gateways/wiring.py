"""A gateway's side of the federation, as data (see backend/definitions.py).

A gateway holds device connections and nothing else of value.  It declares:

- the user the backend's federation links log in with, allowed to read only
  the MQTT exchange and the event exchange (plus the federation objects those
  links create);
- the downlink: exchange GATEWAY_DOWNLINK_EXCHANGE, federated from the
  backend's exchange for this region only, bound to the MQTT exchange with a
  single "#" binding.  No per-device binding ever reaches the backend;
- with `router_password`, the routers' user: tagged `monitoring`, which lets it
  read every connection, queue and binding through the management API (the
  presence and subscriptions it rebuilds), and with an empty permission on the
  vhost, which it needs to see the vhost's objects and which lets it neither
  publish nor consume nor declare.  It cannot read users or close connections
  (both need `administrator`): the router then lets its `unknown_device` setting
  decide for an id it has never seen, and leaves an older session of a device
  to expire by its keepalive (router/registry.py, router/gateways.py);
- no device users: each device has its own, added from the registry
  (backend/devices.py) to every gateway, so that a device can roam.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from backend import contract as c
from backend.definitions import (
    Binding,
    Exchange,
    NodeDefinitions,
    Parameter,
    Permission,
    Policy,
    Queue,
    User,
)
from backend.wiring import LINK_SETTINGS, AmqpEndpoint

DOWNLINK_UPSTREAM = "fedgate-backend"


def router_monitoring_user(password: str) -> tuple[User, Permission]:
    """The routers' user on a gateway: reads the management API, nothing over AMQP or MQTT."""
    return User(c.ROUTER_USER, password, ("monitoring",)), Permission(c.ROUTER_USER, "^$", "^$", "^$")


def gateway_definitions(
    region: str,
    backend: AmqpEndpoint,
    *,
    backend_others: Sequence[AmqpEndpoint] = (),
    upstream_queue_type: str = "classic",
    uplink_batching: bool = False,
    gateway_queue_type: str = "classic",
    admin_password: str,
    backend_link_password: str,
    gateway_password: str,
    router_password: str | None = None,
) -> NodeDefinitions:
    """Everything a region's gateway node holds."""
    region = c.validate_region(region)
    d = NodeDefinitions(cluster_name=c.gateway_cluster_name(region))
    d.users.append(User(c.ADMIN_USER, admin_password, ("administrator",)))
    d.permissions.append(Permission(c.ADMIN_USER, ".*", ".*", ".*"))

    if router_password is not None:
        user, permission = router_monitoring_user(router_password)
        d.users.append(user)
        d.permissions.append(permission)

    fed = "federation: .*"
    uplink = c.UPLINK_BATCHES_EXCHANGE if uplink_batching else c.MQTT_EXCHANGE
    sources = "|".join(re.escape(x) for x in (uplink, c.EVENT_EXCHANGE))
    if uplink_batching:
        # every device message into the batcher's queue (gateways/uplink_batcher_plugin): one
        # node's batcher reads it at a time, in order; a quorum queue on a gateway cluster
        # (gateway_queue_type), so that a reading a device was PUBACKed for outlives its node
        d.queues.append(
            Queue(
                c.UPLINK_BATCH_IN_QUEUE,
                arguments={"x-queue-type": gateway_queue_type, "x-single-active-consumer": True},
            )
        )
        d.bindings.append(Binding(c.MQTT_EXCHANGE, c.UPLINK_BATCH_IN_QUEUE, "queue", "#"))
        d.exchanges.append(Exchange(c.UPLINK_BATCHES_EXCHANGE, type="topic"))
    d.users.append(User(c.BACKEND_LINK_USER, backend_link_password))
    d.permissions.append(
        Permission(
            c.BACKEND_LINK_USER,
            configure=f"^{fed}$",
            write=f"^{fed}$",
            read=f"^({sources}|{fed})$",
        )
    )

    uris = [b.uri(c.gateway_link_user(region), gateway_password) for b in (backend, *backend_others)]
    d.exchanges.append(Exchange(c.GATEWAY_DOWNLINK_EXCHANGE))
    d.bindings.append(Binding(c.GATEWAY_DOWNLINK_EXCHANGE, c.MQTT_EXCHANGE, "exchange", "#"))
    d.parameters.append(
        Parameter(
            "federation-upstream",
            DOWNLINK_UPSTREAM,
            {
                # a backend cluster: the link connects to any of its nodes, the next when
                # its node dies (RabbitMQ tries them in random order)
                "uri": uris[0] if len(uris) == 1 else uris,
                "exchange": c.downlink_exchange(region),
                # the queue the link reads on the backend: a quorum queue survives one
                # backend node's death with what it holds (RabbitMQ 3.13.1+)
                **({"queue-type": upstream_queue_type} if upstream_queue_type != "classic" else {}),
                **LINK_SETTINGS,
            },
        )
    )
    d.policies.append(
        Policy(
            "fedgate-downlink",
            f"^{re.escape(c.GATEWAY_DOWNLINK_EXCHANGE)}$",
            "exchanges",
            {"federation-upstream": DOWNLINK_UPSTREAM},
        )
    )
    return d
