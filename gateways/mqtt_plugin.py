"""What fedgate reads of RabbitMQ's MQTT plugin, in one place.

The router learns where devices are and what they subscribe to from things
the MQTT plugin makes on a gateway: its connection events (federated to the
backend), its connection list (management API) and the queue each MQTT
session subscribes through.  None of that is a public API -- the shapes
differ between RabbitMQ versions -- so every reading of them lives here, and
a broker upgrade changes this file only.

Shapes read (RabbitMQ 3.10 from Debian 12, and 4.0 from Debian 13):

- ``connection.created`` carries the client id as Erlang-formatted text:
  3.10 in ``variable_map``, ``#{<<"client_id">> => <<"dev-1">>}``; 4.0 in
  ``client_properties``, a list of ``{client_id,longstr,<<"dev-1">>}``
  tuples (protocol ``{'MQTT',{3,1,1}}``);
- ``/api/connections`` lists ``client_properties.client_id`` (or
  ``variable_map.client_id``) for MQTT connections -- while the management
  plugin collects statistics.  fedgate's 4.0 gateways do not (the collection
  is deprecated in 4.0 and cost ~10 KB per device): the list is then
  RabbitMQ's connection tracking, ``name``, ``user``, ``node`` and ``vhost``
  only -- no protocol, client id or connection time -- but up to date at
  once instead of with the next statistics round (~5 s);
- a subscription is a binding of ``amq.topic`` to the session's queue
  ``mqtt-subscription-<client id>qos<0|1>``, with the MQTT filter as an AMQP
  topic key (``/`` <-> ``.``, ``+`` -> ``*``);
- a clean session's queue goes with its connection: 3.10 declares it
  ``auto_delete``, 4.0 ``exclusive`` (durable, not auto-delete; QoS 0 of type
  ``rabbit_mqtt_qos0_queue``).  A persistent session's queue is neither; 4.0
  gives it ``x-expires`` of the session expiry (one day by default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend import contract as c

SUBSCRIPTION_QUEUE_PREFIX = "mqtt-subscription-"

_CLIENT_ID_IN_MAP = re.compile(r'<<"client_id">>\s*=>\s*<<"((?:[^"\\]|\\.)*)">>')
#: 4.0: one Erlang tuple per client property, `{client_id,longstr,<<"dev-7">>}`
_CLIENT_ID_PROPERTY = re.compile(r'^\{client_id,longstr,<<"((?:[^"\\]|\\.)*)"(?:/utf8)?>>\}$')


def text(v: Any) -> str:
    """A header value as text (AMQP tables carry bytes or str)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def subscription_queue(client_id: str, qos: int) -> str:
    """The queue an MQTT session's subscriptions of one QoS are bound to."""
    return f"{SUBSCRIPTION_QUEUE_PREFIX}{client_id}qos{qos}"


def client_id_of_queue(queue: str) -> str | None:
    """mqtt-subscription-<client id>qos<0|1> -> client id; None for any other queue."""
    if not queue.startswith(SUBSCRIPTION_QUEUE_PREFIX) or queue[-4:-1] != "qos":
        return None
    return queue[len(SUBSCRIPTION_QUEUE_PREFIX) : -4] or None


def is_clean_session_queue(queue_info: Mapping[str, Any]) -> bool:
    """Whether a session queue (management API) is a clean session's, gone with its connection."""
    return bool(queue_info.get("auto_delete") or queue_info.get("exclusive"))


def filter_of_binding_key(key: str) -> str:
    """The MQTT topic filter a subscription binding's AMQP key stands for."""
    return "".join("/" if ch == "." else "." if ch == "/" else "+" if ch == "*" else ch for ch in key)


def is_mqtt(protocol: Any) -> bool:
    return "MQTT" in text(protocol or "")


