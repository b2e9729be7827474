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
  ``variable_map.client_id``) for MQTT connections;
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


def mqtt_connections(connections: list[dict[str, Any]]) -> list[ListedConnection]:
    """The MQTT connections of a gateway's /api/connections, with their client ids."""
    out = []
    for conn in connections:
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


def subscription_from_event(headers: Mapping[str, Any]) -> SubscriptionMade | None:
    """A binding.created event of a gateway -> the subscription it stands for (None if none)."""
    if text(headers.get("source_name", "")) != c.MQTT_EXCHANGE:
        return None
    cid = client_id_of_queue(text(headers.get("destination_name", "")))
    region = c.region_from_headers(headers)
    if cid is None or region is None:
        return None
    return SubscriptionMade(cid, region, filter_of_binding_key(text(headers.get("routing_key", ""))))


def filters_of_bindings(bindings: list[dict[str, Any]]) -> list[str]:
    """The MQTT filters of a session queue's bindings (management API), the default binding left out."""
    return [filter_of_binding_key(b["routing_key"]) for b in bindings if b.get("source")]
