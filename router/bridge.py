"""The Kafka bridge: device messages from the backend's uplink queue into Kafka.

For every AMQP message: map its MQTT topic to a Kafka topic and key (rules
in router/topics.py), produce it with headers (region, MQTT topic, device,
receive time), and ack the AMQP message only when Kafka's delivery report
says it is stored.  Poison input -- a payload over the size limit, a
matching topic without a device, data the rule cannot decode -- goes to the
dead-letter topic with the reason, and is acked once that is stored.

A record Kafka refuses for good (larger than its topic takes, invalid) goes
to the dead-letter topic the same way, with Kafka's error as the reason --
but only once Kafka refused it alone: Kafka judges a whole record batch, so
the small records that shared a batch with an oversized one are refused with
it.  Each refused record is sent once more through a producer that puts one
record in each batch; what Kafka takes then is bridged (possibly after later
records of its key), what it refuses again is dead-lettered.

In-flight messages are bounded by the AMQP prefetch: when Kafka is down,
reports stop, the prefetch fills up and RabbitMQ keeps the rest.

Every router registers on every uplink shard.  A shard is a quorum queue
with a single active consumer, and RabbitMQ 4.0 makes the consumer of the
highest priority the active one: each router registers on its own shards
(settings.my_shards) with a higher priority than on the others, so
the shards are shared out while all routers run, and a router that dies
hands its shards to the others at once.  When it is back, RabbitMQ stops
delivering to the standby and switches the shard back once the standby has
acked what it holds: one producer per shard at a time, in order.

Routers that cannot be numbered (an autoscaling group's) share the shards
by rendezvous hashing instead (router/shards.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import aiormq.abc
from aiormq.abc import DeliveredMessage
from confluent_kafka import KafkaError, Message

from backend import contract as c
from backend import uplink_batch
from backend.polling import await_until
from gateways import mqtt_plugin
from router.kafka import AsyncProducer
from router.lifecycle import Lifecycle
from router.metrics import Metrics, Series
from router.settings import RouterSettings
from router.shards import shard_priority
from router.topics import TopicMapper
from router.uplink_acks import CoalescedAcks
from router.uplink_connection import UplinkConnection

log = logging.getLogger(__name__)

#: called once with whether a reading's record is stored (Kafka's report, or its dead-letter's)
Settle = Callable[[bool], None]


#: How long a shutdown waits for the last acks to be written.
SHUTDOWN_ACK_TIMEOUT_S = 5.0
#: How long a shutdown waits for the records in flight to reach Kafka.
DRAIN_TIMEOUT_S = 30.0
BRIDGED = "fedgate_router_bridged_total"
DEADLETTERED = "fedgate_router_deadlettered_total"
READING_LATENCY = "fedgate_router_reading_latency_seconds"
#: no labels: its series, built once
KAFKA_DELIVERY: Series = ("fedgate_router_kafka_delivery_seconds", ())
SHARD_DELIVERIES = "fedgate_router_shard_deliveries_total"


class Poison(ValueError):
    """A message that can never be bridged as it is; the text is the dead-letter reason."""


class UplinkBridge(Lifecycle):
    def __init__(
        self, settings: RouterSettings, producer: AsyncProducer, metrics: Metrics, alone: AsyncProducer
    ):
        super().__init__()
        self.settings = settings
        self.producer = producer
        #: one record per batch: the second opinion on a record Kafka refused (see the module doc)
        self.alone = alone
        self.metrics = metrics
        self.mapper = TopicMapper(settings.rules, settings.unmatched_topic)
        self.inflight = 0
        #: deliveries that came after stop_intake, left unacked for RabbitMQ to requeue
        self.held = 0
        self._holding = False
        self.connection: UplinkConnection | None = None
        #: (properties, region, MQTT 5 headers) of the last message routed (_from_properties)
        self._last_properties: tuple[Any, bytes, list[tuple[str, bytes]]] | None = None
        #: acks coalesced per channel (router/uplink_acks.py)
        self.acks = CoalescedAcks()
        #: consumer tag -> the shard it reads (a single active consumer: deliveries say which
        #: shards this router reads now, fedgate_router_shard_deliveries_total)
        self._shard_of: dict[str, str] = {}

    def kafka_topics(self) -> list[str]:
        return self.settings.kafka_topics()

    async def _start(self) -> None:
        """Connect (router/uplink_connection.py: its own connection, kept up by itself) and
        register on every shard."""
        s = self.settings
        self.connection = UplinkConnection(s.amqp_urls, f"fedgate router {s.router_id} uplink", self._consume)
        await self.connection.start()
        priorities = {shard: shard_priority(s, shard) for shard in range(s.uplink_shards)}
        if s.shard_owner == "rendezvous":
            log.info(
                "on the uplink shards with rendezvous priorities %s (the highest running reads)", priorities
            )
        else:
            log.info("bridging uplink shards %s; standing by on the others", sorted(s.my_shards))

    async def _consume(self, channel: aiormq.abc.AbstractChannel) -> None:
        """Register on every shard: at start, and on each new channel after a reconnect."""
        s = self.settings
        # prefetch is per consumer: split the in-flight bound over every shard, which a
        # router whose peers are all dead reads at once
        await channel.basic_qos(prefetch_count=max(1, s.max_inflight // max(1, s.uplink_shards)))
        for shard in range(s.uplink_shards):
            queue = c.uplink_shard_queue(shard)
            await channel.queue_declare(queue, passive=True)  # a missing shard: a clear error
            ok = await channel.basic_consume(
                queue, self.on_message, arguments={"x-priority": shard_priority(s, shard)}
            )
            self._shard_of[ok.consumer_tag or ""] = str(shard)

    async def stop_intake(self) -> None:
        """Take no new message into Kafka; what is in flight still drains.

        The consumers stay registered until the connection closes.  Cancelling
        them would hand each shard (single active consumer) to another router
        at once, while this one still has records on their way to Kafka: two
        producers on one partition, and a device's messages out of order.
        Deliveries that arrive meanwhile are held unacked, and RabbitMQ
        requeues them, in order, ahead of the rest when the connection closes.
        """
        self._holding = True

    async def _stop(self) -> None:
        """Stop intake, let what is in flight reach Kafka (bounded), send the last acks."""
        await self.stop_intake()
        await await_until(lambda: not self.inflight, DRAIN_TIMEOUT_S, 0.05)
        if self.inflight:
            log.warning("%d messages still on their way to Kafka; RabbitMQ redelivers them", self.inflight)
        await self.drain_acks()
        if self.connection is not None:
            # the held deliveries and any not acked go back to their shards, in order
            await self.connection.stop()

    # --- per message -------------------------------------------------------------

    def route(
        self, message: DeliveredMessage | BatchedReading
    ) -> tuple[str, str | None, list[tuple[str, bytes]]]:
        """(Kafka topic, key, headers) for a message; raises Poison."""
        props = message.header.properties
        region, mqtt5 = self._from_properties(props)
        mqtt_topic = c.routing_key_to_mqtt_topic(message.routing_key or "")
        received_ms = int(time.time() * 1000)
        headers = [
            (c.KAFKA_REGION_HEADER, region),
            (c.KAFKA_MQTT_TOPIC_HEADER, mqtt_topic.encode()),
            (c.KAFKA_RECEIVED_AT_HEADER, str(received_ms).encode()),
        ]
        if len(message.body) > self.settings.max_payload_bytes:
            raise Poison(
                f"payload of {len(message.body)} bytes is over the limit of {self.settings.max_payload_bytes}"
            )
        if not mqtt_topic:
            raise Poison("message without an MQTT topic")
        headers.append((c.KAFKA_MESSAGE_ID_HEADER, c.message_id(mqtt_topic, message.body).encode()))
        headers += mqtt5
        m = self.mapper.map(mqtt_topic)
        if m is None:
            empty = self.mapper.empty_variable(mqtt_topic)
            if empty is not None:
                raise Poison(f"topic {mqtt_topic!r} names no {empty}")
            return self.settings.unmatched_topic, None, headers
        device = m.variables.get("device")  # rules only match non-empty segments
        if device:
            headers.append((c.KAFKA_DEVICE_HEADER, device.encode()))
        try:
            message.body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Poison(f"payload is not valid UTF-8 ({e.reason} at byte {e.start})") from e
        return m.kafka_topic, m.key, headers

    def _from_properties(self, props: Any) -> tuple[bytes, list[tuple[str, bytes]]]:
        """(region, MQTT 5 headers) of a message's properties; the last answer again for the
        same properties object, which a batch's readings share (uplink_batch.readings)."""
        last = self._last_properties
        if last is not None and last[0] is props:
            return last[1], last[2]
        region = (c.region_from_headers(props.headers) or "").encode()
        mqtt5 = mqtt5_headers(
            mqtt_plugin.properties_of(props.headers, props.content_type, props.correlation_id)
        )
        self._last_properties = (props, region, mqtt5)
        return region, mqtt5

    async def on_message(self, message: DeliveredMessage) -> None:
        if self._holding:
            self.held += 1
            return
        channel = message.channel
        if channel.is_closed:
            return  # its channel closed before this delivery ran: RabbitMQ redelivers it
        tag = self.acks.track(channel, message.delivery_tag)
        # a delivery on a consumer (basic.deliver) names the consumer
        consumer = getattr(message.delivery, "consumer_tag", None) or ""
        self.metrics.inc_series(
            self.metrics.labelled(SHARD_DELIVERIES, "shard", self._shard_of.get(consumer, ""))
        )
        if message.header.properties.content_type != uplink_batch.BATCH_CONTENT_TYPE:
            self._bridge(message, lambda ok: self.acks.settled(channel, tag, message, ok=ok))
            return
        try:
            readings = [
                BatchedReading(r)
                for r in uplink_batch.readings(message.body, message.header.properties.headers)
            ]
        except uplink_batch.MalformedBatch as e:
            self.metrics.inc("fedgate_router_batches_malformed_total")
            self._deadletter(
                message,
                f"malformed uplink batch: {e}",
                lambda ok: self.acks.settled(channel, tag, message, ok=ok),
            )
            return
        self.metrics.inc("fedgate_router_batches_total")
        # the gateway's time of the batch (its first reading's), for the latency histogram
        gateway_at = uplink_batch.first_reading_at(message.header.properties.headers)
        region = c.region_from_headers(message.header.properties.headers) or ""
        latency = self.metrics.series(READING_LATENCY, region=region)
        # the batch is acked once every reading's record is in Kafka (or dead-lettered); one
        # that is not goes back to RabbitMQ whole, and the readings already stored are duplicates
        left, all_ok = len(readings), True

        def settle(ok: bool) -> None:
            nonlocal left, all_ok
            left -= 1
            all_ok = all_ok and ok
            if not left:
                self.acks.settled(channel, tag, message, ok=all_ok)

        if not readings:
            self.acks.settled(channel, tag, message, ok=True)
        for reading in readings:
            self._bridge(reading, settle, gateway_at, latency)

    def _bridge(
        self,
        message: DeliveredMessage | BatchedReading,
        settle: Settle,
        gateway_at: float | None = None,
        latency: Series | None = None,
    ) -> None:
        """Produce one reading; `settle(ok)` once Kafka stored its record (or its dead-letter
        record), or not (back to RabbitMQ).  `gateway_at`: when its batch's first reading
        reached its gateway (s since the epoch, its clock), for the `latency` histogram."""
        try:
            topic, key, headers = self.route(message)
            counter = BRIDGED
        except Poison as e:
            topic, key = self.settings.deadletter_topic, None
            headers = deadletter_headers(message, str(e))
            counter = DEADLETTERED
        started = time.monotonic()
        self.inflight += 1

        def delivered(err: KafkaError | None, msg: Message) -> None:
            self.inflight -= 1
            if err is not None:
                log.error("Kafka refused a record for %s: %s", topic, err)
                self.metrics.inc("fedgate_router_kafka_errors_total")
                if refused_for_good(err) and topic != self.settings.deadletter_topic:
                    self._send_alone(message, settle, topic, key, headers, counter, started)
                    return
                # a fatal producer error (message.timeout.ms=0: nothing else ends here):
                # back to RabbitMQ rather than lost (fedgate.poison after 20 times)
            else:
                self.metrics.observe_series(KAFKA_DELIVERY, time.monotonic() - started)
                if gateway_at is not None and latency is not None:
                    self.metrics.observe_series(latency, max(0.0, time.time() - gateway_at))
                self.metrics.inc_series(self.metrics.labelled(counter, "topic", topic))
            settle(err is None)

        self.producer.produce(topic, message.body, key, headers, delivered)

    def _send_alone(
        self,
        message: DeliveredMessage | BatchedReading,
        settle: Settle,
        topic: str,
        key: str | None,
        headers: list[tuple[str, bytes]],
        counter: str,
        started: float,
    ) -> None:
        """Kafka refused the batch this record was in; ask again with the record alone."""
        self.inflight += 1
        self.metrics.inc("fedgate_router_kafka_sent_alone_total")

        def answered(err: KafkaError | None, msg: Message) -> None:
            self.inflight -= 1
            if err is None:
                self.metrics.observe("fedgate_router_kafka_delivery_seconds", time.monotonic() - started)
                self.metrics.inc(counter, topic=topic)
            elif refused_for_good(err):
                # larger than the topic takes, invalid: to the dead-letter topic with the
                # reason, settled once that is stored; before, it went back to RabbitMQ for ever
                self._deadletter(
                    message, f"Kafka refused the record for {topic}: {err.name()} ({err.str()})", settle
                )
                return
            else:
                log.error("Kafka refused a record sent alone for %s: %s", topic, err)
            settle(err is None)

        self.alone.produce(topic, message.body, key, headers, answered)

    def _deadletter(self, message: DeliveredMessage | BatchedReading, reason: str, settle: Settle) -> None:
        """`message` to the dead-letter topic with `reason`; settled once that is stored."""
        headers = deadletter_headers(message, reason)
        self.inflight += 1

        def stored(err: KafkaError | None, msg: Message) -> None:
            self.inflight -= 1
            if err is None:
                self.metrics.inc(DEADLETTERED, topic=self.settings.deadletter_topic)
            settle(err is None)

        self.producer.produce(self.settings.deadletter_topic, message.body, None, headers, stored)

    async def drain_acks(self) -> None:
        """Send the acks still queued (shutdown)."""
        await self.acks.drain(SHUTDOWN_ACK_TIMEOUT_S)