def client_id_from_event(headers: Mapping[str, Any]) -> str | None:
    """The MQTT client id of a connection.created event, None for non-MQTT connections."""
    if not is_mqtt(headers.get("protocol")):
        return None
    for prop in headers.get("client_properties") or ():
        m = _CLIENT_ID_PROPERTY.match(text(prop))
        if m:
            return _unescape(m.group(1))
    vm = headers.get("variable_map")
    if isinstance(vm, Mapping):
        cid = vm.get("client_id")
        return text(cid) if cid is not None else None
    if vm is None:
        return None
    m = _CLIENT_ID_IN_MAP.search(text(vm))
    return _unescape(m.group(1)) if m else None


def _unescape(erlang_string: str) -> str:
    return erlang_string.encode().decode("unicode_escape")


@dataclass(frozen=True)
class ListedConnection:
    """One MQTT connection as a gateway's management API lists it."""

    client_id: str
    node: str
    #: connection name, unique per node; what closes it
    name: str
    #: milliseconds since the epoch (0 when the gateway did not say)
    connected_at: int
    user: str


def is_tracked_listing(conn: Mapping[str, Any]) -> bool:
    """Whether a /api/connections entry is connection tracking's (statistics not collected)."""
    return "protocol" not in conn and "client_properties" not in conn


def mqtt_connections(connections: list[dict[str, Any]]) -> list[ListedConnection]:
    """The device connections of a gateway's /api/connections, with their client ids.

    A tracked listing names no protocol or client id: a connection there is a
    device's if its user is not one of fedgate's own (every other user of a
    gateway is a device, which logs in as itself), and its client id is taken
    to be that user; connected_at is 0 (not said).
    """
    out = []
    for conn in connections:
        if is_tracked_listing(conn):
            user = str(conn.get("user") or "")
            if user and user != "none" and user not in c.SERVICE_USERS and conn.get("name"):
                out.append(ListedConnection(user, str(conn.get("node") or ""), str(conn["name"]), 0, user))
            continue
        if not is_mqtt(conn.get("protocol")):
            continue
        props = conn.get("client_properties") or {}
        cid = props.get("client_id") or (conn.get("variable_map") or {}).get("client_id")
        if not cid:
            continue
        out.append(
            ListedConnection(
                str(cid),
                conn["node"],
                conn["name"],
                int(conn.get("connected_at") or 0),
                str(conn.get("user") or ""),
            )
        )
    return out


@dataclass(frozen=True)
class SubscriptionMade:
    """A ``binding.created`` event that is an MQTT session subscribing."""

    client_id: str
    region: str
    topic_filter: str
    #: the QoS the device subscribed with (its queue's name says it)
    qos: int = 1


def qos_of_queue(queue: str) -> int | None:
    """mqtt-subscription-<client id>qos<0|1> -> 0 or 1; None for any other queue."""
    if client_id_of_queue(queue) is None or queue[-1] not in "01":
        return None
    return int(queue[-1])


def subscription_from_event(headers: Mapping[str, Any]) -> SubscriptionMade | None:
    """A binding.created event of a gateway -> the subscription it stands for (None if none)."""
    if text(headers.get("source_name", "")) != c.MQTT_EXCHANGE:
        return None
    queue = text(headers.get("destination_name", ""))
    cid, qos = client_id_of_queue(queue), qos_of_queue(queue)
    region = c.region_from_headers(headers)
    if cid is None or qos is None or region is None:
        return None
    return SubscriptionMade(cid, region, filter_of_binding_key(text(headers.get("routing_key", ""))), qos)


