"""A command's two wire forms: as a sender puts it on the commands exchange,
and as the router publishes it to a region's downlink.

In (``fedgate.commands``, see backend/contract.py): headers
``x-fedgate-device`` and ``x-fedgate-topic`` (required),
``x-fedgate-retain``, ``x-fedgate-expires-at`` (epoch ms) and
``x-fedgate-response-topic``; the AMQP ``correlation_id`` and
``content_type`` for an MQTT 5 device.  A command the router sent that came
back from a region (dead-lettered by the backend, contract.region_of_returned)
arrives in the router's own out form, which keeps all of them.

Out: the same fedgate headers (so a returned command can be routed again
with everything it had), plus what RabbitMQ 4.0's MQTT plugin turns into MQTT
5 properties (gateways/mqtt_plugin.py): response topic, correlation data,
content type.  The command's expiry becomes the AMQP ``expiration`` of the
remaining time, so the gateway drops it from the device's session queue once
it is stale; an MQTT 5 device reads the deadline from the user property
``x-fedgate-expires-at``, since the plugin gives a message expiry interval
only to messages that came from MQTT.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import aio_pika

from backend import contract as c
from gateways.mqtt_plugin import Mqtt5Properties, amqp_fields, text
from router.routing import Command

#: A command expiring sooner than this once it reaches the gateway still gets
#: this long there: RabbitMQ takes `expiration` in whole milliseconds, and 0
#: would mean "deliver now or drop".
MIN_EXPIRATION_MS = 1


class BadCommand(ValueError):
    """A command whose headers cannot be read; the message says which."""

    def __init__(self, reason: str, device: str, topic: str):
        super().__init__(reason)
        self.device, self.topic = device, topic


def check_size(cmd: Command, payload: bytes) -> None:
    """Raise BadCommand for a payload over contract.MAX_COMMAND_BYTES (it could not be parked)."""
    if len(payload) > c.MAX_COMMAND_BYTES:
        why = f"command of {len(payload)} bytes is over the limit of {c.MAX_COMMAND_BYTES}"
        raise BadCommand(why, cmd.device, cmd.topic)


def parse_command(
    headers: Mapping[str, Any] | None, content_type: str | None, correlation_id: Any
) -> Command:
    """The Command in an AMQP message on the commands queue (raises BadCommand)."""
    h = dict(headers or {})
    device, topic = text(h.get(c.DEVICE_HEADER, "")), text(h.get(c.TOPIC_HEADER, ""))
    expires_at = None
    raw = h.get(c.EXPIRES_AT_HEADER)
    if raw is not None:
        try:
            expires_at = int(text(raw)) / 1000
        except ValueError as e:
            why = f"{c.EXPIRES_AT_HEADER} is {text(raw)!r}, not epoch milliseconds"
            raise BadCommand(why, device, topic) from e
    response_topic = h.get(c.RESPONSE_TOPIC_HEADER)
    corr = correlation_id
    if isinstance(corr, str):
        corr = corr.encode()
    return Command(
        device,
        topic,
        retain=bool(h.get(c.RETAIN_HEADER, False)),
        returned_from=c.region_of_returned(h),
        broadcast_copy=bool(h.get(c.BROADCAST_HEADER, False)),
        expires_at=expires_at,
        properties=Mqtt5Properties(
            content_type=content_type or None,
            response_topic=text(response_topic) if response_topic is not None else None,
            correlation_data=corr if isinstance(corr, bytes) else None,
        ),
    )


def downlink_message(cmd: Command, payload: bytes, *, broadcast: bool = False) -> aio_pika.Message:
    """The message the router publishes to a region's downlink exchange."""
    headers, props = amqp_fields(cmd.properties)
    # Device and topic travel along (MQTT does not pass them on) so that a
    # command the region does not take can come back and be routed again.
    headers[c.DEVICE_HEADER] = cmd.device
    headers[c.TOPIC_HEADER] = cmd.topic
    headers[c.COMMAND_ID_HEADER] = c.message_id(cmd.topic, payload)
    if cmd.retain:
        headers[c.RETAIN_HEADER] = True
    if broadcast:
        headers[c.BROADCAST_HEADER] = True
    if cmd.properties.response_topic:
        headers[c.RESPONSE_TOPIC_HEADER] = cmd.properties.response_topic
    expiration = None
    if cmd.expires_at is not None:
        headers[c.EXPIRES_AT_HEADER] = str(int(cmd.expires_at * 1000))
        left_ms = max(MIN_EXPIRATION_MS, int((cmd.expires_at - time.time()) * 1000))
        expiration = datetime.timedelta(milliseconds=left_ms)
    return aio_pika.Message(
        payload,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers=headers,
        expiration=expiration,
        **props,
    )
