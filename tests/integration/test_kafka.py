"""The local Kafka broker (KRaft, Apache Kafka's own jars) carries records end to end."""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
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
