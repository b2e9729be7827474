"""Small blocking AMQP helpers (pika) for backend tools, the demo and the tests.

The router uses aio-pika; these are for scripts that want to look at or
inject traffic on the backend: tap an exchange, read the uplink queue,
publish to a region's downlink -- always with publisher confirms.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions

from backend import contract as c
from backend import uplink_batch
from backend.errors import FedgateError


@dataclass(frozen=True)
class UplinkMessage:
    """A device message as the backend sees it."""

    region: str | None
    topic: str
    payload: bytes
    headers: dict[str, Any]
    delivery_tag: int = 0
    #: when this process read it (wall clock), for latency figures
    received_at: float = 0.0
    #: an MQTT 5 device's correlation data, when it is text (binary: headers["x-correlation-id"])
    correlation_id: str | None = None
    content_type: str | None = None

    @property
    def device(self) -> str | None:
        parts = self.topic.split("/")
        return parts[1] if len(parts) >= 2 and parts[0] == "devices" else None


def to_uplink(method: Any, props: Any, body: bytes, routing_key: str | None = None) -> UplinkMessage:
    """A device message as read from the backend; `props` is pika's or a batch reading's
    (pamqp's: the same fields)."""
    headers = dict(props.headers or {})
    return UplinkMessage(
        region=c.region_from_headers(headers),
        topic=c.routing_key_to_mqtt_topic(routing_key or method.routing_key),
        payload=body,
        headers=headers,
        delivery_tag=method.delivery_tag,
        received_at=time.time(),
        correlation_id=props.correlation_id,
        content_type=props.content_type,
    )


def unbatched(method: Any, props: pika.BasicProperties, body: bytes) -> list[UplinkMessage]:
    """The device messages of one backend message: itself, or each reading of an uplink batch
    (backend/uplink_batch.py) with the batch's hop (the region)."""
    if props.content_type != uplink_batch.BATCH_CONTENT_TYPE:
        return [to_uplink(method, props, body)]
    return [
        to_uplink(method, r.properties, r.body, r.routing_key)
        for r in uplink_batch.readings(body, props.headers)
    ]


def topic_key_matches(pattern: str, key: str) -> bool:
    """Whether an AMQP topic binding key matches a routing key (`*` one word, `#` any)."""
    return _words_match(pattern.split("."), key.split("."))


def _words_match(p: list[str], k: list[str]) -> bool:
    if not p:
        return not k
    if p[0] == "#":
        return _words_match(p[1:], k) or (bool(k) and _words_match(p, k[1:]))
    return bool(k) and p[0] in ("*", k[0]) and _words_match(p[1:], k[1:])


#: One backend node's AMQP URL, or every node's of a backend cluster (tried in order).
Urls = str | Sequence[str]


def connect(url: Urls, timeout: float = 10.0) -> pika.BlockingConnection:
    """A connection to the backend: to the first node of `url` that answers (pika tries a
    list of nodes in turn)."""
    params = []
    for u in [url] if isinstance(url, str) else url:
        p = pika.URLParameters(u)
        p.socket_timeout = timeout
        p.blocked_connection_timeout = 60
        p.heartbeat = 30
        params.append(p)
    return pika.BlockingConnection(params[0] if len(params) == 1 else params)


def publish_confirmed(
    url: Urls,
    exchange: str,
    routing_key: str,
    payload: bytes | str,
    headers: dict[str, Any],
    **properties: Any,
) -> None:
    """Publish one persistent, mandatory message and wait for the broker's confirm.

    `properties` are further AMQP properties (correlation_id, content_type)."""
    conn = connect(url)
    try:
        _publish(conn.channel(), exchange, routing_key, payload, headers, **properties)
    finally:
        conn.close()


def _publish(
    ch: Any, exchange: str, routing_key: str, payload: bytes | str, headers: dict[str, Any], **properties: Any
) -> None:
    ch.confirm_delivery()
    properties.setdefault("message_id", str(uuid.uuid4()))
    ch.basic_publish(
        exchange=exchange,
        routing_key=routing_key,
        body=payload.encode() if isinstance(payload, str) else payload,
        properties=pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent, headers=headers, **properties
        ),
        mandatory=True,
    )


