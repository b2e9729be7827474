"""The backend's side of the federation, as data (see backend/definitions.py).

The backend pulls from the gateways: for each region it defines a federation
upstream pointing at the region's gateway and uses it twice -- once for
device traffic (gateway ``amq.topic`` -> backend TELEMETRY_EXCHANGE) and once
for connection events (gateway ``amq.rabbitmq.event`` -> backend
PRESENCE_EXCHANGE).  Both links use ``ack-mode: on-confirm``: a message leaves
the gateway's federation queue only after the backend confirmed it, so a
backend outage is buffered on the gateway.

For the downlink the backend only declares one exchange per region; the
region's gateway pulls it (gateways/wiring.py) with its own credentials, which
may touch nothing but that exchange.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

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

UPLINK_UPSTREAM_SET = "fedgate-uplink"
PRESENCE_UPSTREAM_SET = "fedgate-presence"
#: The policies that point the backend's exchanges at those upstream sets.
UPLINK_POLICY = "fedgate-uplink"
PRESENCE_POLICY = "fedgate-presence"
#: The policy that returns commands a dead gateway's link does not take (see contract).
DOWNLINK_RETURN_POLICY = "fedgate-downlink-return"
POISON_POLICY = "fedgate-poison"


@dataclass(frozen=True)
class AmqpEndpoint:
    """Where a node's AMQP listener is reachable from its federation peer."""

    host: str
    port: int
    tls: bool = False
    #: with tls: the CA file (on the node that opens the link) the peer's certificate must chain to
    ca_file: str = ""
    #: with tls: the name the peer's certificate must carry (default: host)
    server_name: str = ""

    def uri(self, user: str, password: str) -> str:
        scheme = "amqps" if self.tls else "amqp"
        base = f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{self.host}:{self.port}"
        if not (self.tls and self.ca_file):
            return base
        # RabbitMQ's AMQP URI options: check the peer's certificate and its name
        query = {
            "cacertfile": self.ca_file,
            "verify": "verify_peer",
            "server_name_indication": self.server_name or self.host,
        }
        return base + "?" + "&".join(f"{k}={quote(v, safe='/')}" for k, v in query.items())


@dataclass(frozen=True)
class GatewayLink:
    """What the backend needs to know about one region's gateway cluster."""

    region: str
    endpoint: AmqpEndpoint
    #: password of the gateway's own user on the backend (its downlink link)
    gateway_password: str
    #: the other nodes of the region's gateway cluster: the backend's links to the region
    #: connect to any of them and move on when theirs dies
    others: tuple[AmqpEndpoint, ...] = ()
    #: the gateways batch their readings (gateways/uplink_batcher_plugin): the uplink link
    #: federates their batches' exchange rather than the MQTT exchange
    uplink_batching: bool = False

    def upstream(self, backend_link_password: str) -> dict[str, object]:
        """The backend's federation upstream for this region: every node's URI, and on a
        cluster, quorum queues for the links (what the gateway buffers survives a node)."""
        uris = [e.uri(c.BACKEND_LINK_USER, backend_link_password) for e in (self.endpoint, *self.others)]
        if len(uris) == 1:
            return {"uri": uris[0]}
        return {"uri": uris, "queue-type": "quorum"}


#: Federation link settings shared by every link fedgate defines.
LINK_SETTINGS = {
    # Ack the upstream only once the downstream confirmed: nothing is lost
    # when either side dies mid-transfer (duplicates are possible, bounded
    # by prefetch-count).
    "ack-mode": "on-confirm",
    # One hop only: a downlink command that reaches a gateway's amq.topic is
    # never carried back into telemetry.  (Federation's own cycle detection
    # by cluster name would also stop it; this is the second guard.)
    "max-hops": 1,
    "prefetch-count": 1000,
    "reconnect-delay": 1,
    "trust-user-id": False,
    # Keep the link's queue on the upstream (and what it holds) when the link stops.  By
    # default RabbitMQ deletes it with the link, so a link that merely restarts -- as
    # every backend link does when a node joins the backend cluster -- drops what the
    # gateway had buffered for it: 94 acknowledged readings in tests/chaos/
    # test_ha_node_loss.py before this.  The queues are named per link and reused.
    "resource-cleanup-mode": "never",
}