def subscriptions_of_bindings(bindings: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The bindings of a gateway's amq.topic (management API) -> what each MQTT session
    subscribes to: client id -> {filter: QoS}."""
    out: dict[str, dict[str, int]] = {}
    for b in bindings:
        queue = str(b.get("destination", ""))
        cid, qos = client_id_of_queue(queue), qos_of_queue(queue)
        if cid is not None and qos is not None and b.get("destination_type") == "queue":
            out.setdefault(cid, {})[filter_of_binding_key(b["routing_key"])] = qos
    return out


def filters_of_bindings(bindings: list[dict[str, Any]]) -> list[str]:
    """The MQTT filters of a session queue's bindings (management API), the default binding left out."""
    return [filter_of_binding_key(b["routing_key"]) for b in bindings if b.get("source")]


# --- MQTT 5 properties in AMQP 0.9.1 (RabbitMQ 4.0) ------------------------------
#
# A device's PUBLISH crosses the federation as AMQP 0.9.1, converted by the
# plugin (mc_mqtt): each user property becomes a header of its own name (the
# first of a repeated name wins), the content type the `content_type`
# property, the response topic the header `x-reply-to-topic` in AMQP form, the
# correlation data `correlation_id` when it fits a short string and else the
# header `x-correlation-id`.  Towards a device the same mapping runs backwards,
# with one gap: the message expiry interval is given only to messages that
# came from MQTT, so an AMQP `expiration` is enforced by the gateway's queue
# but not shown to the device (router/commands.py adds it as a user property).

#: Headers RabbitMQ sets itself (MQTT 5 conversion, federation, dead
#: lettering); every other header of a device's message is a user property.
BROKER_HEADERS = frozenset(
    {
        c.RECEIVED_FROM_HEADER,
        "x-reply-to-topic",
        "x-correlation-id",
        "x-death",
        "x-delivery-count",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
REPLY_TO_TOPIC_HEADER = "x-reply-to-topic"
CORRELATION_ID_HEADER = "x-correlation-id"
#: AMQP 0.9.1 short strings (correlation_id, content_type) hold at most this many bytes
SHORTSTR_MAX = 255


@dataclass(frozen=True)
class Mqtt5Properties:
    """The MQTT 5 properties of a message that fedgate carries along."""

    user_properties: tuple[tuple[str, str], ...] = ()
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None


#: A message without MQTT 5 properties (an MQTT 3.1.1 device's, most commands)
NO_PROPERTIES = Mqtt5Properties()


def _raw(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogateescape")


def properties_of(
    headers: Mapping[str, Any] | None, content_type: str | None, correlation_id: Any
) -> Mqtt5Properties:
    """The MQTT 5 properties of a device message as it reached AMQP 0.9.1.

    An MQTT 3.1.1 message has none (its only header is the federation's)."""
    headers = headers or {}
    user = tuple(
        (k, text(v)) for k, v in headers.items() if k not in BROKER_HEADERS and isinstance(v, str | bytes)
    )
    topic = headers.get(REPLY_TO_TOPIC_HEADER)
    corr: bytes | None = None
    if correlation_id is not None:
        corr = _raw(correlation_id)
    elif headers.get(CORRELATION_ID_HEADER) is not None:
        corr = _raw(headers[CORRELATION_ID_HEADER])
    return Mqtt5Properties(
        user_properties=user,
        content_type=content_type or None,
        response_topic=c.routing_key_to_mqtt_topic(text(topic)) if topic is not None else None,
        correlation_data=corr,
    )


def amqp_fields(p: Mqtt5Properties) -> tuple[dict[str, Any], dict[str, Any]]:
    """(headers, message properties) to publish so that an MQTT 5 subscriber gets `p`.

    MQTT 3.1.1 subscribers get the payload alone."""
    headers: dict[str, Any] = dict(p.user_properties)
    props: dict[str, Any] = {}
    if p.content_type:
        props["content_type"] = p.content_type
    if p.response_topic:
        headers[REPLY_TO_TOPIC_HEADER] = c.mqtt_topic_to_routing_key(p.response_topic)
    if p.correlation_data is not None:
        try:
            as_text = p.correlation_data.decode("utf-8")
        except UnicodeDecodeError:
            as_text = None
        if as_text is not None and len(p.correlation_data) <= SHORTSTR_MAX:
            props["correlation_id"] = as_text
        else:
            headers[CORRELATION_ID_HEADER] = p.correlation_data
    return headers, props
