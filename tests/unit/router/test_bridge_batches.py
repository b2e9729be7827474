"""An uplink batch (backend/uplink_batch.py) is bridged reading by reading, as if each had come
alone, and acked only once every reading's record is stored: in its Kafka topic, or in the
dead-letter topic with the reason when that reading is poison.  A batch that does not parse
is dead-lettered whole, with the reason; nothing in it is dropped."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiormq.abc import DeliveredMessage
from confluent_kafka import KafkaError
from pamqp import commands as spec
from pamqp.header import ContentHeader

from backend import contract as c
from backend import uplink_batch
from router.bridge import UplinkBridge
from tests.unit.router.test_bridge_acks import Channel, _bridge

HOPS = [{"cluster-name": "local-eu", "exchange": "amq.topic"}]


class Producer:
    """Every record produced, its report held until the test settles it."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def produce(self, topic, value, key, headers, on_delivery) -> None:  # noqa: ANN001
        self.records.append(
            {"topic": topic, "value": value, "key": key, "headers": dict(headers), "report": on_delivery}
        )


def bridge(tmp_path) -> tuple[UplinkBridge, Producer]:
    return _bridge(tmp_path, Producer())


def reading(device: str, body: bytes, **props: Any) -> uplink_batch.Reading:
    key = c.mqtt_topic_to_routing_key(f"devices/{device}/telemetry")
    return uplink_batch.Reading(key, body, spec.Basic.Properties(**props))


def batch(ch: Channel, tag: int, body: bytes, **headers: Any) -> DeliveredMessage:
    """A batch as the backend's federation link delivers it: the hop's header on the batch."""
    props = spec.Basic.Properties(
        content_type=uplink_batch.BATCH_CONTENT_TYPE, headers={c.RECEIVED_FROM_HEADER: HOPS, **headers}
    )
    return DeliveredMessage(
        delivery=spec.Basic.Deliver(consumer_tag="c", delivery_tag=tag, routing_key="7"),
        header=ContentHeader(body_size=len(body), properties=props),
        body=body,
        channel=ch,  # type: ignore[arg-type]
    )


def test_a_batchs_readings_become_records_of_their_own_and_the_batch_is_acked_after_the_last(tmp_path):
    readings = [
        reading("d1", b'{"seq": 1}', content_type="application/json"),
        reading("d2", b'{"seq": 1}'),
        reading("d1", b'{"seq": 2}', headers={"x-mqtt-user-property": [{"key": "k", "value": "v"}]}),
    ]

    async def scenario() -> tuple[Channel, Producer]:
        b, producer = bridge(tmp_path)
        ch = Channel()
        await b.on_message(batch(ch, 1, uplink_batch.encode(readings)))  # type: ignore[arg-type]
        for r in producer.records[:2]:
            r["report"](None, None)
        await asyncio.sleep(0.01)
        assert not ch.frames, "acked before the batch's last record was stored"
        producer.records[2]["report"](None, None)
        await asyncio.sleep(0.01)
        return ch, producer

    ch, producer = asyncio.run(scenario())
    assert ch.frames == [("ack-multiple", 1)]
    assert [(r["topic"], r["key"], r["value"]) for r in producer.records] == [
        ("telemetry.telemetry", "d1", b'{"seq": 1}'),
        ("telemetry.telemetry", "d2", b'{"seq": 1}'),
        ("telemetry.telemetry", "d1", b'{"seq": 2}'),
    ]
    first = producer.records[0]["headers"]
    assert first[c.KAFKA_REGION_HEADER] == b"local-eu", "the region is the batch's hop"
    assert first[c.KAFKA_DEVICE_HEADER] == b"d1"
    assert first[c.KAFKA_CONTENT_TYPE_HEADER] == b"application/json", "a reading's own MQTT 5 properties"
    ids = {r["headers"][c.KAFKA_MESSAGE_ID_HEADER] for r in producer.records}
    assert len(ids) == 3, "each reading keeps its own message id"


def test_a_poison_reading_is_dead_lettered_alone_and_the_others_bridged(tmp_path):
    readings = [reading("d1", b'{"seq": 1}'), reading("d2", b"\xff\xfe not utf-8"), reading("d3", b"{}")]

    async def scenario() -> tuple[Channel, Producer]:
        b, producer = bridge(tmp_path)
        ch = Channel()
        await b.on_message(batch(ch, 1, uplink_batch.encode(readings)))  # type: ignore[arg-type]
        for r in producer.records:
            r["report"](None, None)
        await asyncio.sleep(0.01)
        return ch, producer

    ch, producer = asyncio.run(scenario())
    assert ch.frames == [("ack-multiple", 1)]
    topics = [r["topic"] for r in producer.records]
    assert topics == ["telemetry.telemetry", "fedgate.deadletter", "telemetry.telemetry"]
    reason = producer.records[1]["headers"][c.KAFKA_DEADLETTER_REASON_HEADER].decode()
    assert "not valid UTF-8" in reason
    assert producer.records[1]["headers"][c.KAFKA_REGION_HEADER] == b"local-eu"


