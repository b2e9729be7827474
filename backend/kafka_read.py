"""Reading a Kafka topic back from its start: for the demo, tools and tests.

A throw-away consumer (its own group, nothing committed) assigned every
partition from the beginning, kept only for the records `match` accepts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

Match = Callable[[Message, dict[str, str]], bool]


def read_records(
    bootstrap: str, topic: str, match: Match, expect: int, timeout: float = 20.0
) -> list[tuple[Message, dict[str, str]]]:
    """Records of `topic` that `match` (with their headers decoded), until `expect` of them or `timeout`."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"fedgate-read-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    md = consumer.list_topics(topic, timeout=10)
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.topics[topic].partitions])
    out: list[tuple[Message, dict[str, str]]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            headers = {k: v.decode(errors="replace") for k, v in (msg.headers() or [])}
            if match(msg, headers):
                out.append((msg, headers))
    finally:
        consumer.close()
    return out
