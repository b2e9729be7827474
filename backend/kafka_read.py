"""Reading a Kafka topic from the outside: how the demo, the army, the benchmarks and the
tests count what arrived.

Every reader here is a throw-away consumer: a group of its own that never
joins (partitions are assigned, not subscribed) and commits nothing, so it
costs no rebalance and leaves no trace.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from backend.kafka_security import KafkaSecurity
from backend.polling import wait_until

Match = Callable[[Message, dict[str, str]], bool]

#: A topic created a moment ago has partitions without a leader for a while; its offsets
#: are asked for again this often, LEADER_RETRY_PAUSE_S apart.
LEADER_RETRIES = 60
LEADER_RETRY_PAUSE_S = 0.5
#: What a partition answers while its leader is being elected or moves, or its broker is
#: out of reach for a moment (librdkafka does not flag these retriable on metadata calls).
#: Any other error (a refused authorization, say) is raised at once: asking again cannot help.
NOT_YET = (
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    # a leader elected a moment ago whose high watermark has not caught up with the
    # followers' yet (KIP-207): seen by the HA benchmark's army once in a full make test
    KafkaError.OFFSET_NOT_AVAILABLE,
)


def not_yet(e: KafkaException) -> bool:
    """Whether `e` says "not yet" (NOT_YET) rather than "no"."""
    return bool(e.args) and isinstance(e.args[0], KafkaError) and e.args[0].code() in NOT_YET


def throwaway_consumer(
    bootstrap: str, purpose: str = "read", security: KafkaSecurity | None = None
) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            **(security or KafkaSecurity()).librdkafka(),
            "group.id": f"fedgate-{purpose}-{uuid.uuid4().hex[:12]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )


def partitions(consumer: Consumer, topic: str, timeout: float = 15.0) -> list[int]:
    """The topic's partitions; RuntimeError if Kafka does not know the topic within `timeout`.

    A topic created a moment ago may be missing from the broker's metadata for a while (KRaft
    applies the creation to the broker's cache after the controller committed it): seen as
    "not found" once in a full `make test`, right after ensure_topics returned."""

    def found() -> list[int]:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        return sorted(meta.partitions) if meta is not None and meta.error is None and meta.partitions else []

    if not (parts := wait_until(found, timeout, 0.2)):
        raise RuntimeError(f"Kafka topic {topic} not found: is the federation up?")
    return parts


def end_offsets(consumer: Consumer, topic: str) -> dict[int, int]:
    """Each partition's end offset (the next record's), waiting for leaders a new topic lacks."""
    out = {}
    for p in partitions(consumer, topic):
        for attempt in range(LEADER_RETRIES):
            try:
                out[p] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                break
            except KafkaException as e:
                if not not_yet(e) or attempt == LEADER_RETRIES - 1:
                    raise
                time.sleep(LEADER_RETRY_PAUSE_S)
    return out


def topic_end(bootstrap: str, topic: str) -> int:
    """Records ever written to the topic (the sum of its end offsets)."""
    consumer = throwaway_consumer(bootstrap, "offsets")
    try:
        return sum(end_offsets(consumer, topic).values())
    finally:
        consumer.close()


def assign_from_start(consumer: Consumer, topic: str) -> None:
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions(consumer, topic)])


def assign_from_end(consumer: Consumer, topic: str) -> None:
    """Only what is written from now on."""
    consumer.assign([TopicPartition(topic, p, end) for p, end in end_offsets(consumer, topic).items()])


def read_records(
    bootstrap: str,
    topic: str,
    match: Match,
    expect: int,
    timeout: float = 20.0,
    settle_s: float = 0.0,
    security: KafkaSecurity | None = None,
    complete: Callable[[], bool] | None = None,
) -> list[tuple[Message, dict[str, str]]]:
    """Records of `topic` from its start that `match` (with their headers decoded), in partition
    order, until `expect` of them arrived (or, given `complete`, until it says so) and then
    `settle_s` passed with no new match (a duplicate would arrive then), or until `timeout`."""
    consumer = throwaway_consumer(bootstrap, security=security)
    assign_from_start(consumer, topic)
    out: list[tuple[Message, dict[str, str]]] = []
    deadline = time.monotonic() + timeout
    last_match = time.monotonic()
    try:
        while time.monotonic() < deadline:
            done = complete() if complete is not None else len(out) >= expect
            if done and time.monotonic() - last_match >= settle_s:
                break
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            headers = {k: v.decode(errors="replace") for k, v in (msg.headers() or [])}
            if match(msg, headers):
                out.append((msg, headers))
                last_match = time.monotonic()
    finally:
        consumer.close()
    return out