def test_a_batch_with_a_reading_kafka_did_not_store_goes_back_to_rabbitmq_whole(tmp_path):
    readings = [reading("d1", b"{}"), reading("d2", b"{}")]

    async def scenario() -> Channel:
        b, producer = bridge(tmp_path)
        ch = Channel()
        await b.on_message(batch(ch, 1, uplink_batch.encode(readings)))  # type: ignore[arg-type]
        producer.records[0]["report"](None, None)
        producer.records[1]["report"](KafkaError(KafkaError._MSG_TIMED_OUT, fatal=True), None)
        await asyncio.sleep(0.01)
        return ch

    assert asyncio.run(scenario()).frames == [("nack", 1)], "requeued: d1's record is a duplicate then"


def test_a_batch_that_does_not_parse_is_dead_lettered_whole_with_the_reason(tmp_path):
    body = uplink_batch.encode([reading("d1", b"{}")])[:-1]  # its last byte lost

    async def scenario() -> tuple[Channel, Producer]:
        b, producer = bridge(tmp_path)
        ch = Channel()
        await b.on_message(batch(ch, 1, body))  # type: ignore[arg-type]
        producer.records[0]["report"](None, None)
        await asyncio.sleep(0.01)
        return ch, producer

    ch, producer = asyncio.run(scenario())
    assert ch.frames == [("ack-multiple", 1)], "acked once its dead-letter record is stored"
    (record,) = producer.records
    assert record["topic"] == "fedgate.deadletter" and record["value"] == body
    assert record["headers"][c.KAFKA_DEADLETTER_REASON_HEADER].startswith(b"malformed uplink batch")


def test_a_batch_body_reads_back_as_the_readings_written():
    readings = [
        reading("d1", b"", content_type="text/plain", correlation_id="c1", delivery_mode=2),
        reading("d-2", bytes(range(256)), headers={"x-mqtt-publish-qos": 1}),
    ]
    back = list(uplink_batch.decode(uplink_batch.encode(readings)))
    assert [(r.routing_key, r.body) for r in back] == [(r.routing_key, r.body) for r in readings]
    assert back[0].properties.content_type == "text/plain" and back[0].properties.correlation_id == "c1"
    assert back[1].properties.headers == {"x-mqtt-publish-qos": 1}
    assert list(uplink_batch.decode(b"")) == []


def test_readings_that_share_their_properties_and_readings_that_do_not_each_get_their_own_headers(tmp_path):
    """Tried: a batch alternating a plain reading and one with an MQTT 5 user property, as two
    devices' readings interleave (identical property bytes are parsed once a batch, and the
    router reuses what it derived from the last properties).  Each record carries exactly its
    own reading's properties, and every one the batch's region."""
    user = {"unit": "celsius"}  # how RabbitMQ hands an MQTT 5 user property to AMQP
    readings = [
        reading("d1", b'{"seq": 1}'),
        reading("d2", b'{"seq": 1}', headers=user),
        reading("d1", b'{"seq": 2}'),
        reading("d2", b'{"seq": 2}', headers=user),
        reading("d1", b'{"seq": 3}'),
    ]

    async def scenario() -> Producer:
        b, producer = bridge(tmp_path)
        await b.on_message(batch(Channel(), 1, uplink_batch.encode(readings)))  # type: ignore[arg-type]
        return producer

    records = asyncio.run(scenario()).records
    prop = c.KAFKA_USER_PROPERTY_PREFIX + "unit"
    assert [r["headers"].get(prop) for r in records] == [None, b"celsius", None, b"celsius", None]
    assert {r["headers"][c.KAFKA_REGION_HEADER] for r in records} == {b"local-eu"}
    decoded = list(uplink_batch.decode(uplink_batch.encode(readings)))
    assert decoded[0].properties is decoded[2].properties, "the same bytes parsed once a batch"
    assert decoded[0].properties is not decoded[1].properties


def test_each_reading_of_a_batch_is_timed_from_its_gateway_to_kafka_per_region(tmp_path):
    readings = [reading("d1", b'{"seq": 1}'), reading("d2", b'{"seq": 1}')]
    latency = "fedgate_router_reading_latency_seconds"

    async def scenario() -> UplinkBridge:
        b, producer = bridge(tmp_path)
        b._shard_of["c"] = "2"  # the consumer tag basic_consume gave on shard 2
        ch = Channel()
        # its first reading reached the gateway's batcher 1.5 s ago
        at = int((time.time() - 1.5) * 1000)
        await b.on_message(batch(ch, 1, uplink_batch.encode(readings), **{c.FIRST_READING_AT_HEADER: at}))  # type: ignore[arg-type]
        # a batch from a gateway without the header is bridged all the same, not timed
        await b.on_message(batch(ch, 2, uplink_batch.encode(readings)))  # type: ignore[arg-type]
        for r in producer.records:
            r["report"](None, None)
        await asyncio.sleep(0.01)
        assert len(producer.records) == 4
        return b

    b = asyncio.run(scenario())
    assert b.metrics.get("fedgate_router_shard_deliveries_total", shard="2") == 2, (
        "two batches read from shard 2"
    )
    assert b.metrics.observations(latency, region="local-eu") == 2
    assert 1.5 <= b.metrics.hist_sum[(latency, (("region", "local-eu"),))] / 2 < 3