def backend_definitions(
    gateways: Sequence[GatewayLink],
    *,
    admin_password: str,
    backend_link_password: str,
    router_password: str | None = None,
    uplink_shards: int = c.UPLINK_SHARDS,
    downlink_return_after_ms: int = c.DOWNLINK_RETURN_AFTER_MS,
) -> NodeDefinitions:
    """Everything the backend node holds for the given set of gateways."""
    d = NodeDefinitions(cluster_name=c.BACKEND_CLUSTER_NAME)
    d.users.append(User(c.ADMIN_USER, admin_password, ("administrator",)))
    d.permissions.append(Permission(c.ADMIN_USER, ".*", ".*", ".*"))

    # The router's input for device-bound messages.  Single active consumer:
    # several routers may stand by, one routes at a time, in order.
    d.exchanges.append(Exchange(c.COMMANDS_EXCHANGE, type="fanout"))
    d.queues.append(
        Queue(c.COMMANDS_QUEUE, arguments={"x-queue-type": "quorum", "x-single-active-consumer": True})
    )
    # Which router routes commands (router/leadership.py): a token held by the active
    # consumer.  No delivery limit: the token is handed over once per leader that dies.
    d.queues.append(
        Queue(
            c.LEADER_QUEUE,
            arguments={"x-queue-type": "quorum", "x-single-active-consumer": True, "x-delivery-limit": -1},
        )
    )
    d.exchanges.append(Exchange(c.LEADER_EXCHANGE, type="fanout"))
    d.bindings.append(Binding(c.LEADER_EXCHANGE, c.LEADER_QUEUE, "queue", ""))
    if router_password is not None:
        d.users.append(User(c.ROUTER_USER, router_password))
        router_objs = r"fedgate\.router\..*"
        d.permissions.append(
            Permission(
                c.ROUTER_USER,
                configure=f"^{router_objs}$",
                write=f"^({router_objs}|{re.escape(c.DOWNLINK_EXCHANGE_PREFIX)}.*)$",
                read=f"^({router_objs}|{re.escape(c.PRESENCE_EXCHANGE)}|{re.escape(c.UPLINK_EXCHANGE)}\\.[0-9]+|"
                f"{re.escape(c.DOWNLINK_EXCHANGE_PREFIX)}.*)$",
            )
        )

    d.exchanges += [Exchange(c.TELEMETRY_EXCHANGE), Exchange(c.PRESENCE_EXCHANGE)]
    # Quorum: survives node restarts and, on a backend cluster, node loss.
    d.exchanges.append(Exchange(c.UPLINK_EXCHANGE, type="x-consistent-hash"))
    d.bindings.append(Binding(c.TELEMETRY_EXCHANGE, c.UPLINK_EXCHANGE, "exchange", "#"))
    for shard in range(uplink_shards):
        # Single active consumer: a shard is read by one router at a time, in order;
        # a second router on the same shard stands by and takes over.
        q = c.uplink_shard_queue(shard)
        d.queues.append(Queue(q, arguments={"x-queue-type": "quorum", "x-single-active-consumer": True}))
        d.bindings.append(Binding(c.UPLINK_EXCHANGE, q, "queue", "1"))  # weight 1 each
    # Fanout: the device id travels in a header (routing key = device id by convention).
    d.bindings.append(Binding(c.COMMANDS_EXCHANGE, c.COMMANDS_QUEUE, "queue", ""))
    # Devices' acknowledgements of commands they got at QoS 0 (router/acks.py), for the
    # router that routes commands; they also reach Kafka through the uplink like any reading.
    d.queues.append(
        Queue(c.ACKS_QUEUE, arguments={"x-queue-type": "quorum", "x-single-active-consumer": True})
    )
    ack_key = c.mqtt_topic_to_routing_key(c.device_ack_topic("*"))
    d.bindings.append(Binding(c.TELEMETRY_EXCHANGE, c.ACKS_QUEUE, "queue", ack_key))
    # A command its region's gateway does not take within the time comes back to
    # the router (RabbitMQ dead-letters it with x-death naming the queue), which
    # routes it again: moved on with its device, or parked.  The queues are the
    # ones each gateway's downlink link declares here.
    d.policies.append(
        Policy(
            DOWNLINK_RETURN_POLICY,
            f"^{re.escape(c.DOWNLINK_LINK_QUEUE_PREFIX)}",
            "queues",
            {"message-ttl": downlink_return_after_ms, "dead-letter-exchange": c.COMMANDS_EXCHANGE},
        )
    )

    # Poison: what the routers fail on again and again is set aside, never dropped.
    # RabbitMQ 4.0 gives quorum queues a delivery limit of 20 and drops what passes it;
    # here it is dead-lettered at least once (the source keeps it until the poison queue
    # confirmed, which needs reject-publish overflow; the queues have no length limit).
    d.exchanges.append(Exchange(c.POISON_EXCHANGE, type="fanout"))
    d.queues.append(Queue(c.POISON_QUEUE, arguments={"x-queue-type": "quorum"}))
    d.bindings.append(Binding(c.POISON_EXCHANGE, c.POISON_QUEUE, "queue", ""))
    inputs = [c.COMMANDS_QUEUE, c.ACKS_QUEUE] + [c.uplink_shard_queue(s) for s in range(uplink_shards)]
    d.policies.append(
        Policy(
            POISON_POLICY,
            "^(" + "|".join(re.escape(q) for q in inputs) + ")$",
            "quorum_queues",
            {
                "delivery-limit": c.POISON_DELIVERY_LIMIT,
                "dead-letter-exchange": c.POISON_EXCHANGE,
                "dead-letter-strategy": "at-least-once",
                "overflow": "reject-publish",
            },
        )
    )

    uplink_set = []
    presence_set = []
    for gw in gateways:
        region = c.validate_region(gw.region)
        upstream = c.gateway_upstream_name(region)
        d.parameters.append(
            Parameter(
                "federation-upstream",
                upstream,
                {**gw.upstream(backend_link_password), **LINK_SETTINGS},
            )
        )
        # batching gateways publish their readings' batches to an exchange of their own
        uplink = c.UPLINK_BATCHES_EXCHANGE if gw.uplink_batching else c.MQTT_EXCHANGE
        uplink_set.append({"upstream": upstream, "exchange": uplink})
        presence_set.append({"upstream": upstream, "exchange": c.EVENT_EXCHANGE})

        downlink = c.downlink_exchange(region)
        d.exchanges.append(Exchange(downlink))
        link_user = c.gateway_link_user(region)
        d.users.append(User(link_user, gw.gateway_password))
        # The gateway's link declares "federation: <exchange> -> <cluster>..."
        # objects here; it may create those and read its own downlink exchange
        # -- not another region's, and nothing else.
        own = re.escape(downlink)
        fed = f"federation: {own} -> .*"
        d.permissions.append(
            Permission(link_user, configure=f"^{fed}$", write=f"^{fed}$", read=f"^({own}|{fed})$")
        )

    if uplink_set:
        d.parameters.append(Parameter("federation-upstream-set", UPLINK_UPSTREAM_SET, uplink_set))
        d.parameters.append(Parameter("federation-upstream-set", PRESENCE_UPSTREAM_SET, presence_set))
        d.policies.append(
            Policy(
                UPLINK_POLICY,
                f"^{re.escape(c.TELEMETRY_EXCHANGE)}$",
                "exchanges",
                {"federation-upstream-set": UPLINK_UPSTREAM_SET},
            )
        )
        d.policies.append(
            Policy(
                PRESENCE_POLICY,
                f"^{re.escape(c.PRESENCE_EXCHANGE)}$",
                "exchanges",
                {"federation-upstream-set": PRESENCE_UPSTREAM_SET},
            )
        )
    return d
