"""The names every part of fedgate shares: one source of truth.

Gateways, the backend wiring, the router, the demo and the tests import these
instead of spelling exchange names or headers themselves.  Changing a name here
changes it everywhere; a name that has to change on a running federation
needs a migration, so treat these as a wire contract.

Message paths (see docs/architecture.md):

  uplink    device --MQTT--> gateway amq.topic ==federation==> backend
            TELEMETRY_EXCHANGE --#--> UPLINK_EXCHANGE (consistent hash)
            --> uplink_shard_queue(0..n-1) --> router(s) --> Kafka
  presence  gateway amq.rabbitmq.event ==federation==> backend PRESENCE_EXCHANGE
  downlink  backend downlink_exchange(region) ==federation==> gateway
            GATEWAY_DOWNLINK_EXCHANGE --#--> amq.topic --> MQTT subscriber
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from backend.errors import FedgateError

# --- backend -------------------------------------------------------------

#: Cluster name of the backend; federation uses cluster names to detect cycles.
BACKEND_CLUSTER_NAME = "fedgate-backend"

#: Topic exchange on the backend receiving every device publish from every
#: gateway (federated from each gateway's MQTT exchange).  Routing keys are the
#: MQTT topics in AMQP form (see mqtt_topic_to_routing_key).
TELEMETRY_EXCHANGE = "fedgate.telemetry"

#: Consistent-hash exchange bound to TELEMETRY_EXCHANGE with "#": spreads
#: device messages over the shard queues by routing key (the MQTT topic), so
#: every topic's messages stay in one shard, in order.  Bound on the backend
#: so that the federation keeps a binding on every gateway even while no
#: router runs: device messages wait in the shard queues.
UPLINK_EXCHANGE = "fedgate.uplink"
#: With uplink batching (backend/uplink_batch.py): the gateway's queue of device messages its
#: batcher reads (gateways/uplink_batcher_plugin), and the exchange it publishes the batches
#: to, which the backend's uplink link federates in place of the MQTT exchange.
UPLINK_BATCH_IN_QUEUE = "fedgate.uplink.batch-in"
UPLINK_BATCHES_EXCHANGE = "fedgate.uplink.batches"
#: A batch's routing key: this prefix, its region, its bucket (a device's readings keep one
#: bucket).  No device can publish under it (devices write under devices/<id>/ only).
UPLINK_BATCH_KEY_PREFIX = "fedgate-batch"

#: Default number of uplink shards.  Fixed when the backend is created:
#: changing it re-hashes topics onto other shards.
UPLINK_SHARDS = 4


def uplink_shard_queue(shard: int) -> str:
    """Durable quorum queue of one uplink shard (single active consumer)."""
    return f"{UPLINK_EXCHANGE}.{shard}"


#: Topic exchange on the backend receiving the gateways' connection events.
PRESENCE_EXCHANGE = "fedgate.presence"


def router_presence_queue(router_id: str) -> str:
    """Each router's own durable quorum queue of presence events: it outlives the router's
    restarts (events wait for it) and the death of any one backend node.  (A classic queue,
    the earlier `fedgate.router.presence.<id>`, lived on one node: while that node was down
    the routers' backend connections could not come back, 20-90 s in the HA tests, and the
    events routed to it meanwhile were dropped.)"""
    return f"fedgate.router.{router_id}.presence"


#: An abandoned router's presence queue expires in 1 h; a router away long keeps the newest.
ROUTER_PRESENCE_QUEUE_ARGS = {
    "x-queue-type": "quorum",
    "x-expires": 3_600_000,
    "x-max-length": 1_000_000,
    "x-overflow": "drop-head",
}


#: Routing keys of the gateway events presence needs.  Consumers bind with
#: these (not "#") so that the gateways only forward connection events.
PRESENCE_EVENT_KEYS = ("connection.created", "connection.closed")

DOWNLINK_EXCHANGE_PREFIX = "fedgate.downlink."


def downlink_exchange(region: str) -> str:
    """Backend exchange that only `region`'s gateway pulls."""
    return DOWNLINK_EXCHANGE_PREFIX + validate_region(region)


# --- gateways --------------------------------------------------------------

#: The exchange the MQTT plugin publishes device messages to and binds device
#: subscriptions on.
MQTT_EXCHANGE = "amq.topic"

#: rabbitmq_event_exchange's exchange on every gateway.
EVENT_EXCHANGE = "amq.rabbitmq.event"

