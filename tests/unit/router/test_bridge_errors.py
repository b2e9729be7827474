"""Which Kafka errors make the bridge dead-letter a record rather than give it back to RabbitMQ."""

from __future__ import annotations

from confluent_kafka import KafkaError

from router.bridge import refused_for_good


def test_a_record_too_large_or_invalid_is_refused_for_good_and_kafka_being_away_is_not():
    assert refused_for_good(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    assert refused_for_good(KafkaError(KafkaError.INVALID_RECORD))
    # Kafka's state, not the record's: the same record goes through later
    assert not refused_for_good(KafkaError(KafkaError._TRANSPORT))
    assert not refused_for_good(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
    # the producer itself is broken: back to RabbitMQ (and the router should be restarted)
    assert not refused_for_good(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, fatal=True))
