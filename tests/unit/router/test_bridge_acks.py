"""When the bridge acks a device message: only once its own Kafka record and every earlier
delivery's are settled, and never on the word of a record from a channel that is gone.

The uplink's channel made anew after a connection loss starts its delivery tags at 1 again
while the old channel's records may still be on their way to Kafka (the backend node and
Kafka's leader died together in the HA chaos test that found this: a device's readings
were out of order in Kafka once in a CI run).  Before, the old records' reports settled
the new channel's deliveries of the same tags."""

from __future__ import annotations

import asyncio
from typing import Any

from aiormq.abc import DeliveredMessage
from pamqp import commands as spec
from pamqp.header import ContentHeader

from router.bridge import UplinkBridge
from router.metrics import Metrics
from router.settings import load_router_settings


class Channel:
    """What the bridge uses of an aiormq channel: whether it is closed, and the frames it sends."""

    def __init__(self) -> None:
        self.is_closed = False
        self.frames: list[tuple[str, int]] = []

    async def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.frames.append(("ack-multiple" if multiple else "ack", delivery_tag))

    async def basic_nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        self.frames.append(("nack", delivery_tag))


def delivery(ch: Channel, tag: int, body: bytes = b'{"seq": 0}') -> DeliveredMessage:
    """A device message as aiormq hands it to the bridge."""
    return DeliveredMessage(
        delivery=spec.Basic.Deliver(consumer_tag="c", delivery_tag=tag, routing_key="devices.d1.telemetry"),
        header=ContentHeader(body_size=len(body), properties=spec.Basic.Properties()),
        body=body,
        channel=ch,  # type: ignore[arg-type]
    )


class Producer:
    """Holds each record's delivery report until the test settles it."""

    def __init__(self) -> None:
        self.reports: list[Any] = []

    def produce(self, topic, value, key, headers, on_delivery) -> None:  # noqa: ANN001
        self.reports.append(on_delivery)


def _bridge(tmp_path, producer: Any = None) -> tuple[UplinkBridge, Any]:
    """A bridge whose producer (and second opinion) is `producer`: a Producer by default."""
    p = tmp_path / "router.toml"
    p.write_text('amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:1"\n')
    producer = producer or Producer()
    bridge = UplinkBridge(load_router_settings(p, env={}), producer, Metrics(), producer)
    return bridge, producer


def test_a_message_is_acked_once_its_record_and_every_earlier_one_are_in_kafka(tmp_path):
    async def scenario() -> Channel:
        bridge, producer = _bridge(tmp_path)
        ch = Channel()
        msgs = [delivery(ch, tag) for tag in (1, 2, 3)]
        for m in msgs:
            await bridge.on_message(m)  # type: ignore[arg-type]
        producer.reports[2](None, None)
        producer.reports[1](None, None)
        await asyncio.sleep(0.01)
        assert not ch.frames, "acked before the first record was stored"
        producer.reports[0](None, None)
        await asyncio.sleep(0.01)
        return ch

    assert asyncio.run(scenario()).frames == [("ack-multiple", 3)]  # one frame covers the three


def test_records_of_a_closed_channel_do_not_settle_the_reopened_channels_messages(tmp_path):
    async def scenario() -> tuple[Channel, Channel]:
        bridge, producer = _bridge(tmp_path)
        old_ch, new_ch = Channel(), Channel()
        old = [delivery(old_ch, tag) for tag in (1, 2, 3)]
        for m in old:
            await bridge.on_message(m)  # type: ignore[arg-type]
        old_ch.is_closed = True  # the connection is lost; RabbitMQ requeues 1-3
        new = [delivery(new_ch, tag) for tag in (1, 2, 3)]  # the redeliveries, tags from 1 again
        for m in new:
            await bridge.on_message(m)  # type: ignore[arg-type]
        # Kafka answers the old channel's records late (its leader had died too)
        for report in producer.reports[:3]:
            report(None, None)
        producer.reports[5](None, None)  # the new channel's tag 3 only
        await asyncio.sleep(0.01)
        assert not new_ch.frames, "the old records' reports acked the new channel's messages"
        producer.reports[3](None, None)
        producer.reports[4](None, None)
        await asyncio.sleep(0.01)
        return old_ch, new_ch

    old_ch, new_ch = asyncio.run(scenario())
    assert old_ch.frames == []  # their channel is gone: nothing to ack on
    assert new_ch.frames == [("ack-multiple", 3)]


def test_a_delivery_whose_channel_closed_before_it_ran_is_left_for_rabbitmq_to_redeliver(tmp_path):
    async def scenario() -> int:
        bridge, producer = _bridge(tmp_path)
        ch = Channel()
        ch.is_closed = True
        m = delivery(ch, 1)
        await bridge.on_message(m)  # type: ignore[arg-type]
        return len(producer.reports) + bridge.inflight

    assert asyncio.run(scenario()) == 0


class DeadConnectionChannel(Channel):
    """A channel whose connection died while an ack was on its way: aiormq's basic_ack then
    waits for a writer that never runs again."""

    async def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        await asyncio.get_running_loop().create_future()


def test_an_ack_stuck_on_a_lost_connection_does_not_hold_back_the_new_channels_acks(tmp_path):
    """Found by the chaos test that has the backend close every router connection: the ack
    writer waited for ever on the lost channel, the new channel's acks queued behind it, its
    prefetch filled up and the shards stopped flowing (907 readings not in Kafka)."""

    async def scenario() -> Channel:
        bridge, producer = _bridge(tmp_path)
        old_ch, new_ch = DeadConnectionChannel(), Channel()
        for tag in (1, 2):
            await bridge.on_message(delivery(old_ch, tag))
        for report in producer.reports:
            report(None, None)
        await asyncio.sleep(0.01)  # the writer is now stuck in the old channel's basic_ack
        old_ch.is_closed = True
        for tag in (1, 2):
            await bridge.on_message(delivery(new_ch, tag))
        for report in producer.reports[2:]:
            report(None, None)
        await asyncio.sleep(0.01)
        return new_ch

    assert asyncio.run(scenario()).frames == [("ack-multiple", 2)]