def publish_downlink(
    url: str,
    region: str,
    topic: str,
    payload: bytes | str,
    *,
    headers: dict[str, Any] | None = None,
) -> None:
    """Publish a message to `region`'s downlink exchange and wait for the broker's confirm.

    `topic` is the MQTT topic the device subscribed to.  Raises if the broker
    cannot route it (mandatory): the region's gateway has never linked.
    """
    publish_confirmed(
        url, c.downlink_exchange(region), c.mqtt_topic_to_routing_key(topic), payload, headers or {}
    )


class Tap:
    """A temporary queue on the backend bound to an exchange: see what flows through it.

    Use as a context manager; the queue is exclusive and vanishes with the
    connection.  With `durable_name`, a durable queue of that name is used
    instead (and survives a backend restart; delete it with `delete()`).
    On `fedgate.telemetry` it reads the batches of batching regions too
    (backend/uplink_batch.py), and gives the readings in them that `keys`
    match (every one without keys), one message each.
    """

    def __init__(
        self,
        url: str,
        exchange: str,
        keys: Iterable[str] = ("#",),
        *,
        durable_name: str | None = None,
    ):
        self.url = url
        self.exchange = exchange
        self.keys = list(keys)
        self.durable_name = durable_name
        self.conn: pika.BlockingConnection | None = None
        self.queue = durable_name or ""

    def open(self) -> Tap:
        self.conn = connect(self.url)
        ch = self.conn.channel()
        if self.durable_name:
            ch.queue_declare(self.durable_name, durable=True, arguments={"x-queue-type": "quorum"})
            self.queue = self.durable_name
        else:
            self.queue = ch.queue_declare("", exclusive=True).method.queue
        for key in self.keys:
            ch.queue_bind(self.queue, self.exchange, routing_key=key)
        if self.exchange == c.TELEMETRY_EXCHANGE:
            # batching regions' readings come in batches: read them all, keep what `keys` match
            ch.queue_bind(self.queue, self.exchange, routing_key=f"{c.UPLINK_BATCH_KEY_PREFIX}.#")
        self.ch = ch
        return self

    def drain(
        self, expect: int | None = None, timeout: float = 10.0, idle: float = 1.0
    ) -> list[UplinkMessage]:
        """Read and ack messages until `expect` arrived (or `timeout`), or, without
        `expect`, until none arrived for `idle` seconds."""
        assert self.conn is not None
        out: list[UplinkMessage] = []
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < deadline:
            method, props, body = self.ch.basic_get(self.queue, auto_ack=False)
            if method is None:
                if expect is None and time.monotonic() - last > idle:
                    break
                self.conn.process_data_events(time_limit=0.05)
                continue
            out += [
                m
                for m in unbatched(method, props, body)
                if not self.keys
                or any(topic_key_matches(k, c.mqtt_topic_to_routing_key(m.topic)) for k in self.keys)
            ]
            self.ch.basic_ack(method.delivery_tag)
            last = time.monotonic()
            if expect is not None and len(out) >= expect:
                break
        return out

    def delete(self) -> None:
        if self.conn is not None and self.durable_name:
            self.ch.queue_delete(self.durable_name)

    def close(self) -> None:
        if self.conn is not None and self.conn.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                self.conn.close()
        self.conn = None

    def __enter__(self) -> Tap:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def command_headers(
    device: str,
    topic: str,
    *,
    retain: bool = False,
    expires_in_s: float | None = None,
    response_topic: str | None = None,
) -> dict[str, Any]:
    """The headers of a command on COMMANDS_EXCHANGE (backend/contract.py names them)."""
    headers: dict[str, Any] = {c.DEVICE_HEADER: device, c.TOPIC_HEADER: topic}
    if retain:
        headers[c.RETAIN_HEADER] = True
    if expires_in_s is not None:
        if expires_in_s <= 0:
            raise ValueError("expires_in_s: must be positive")
        headers[c.EXPIRES_AT_HEADER] = str(int((time.time() + expires_in_s) * 1000))
    if response_topic is not None:
        headers[c.RESPONSE_TOPIC_HEADER] = response_topic
    return headers