#: Exchange on each gateway federated from its region's backend downlink
#: exchange; bound to MQTT_EXCHANGE with "#", the one and only downlink binding.
GATEWAY_DOWNLINK_EXCHANGE = "fedgate.downlink"

# --- users -------------------------------------------------------------------

#: Administrator on every node (management UI, the fedgate CLI).  Replaces
#: RabbitMQ's `guest`, which fedgate never creates.
ADMIN_USER = "fedgate-admin"

#: User the backend's federation links log into gateways with.
BACKEND_LINK_USER = "fedgate-backend"

#: MQTT user of devices on the local default (per-device identity comes with
#: device authentication).
DEVICE_USER = "device"


#: User the router logs into the backend with; on the gateways of a cloud region, the
#: routers' user for their management APIs: tagged `monitoring`, no AMQP permission
#: (gateways/wiring.py).
ROUTER_USER = "fedgate-router"

#: fedgate's own users on the gateways: never a device id.  A gateway's
#: connection listing names only the user of a connection (see
#: gateways/mqtt_plugin.py), so these are what tells a device's apart.
SERVICE_USERS = frozenset({ADMIN_USER, BACKEND_LINK_USER, ROUTER_USER, DEVICE_USER, "guest"})


def gateway_link_user(region: str) -> str:
    """User a region's gateway logs into the backend with (its downlink link)."""
    return "gw-" + validate_region(region)


def gateway_upstream_name(region: str) -> str:
    """Name of the backend's federation upstream pointing at a region's gateway."""
    return "gw-" + validate_region(region)


# --- headers -----------------------------------------------------------------

#: Header RabbitMQ federation adds to every message it moves: a list, newest
#: hop first, of tables with `cluster-name`, `exchange`, `uri`, `redelivered`.
RECEIVED_FROM_HEADER = "x-received-from"
#: Header of an uplink batch (gateways/uplink_batcher_plugin): when its first reading reached
#: the gateway's batcher, in ms since the epoch.  The routers' gateway-to-Kafka latency
#: (fedgate_router_reading_latency_seconds) runs from it.
FIRST_READING_AT_HEADER = "x-fedgate-first-reading-at"

# --- regions -----------------------------------------------------------------

REGION_RE = re.compile(r"^[a-z][a-z0-9-]{1,30}[a-z0-9]$")


class InvalidRegionError(FedgateError, ValueError):
    """A region name that cannot name exchanges, users and nodes."""


def validate_region(region: str) -> str:
    """Return `region` if it is a valid region name, raise otherwise.

    Region names become parts of exchange names, user names, node names and
    DNS labels, so they are restricted to lowercase letters, digits and
    hyphens (e.g. ``local-eu``, ``eu-west-1``).
    """
    if not isinstance(region, str) or not REGION_RE.match(region):
        raise InvalidRegionError(
            f"invalid region name {region!r}: use 3-32 lowercase letters, digits and "
            "hyphens, starting with a letter (e.g. local-eu, eu-west-1)"
        )
    return region


def gateway_cluster_name(region: str) -> str:
    """Cluster name of a region's gateway cluster.

    Federation stamps it into every message it moves (x-received-from), which
    is how the backend knows the region a device message came from: a
    gateway cluster is named after its region.
    """
    return validate_region(region)


def region_from_headers(headers: Mapping[str, Any] | None) -> str | None:
    """The region an uplink message came from, or None if it did not cross a gateway link.

    Reads the oldest hop of `x-received-from`: the gateway the device
    published on.
    """
    if not headers:
        return None
    hops = headers.get(RECEIVED_FROM_HEADER)
    if not hops:
        return None
    first = hops[-1]
    name = first.get("cluster-name") if isinstance(first, Mapping) else None
    if isinstance(name, bytes):
        name = name.decode()
    return name if isinstance(name, str) and REGION_RE.match(name) else None


# --- MQTT topics <-> AMQP routing keys ------------------------------------------


#: str.translate tables: the router maps every uplink message's routing key, and a
#: character-by-character join cost it 6 µs a message (the router bench's profile).
_TO_ROUTING_KEY = str.maketrans({"/": ".", ".": "/", "+": "*"})
_TO_MQTT_TOPIC = str.maketrans({".": "/", "/": "."})


def mqtt_topic_to_routing_key(topic: str) -> str:
    """AMQP routing key RabbitMQ's MQTT plugin uses for an MQTT topic.

    The plugin swaps the separators: "/" becomes "." and "." becomes "/".
    Filters map the same way ("+" -> "*", "#" stays "#").
    """
    return topic.translate(_TO_ROUTING_KEY)


