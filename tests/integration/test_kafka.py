"""The local Kafka broker (KRaft, Apache Kafka's own jars) carries records end to end."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def test_a_record_produced_with_an_idempotent_producer_is_consumed(endpoints, uid):
    bootstrap = endpoints["kafka"]["bootstrap"]
    topic = f"test.roundtrip.{uid}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])[topic].result(timeout=30)

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
    reports = []
    for i in range(10):
        producer.produce(
            topic,
            key=f"dev-{i % 3}",
            value=f"reading-{i}".encode(),
            headers={"region": b"local-eu"},
            on_delivery=lambda err, msg: reports.append((err, msg)),
        )
    assert producer.flush(30) == 0
    assert [err for err, _ in reports] == [None] * 10

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uid}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got = []
    try:
        for _ in range(300):
            if len(got) == 10:
                break
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                raise KafkaException(msg.error())
            got.append((msg.key().decode(), msg.value().decode(), dict(msg.headers())["region"]))
    finally:
        consumer.close()
    assert sorted(got) == sorted((f"dev-{i % 3}", f"reading-{i}", b"local-eu") for i in range(10))
    # a key always lands on one partition: per-device order holds
    by_key = {}
    for _, msg in reports:
        by_key.setdefault(msg.key(), set()).add(msg.partition())
    assert all(len(parts) == 1 for parts in by_key.values())


def test_topics_are_not_created_by_accident(endpoints, uid):
    """auto.create.topics.enable=false: producing to an unknown topic is an error, not a new topic."""
    bootstrap = endpoints["kafka"]["bootstrap"]
    producer = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 3000})
    errors = []
    producer.produce(f"typo.{uid}", b"x", on_delivery=lambda err, msg: errors.append(err))
    producer.flush(10)
    assert errors and errors[0] is not None
    topics = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    assert f"typo.{uid}" not in topics


def test_a_records_time_is_the_brokers_append_time_whatever_the_producer_says(endpoints, uid):
    """log.message.timestamp.type=LogAppendTime: the Spark job's Kafka time (the clamp of
    fast device clocks) is the broker's, not a producer's clock -- a router whose
    clock is an hour off must not move it."""
    bootstrap = endpoints["kafka"]["bootstrap"]
    topic = f"test.appendtime.{uid}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=30)
    hour_ago_ms = int(time.time() * 1000) - 3_600_000
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, b"reading", timestamp=hour_ago_ms)
    assert producer.flush(30) == 0
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"t-{uid}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    try:
        msg = None
        for _ in range(150):
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                break
        assert msg is not None and not msg.error(), "the record came back"
    finally:
        consumer.close()
    kind, ts_ms = msg.timestamp()
    assert kind == TIMESTAMP_LOG_APPEND_TIME
    assert abs(ts_ms - time.time() * 1000) < 60_000, f"the broker's time, not the producer's: {ts_ms}"
