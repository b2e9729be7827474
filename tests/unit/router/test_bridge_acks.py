"""When the bridge acks a device message: only once its own Kafka record and every earlier
delivery's are settled, and never on the word of a record from a channel that is gone.

A robust channel reopened after a connection loss starts its delivery tags at 1 again
while the old channel's records may still be on their way to Kafka (the backend node and
Kafka's leader died together in the HA chaos test that found this: a device's readings
were out of order in Kafka once in a CI run).  Before, the old records' reports settled
the new channel's deliveries of the same tags."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiormq.exceptions import ChannelInvalidStateError

from router.bridge import UplinkBridge
from router.metrics import Metrics
from router.settings import load_router_settings


class Channel:
    is_closed = False


@dataclass
class Delivery:
    """What the bridge reads of an aio-pika IncomingMessage, and the acks it sends."""

    ch: Channel
    delivery_tag: int
    routing_key: str = "devices.d1.telemetry"
    body: bytes = b'{"seq": 0}'
    headers: dict[str, Any] = field(default_factory=dict)
    content_type: str | None = None
    correlation_id: str | None = None
    acks: list[str] = field(default_factory=list)

    @property
    def channel(self) -> Channel:
        if self.ch.is_closed:  # as aio-pika's IncomingMessage.channel does
            raise ChannelInvalidStateError
        return self.ch

    async def ack(self, multiple: bool = False) -> None:
        self.acks.append("ack-multiple" if multiple else "ack")

    async def nack(self, requeue: bool = True) -> None:
        self.acks.append("nack")


class Producer:
    """Holds each record's delivery report until the test settles it."""

    def __init__(self) -> None:
        self.reports: list[Any] = []

    def produce(self, topic, value, key, headers, on_delivery) -> None:  # noqa: ANN001
        self.reports.append(on_delivery)


def _bridge(tmp_path) -> tuple[UplinkBridge, Producer]:
    p = tmp_path / "router.toml"
    p.write_text('amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:1"\n')
    producer = Producer()
    bridge = UplinkBridge(load_router_settings(p, env={}), producer, Metrics(), producer)  # type: ignore[arg-type]
    return bridge, producer


def test_a_message_is_acked_once_its_record_and_every_earlier_one_are_in_kafka(tmp_path):
    async def scenario() -> list[Delivery]:
        bridge, producer = _bridge(tmp_path)
        ch = Channel()
        msgs = [Delivery(ch, tag) for tag in (1, 2, 3)]
        for m in msgs:
            await bridge.on_message(m)  # type: ignore[arg-type]
        producer.reports[2](None, None)
        producer.reports[1](None, None)
        await asyncio.sleep(0.01)
        assert not any(m.acks for m in msgs), "acked before the first record was stored"
        producer.reports[0](None, None)
        await asyncio.sleep(0.01)
        return msgs

    msgs = asyncio.run(scenario())
    assert [m.acks for m in msgs] == [[], [], ["ack-multiple"]]  # one frame covers the three


def test_records_of_a_closed_channel_do_not_settle_the_reopened_channels_messages(tmp_path):
    async def scenario() -> tuple[list[Delivery], list[Delivery]]:
        bridge, producer = _bridge(tmp_path)
        old_ch, new_ch = Channel(), Channel()
        old = [Delivery(old_ch, tag) for tag in (1, 2, 3)]
        for m in old:
            await bridge.on_message(m)  # type: ignore[arg-type]
        old_ch.is_closed = True  # the connection is lost; RabbitMQ requeues 1-3
        new = [Delivery(new_ch, tag) for tag in (1, 2, 3)]  # the redeliveries, tags from 1 again
        for m in new:
            await bridge.on_message(m)  # type: ignore[arg-type]
        # Kafka answers the old channel's records late (its leader had died too)
        for report in producer.reports[:3]:
            report(None, None)
        producer.reports[5](None, None)  # the new channel's tag 3 only
        await asyncio.sleep(0.01)
        assert not any(m.acks for m in new), "the old records' reports acked the new channel's messages"
        producer.reports[3](None, None)
        producer.reports[4](None, None)
        await asyncio.sleep(0.01)
        return old, new

    old, new = asyncio.run(scenario())
    assert [m.acks for m in old] == [[], [], []]  # their channel is gone: nothing to ack on
    assert [m.acks for m in new] == [[], [], ["ack-multiple"]]


def test_a_delivery_whose_channel_closed_before_it_ran_is_left_for_rabbitmq_to_redeliver(tmp_path):
    async def scenario() -> int:
        bridge, producer = _bridge(tmp_path)
        ch = Channel()
        ch.is_closed = True
        m = Delivery(ch, 1)
        await bridge.on_message(m)  # type: ignore[arg-type]
        return len(producer.reports) + bridge.inflight

    assert asyncio.run(scenario()) == 0