def routing_key_to_mqtt_topic(routing_key: str) -> str:
    """Inverse of mqtt_topic_to_routing_key (for topics, not filters)."""
    return routing_key.translate(_TO_MQTT_TOPIC)


def device_command_topic(device: str, name: str) -> str:
    """MQTT topic a device listens on for a command (convention)."""
    return f"devices/{device}/commands/{name}"


def device_telemetry_topic(device: str, stream: str = "telemetry") -> str:
    """MQTT topic a device publishes a stream on (convention)."""
    return f"devices/{device}/{stream}"


# --- router ------------------------------------------------------------------

#: Exchange on the backend that backend services publish device-bound
#: messages to (the router's downlink input).  Routing key: the device id.
COMMANDS_EXCHANGE = "fedgate.commands"

#: Quorum queue the router consumes COMMANDS_EXCHANGE from.  Single active
#: consumer: several routers may stand by, one routes at a time, so commands
#: to a device keep their order.
COMMANDS_QUEUE = "fedgate.router.commands"
#: Quorum queue with single active consumer that elects the router routing commands: the
#: active consumer holds a token message unacked for as long as it leads; when it dies,
#: RabbitMQ hands the token to the next (router/leadership.py).
LEADER_QUEUE = "fedgate.router.leader"
#: Where a router puts a token in LEADER_QUEUE (fanout; the router user may write to no other
#: exchange but the downlinks).
LEADER_EXCHANGE = "fedgate.router.leader"
#: The largest command payload fedgate carries: `fedgate send` refuses a larger one, and the
#: router dead-letters one that arrives on COMMANDS_EXCHANGE (with its first bytes only): a
#: command is parked in Kafka, whose records are 1 MB at most, and devices are small.
MAX_COMMAND_BYTES = 256 * 1024

#: Headers of a message on COMMANDS_EXCHANGE.
DEVICE_HEADER = "x-fedgate-device"
TOPIC_HEADER = "x-fedgate-topic"
RETAIN_HEADER = "x-fedgate-retain"
#: Set on the copies of a broadcast (a command for a device never seen).
BROADCAST_HEADER = "x-fedgate-broadcast"
#: When the command stops being worth delivering: epoch milliseconds.  The
#: router dead-letters it from then on (reason: expired), and the gateway
#: drops it from the device's session queue (the AMQP `expiration` the router
#: sets).  MQTT 5 devices see it as the user property of the same name.
EXPIRES_AT_HEADER = "x-fedgate-expires-at"
#: The MQTT topic an MQTT 5 device answers on (its Response Topic).  It must
#: be under the device's own devices/<id>/, the only place it may publish.
#: The correlation data is the AMQP `correlation_id`; the content type,
#: `content_type`.
RESPONSE_TOPIC_HEADER = "x-fedgate-response-topic"


#: The id of a command as its device acknowledges it: message_id() of its
#: MQTT topic and payload (an MQTT 3.1.1 device computes it; an MQTT 5 device
#: also finds it in the user property of this name).
COMMAND_ID_HEADER = "x-fedgate-command-id"

#: Quorum queue on the backend with the devices' command acknowledgements
#: (device_ack_topic), read by the router that routes commands.
ACKS_QUEUE = "fedgate.router.acks"

#: Where a message of the router's queues (commands, acknowledgements, uplink shards) goes
#: after POISON_DELIVERY_LIMIT deliveries that ended without an ack (a router that failed on
#: it, or crashed, each time): RabbitMQ 4.0 drops such a message from a quorum queue unless
#: it is dead-lettered.  A fanout exchange and a durable quorum queue of the same name on the
#: backend, read by operators (docs/operations.md); x-first-death-queue names the source.
POISON_EXCHANGE = "fedgate.poison"
POISON_QUEUE = "fedgate.poison"
POISON_DELIVERY_LIMIT = 20


def device_ack_topic(device: str) -> str:
    """Where a device acknowledges the commands it received at QoS 0: a JSON object
    {"acks": [<command id>, ...]} (parse_acks).  See docs/router.md, "Acknowledged commands"."""
    return f"devices/{device}/acks"