class BatchedReading:
    """A reading of an uplink batch (with the batch's hop: uplink_batch.readings), shaped as
    route() reads a delivery."""

    __slots__ = ("routing_key", "body", "header")

    def __init__(self, reading: uplink_batch.Reading):
        self.routing_key = reading.routing_key
        self.body = reading.body
        self.header = SimpleNamespace(properties=reading.properties)


def mqtt5_headers(p: mqtt_plugin.Mqtt5Properties) -> list[tuple[str, bytes]]:
    """A device message's MQTT 5 properties as Kafka headers (none for MQTT 3.1.1)."""
    out = [(c.KAFKA_USER_PROPERTY_PREFIX + k, v.encode()) for k, v in p.user_properties]
    if p.content_type is not None:
        out.append((c.KAFKA_CONTENT_TYPE_HEADER, p.content_type.encode()))
    if p.response_topic is not None:
        out.append((c.KAFKA_RESPONSE_TOPIC_HEADER, p.response_topic.encode()))
    if p.correlation_data is not None:
        out.append((c.KAFKA_CORRELATION_DATA_HEADER, p.correlation_data))
    return out


def deadletter_headers(message: DeliveredMessage | BatchedReading, reason: str) -> list[tuple[str, bytes]]:
    """The dead-letter record's headers for a device message that cannot be bridged (logged)."""
    routing_key = message.routing_key or ""
    log.warning("dead-lettering a message on %s: %s", routing_key, reason)
    return [
        (c.KAFKA_DEADLETTER_REASON_HEADER, reason.encode()),
        (c.KAFKA_MQTT_TOPIC_HEADER, c.routing_key_to_mqtt_topic(routing_key).encode()),
        (c.KAFKA_REGION_HEADER, (c.region_from_headers(message.header.properties.headers) or "").encode()),
    ]


def refused_for_good(err: KafkaError) -> bool:
    """Kafka will never take this record as it is (the same produce would fail again)."""
    return not err.fatal() and not err.retriable() and err.code() in REFUSED_FOR_GOOD


#: Errors about the record itself, not about Kafka's state.
REFUSED_FOR_GOOD = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
}
