"""Reading a topic's end offsets (backend/kafka_read.py): "not yet" is asked again, "no" is not."""

import pytest
from confluent_kafka import KafkaError, KafkaException

from backend import kafka_read


class Answers:
    """A consumer stand-in whose get_watermark_offsets raises the given errors, then answers."""

    def __init__(self, *errors: int):
        self.errors = list(errors)
        self.calls = 0

    def get_watermark_offsets(self, tp, timeout):
        self.calls += 1
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0)))
        return 0, 10 + tp.partition


@pytest.fixture(autouse=True)
def two_partitions(monkeypatch):
    monkeypatch.setattr(kafka_read, "partitions", lambda consumer, topic: [0, 1])
    monkeypatch.setattr(kafka_read, "LEADER_RETRY_PAUSE_S", 0.0)


def test_a_partition_without_a_leader_yet_is_asked_again():
    consumer = Answers(KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION)
    assert kafka_read.end_offsets(consumer, "t") == {0: 10, 1: 11}
    assert consumer.calls == 4


def test_a_new_leader_whose_high_watermark_lags_is_asked_again():
    # an HA cluster's partition leader moved a moment ago (the HA benchmark's army, make test)
    consumer = Answers(KafkaError.OFFSET_NOT_AVAILABLE)
    assert kafka_read.end_offsets(consumer, "t") == {0: 10, 1: 11}
    assert consumer.calls == 3


def test_a_refusal_is_raised_at_once_not_asked_sixty_times():
    consumer = Answers(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException) as err:
        kafka_read.end_offsets(consumer, "t")
    assert err.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert consumer.calls == 1