def parse_acks(payload: bytes) -> list[str]:
    """The command ids of an acknowledgement; raises ValueError saying what is wrong."""
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"acknowledgement is not JSON: {e}") from e
    ids = doc.get("acks") if isinstance(doc, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise ValueError('acknowledgement is not {"acks": [<command id>, ...]}')
    return ids


def device_reply_topic(device: str) -> str:
    """The response topic `fedgate send --wait` gives: the device answers there,
    with the command's id as correlation data."""
    return f"devices/{device}/replies"


#: A command that waits this long in a region's downlink queue on the backend
#: (the gateway's federation link is not taking it: the gateway is down or
#: cut off) comes back to COMMANDS_QUEUE, dead-lettered by RabbitMQ, and the
#: router routes it again: to the region the device has moved to, or parked
#: until it reconnects.  Without it, a command sent while a gateway is dead
#: would wait there for the gateway and then be dropped, its device gone.
DOWNLINK_RETURN_AFTER_MS = 10_000
#: The backend's queues that a gateway's downlink link reads (declared by the link).
DOWNLINK_LINK_QUEUE_PREFIX = "federation: " + DOWNLINK_EXCHANGE_PREFIX


def region_of_returned(headers: dict[str, Any]) -> str | None:
    """The region whose downlink queue a command expired from (RabbitMQ's x-death), or None."""
    for death in headers.get("x-death") or []:
        queue = death.get("queue", b"")
        queue = queue.decode() if isinstance(queue, bytes) else str(queue)
        if queue.startswith(DOWNLINK_LINK_QUEUE_PREFIX):
            return queue[len(DOWNLINK_LINK_QUEUE_PREFIX) :].split(" ", 1)[0] or None
    return None


#: Headers the bridge puts on every Kafka record.
KAFKA_REGION_HEADER = "fedgate.region"
KAFKA_MQTT_TOPIC_HEADER = "fedgate.mqtt_topic"
KAFKA_DEVICE_HEADER = "fedgate.device"
KAFKA_RECEIVED_AT_HEADER = "fedgate.received_at_ms"
KAFKA_DEADLETTER_REASON_HEADER = "fedgate.deadletter_reason"
#: A device message's MQTT 5 properties (none for MQTT 3.1.1): each user
#: property as a header named KAFKA_USER_PROPERTY_PREFIX + its name (the
#: prefix keeps a device from passing a property off as one of fedgate's
#: headers), and the content type, response topic and correlation data.
KAFKA_USER_PROPERTY_PREFIX = "mqtt.user."
KAFKA_CONTENT_TYPE_HEADER = "mqtt.content_type"
KAFKA_RESPONSE_TOPIC_HEADER = "mqtt.response_topic"
KAFKA_CORRELATION_DATA_HEADER = "mqtt.correlation_data"
#: Identity of a device message that survives redelivery: the bridge may
#: produce a message twice (a router dies between Kafka's confirmation and
#: the AMQP ack; RabbitMQ redelivers it), and Spark drops the second copy by
#: this header.  See message_id().
KAFKA_MESSAGE_ID_HEADER = "fedgate.message_id"

#: Kafka topics the bridge always has.
KAFKA_UNMATCHED_TOPIC = "fedgate.unmatched"
KAFKA_DEADLETTER_TOPIC = "fedgate.deadletter"
#: Each step the router takes with a command, keyed by its id (router/outcomes.py).
KAFKA_COMMAND_OUTCOMES_TOPIC = "fedgate.command.outcomes"
#: Where the default topic mapping (router/topics.py DEFAULT_RULES, "telemetry.{stream}")
#: puts devices/<id>/telemetry: what the demo, the army and the tests read back.
KAFKA_TELEMETRY_TOPIC = "telemetry.telemetry"


def message_id(mqtt_topic: str, payload: bytes) -> str:
    """The identity of a device message: a hash of its MQTT topic and payload.

    MQTT 3.1.1 gives a message no identity that outlives the connection (the
    packet id is reused), and RabbitMQ 3.10 stamps none, so the identity is
    derived from what every copy shares: a redelivered copy, a QoS 1
    retransmission by the device, even the same publish re-sent to another
    region after failover carry the same topic and bytes.  Devices make their
    messages distinct with a sequence number or timestamp in the payload (the
    simulator does); two byte-identical publishes on one topic within the
    dedupe window count once.  spark/transforms.py computes the same value
    for records that lack the header, so both sides must stay in step:
    the first 32 hex digits of SHA-256 over topic, NUL, payload.
    """
    return hashlib.sha256(mqtt_topic.encode() + b"\0" + payload).hexdigest()[:32]