def send_command(
    url: Urls,
    device: str,
    topic: str,
    payload: bytes | str,
    *,
    retain: bool = False,
    expires_in_s: float | None = None,
    response_topic: str | None = None,
    correlation_id: str | None = None,
    content_type: str | None = None,
) -> None:
    """Hand a device-bound message to the router (COMMANDS_EXCHANGE) and wait for the confirm.

    The router sends it to the gateway holding the device, parks it while the
    device is offline, and with `retain` keeps it as the device's desired
    state for `topic`.  Past `expires_in_s` it is no longer delivered (it is
    dead-lettered with the reason).  An MQTT 5 device gets `response_topic`,
    `correlation_id` and `content_type` as the command's properties.
    """
    check_command_size(payload)
    headers = command_headers(
        device, topic, retain=retain, expires_in_s=expires_in_s, response_topic=response_topic
    )
    props = {k: v for k, v in (("correlation_id", correlation_id), ("content_type", content_type)) if v}
    publish_confirmed(url, c.COMMANDS_EXCHANGE, device, payload, headers, **props)


def check_command_size(payload: bytes | str) -> None:
    """Refuse a command larger than fedgate carries (the router would dead-letter it)."""
    size = len(payload.encode() if isinstance(payload, str) else payload)
    if size > c.MAX_COMMAND_BYTES:
        raise FedgateError(
            f"command of {size} bytes is over the limit of {c.MAX_COMMAND_BYTES}: "
            "send a reference to the data (a URL) instead"
        )


@dataclass(frozen=True)
class Reply:
    """An MQTT 5 device's answer to a command (its PUBLISH to the response topic)."""

    payload: bytes
    region: str | None
    content_type: str | None
    after_s: float


class ReplyWait:
    """A command sent with a response topic, and the wait for its device's answer.

    The command carries the response topic devices/<device>/replies and its
    id (contract.message_id, the id on record in the outcomes topic and the
    one the device acknowledges) as correlation data; the answer is read on
    the backend, where the device's messages arrive (it also reaches Kafka,
    telemetry.replies).  The queue that waits for it is bound before the
    command leaves, so an answer cannot overtake the wait.  Two byte-identical
    commands to one topic share an id, so a waiter may take the other's answer.
    """

    def __init__(
        self,
        url: str,
        device: str,
        topic: str,
        payload: bytes | str,
        *,
        expires_in_s: float | None = None,
        content_type: str | None = None,
    ):
        check_command_size(payload)
        self.body = payload.encode() if isinstance(payload, str) else payload
        self.command_id = c.message_id(topic, self.body)
        reply_topic = c.device_reply_topic(device)
        self._tap = Tap(url, c.TELEMETRY_EXCHANGE, [c.mqtt_topic_to_routing_key(reply_topic)])
        self._headers = command_headers(device, topic, expires_in_s=expires_in_s, response_topic=reply_topic)
        self._props = {
            "correlation_id": self.command_id,
            **({"content_type": content_type} if content_type else {}),
        }
        self.device = device
        self.started = 0.0

    def __enter__(self) -> ReplyWait:
        self._tap.open()
        self.started = time.monotonic()
        _publish(self._tap.ch, c.COMMANDS_EXCHANGE, self.device, self.body, self._headers, **self._props)
        return self

    def poll(self, timeout: float) -> Reply | None:
        """The answer, if it arrives within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for m in self._tap.drain(expect=1, timeout=left):
                # text correlation data is the correlation_id; binary, RabbitMQ's header
                corr = m.correlation_id or m.headers.get("x-correlation-id")
                if corr == self.command_id:  # an answer to another command of the device's
                    return Reply(m.payload, m.region, m.content_type, time.monotonic() - self.started)
        return None

    def __exit__(self, *exc: object) -> None:
        self._tap.close()


def send_and_wait(
    url: str,
    device: str,
    topic: str,
    payload: bytes | str,
    *,
    timeout_s: float = 30.0,
    expires_in_s: float | None = None,
    content_type: str | None = None,
) -> tuple[str, Reply | None]:
    """Send a command whose answer comes back (ReplyWait): (command id, the reply or None
    after `timeout_s`)."""
    with ReplyWait(url, device, topic, payload, expires_in_s=expires_in_s, content_type=content_type) as w:
        return w.command_id, w.poll(timeout_s)
