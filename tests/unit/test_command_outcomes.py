"""How a command ends, read from its steps (backend/command_outcomes.py): what `fedgate send
--wait` and `fedgate command --wait` stop at."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from backend.command_outcomes import QOS1_SETTLED_S, Outcome, OutcomeFollower, final_outcome, partition_of


def test_a_command_ends_acknowledged_deadlettered_or_delivered_once_a_qos1_send_settled():
    routed_q1 = Outcome("routed", 10_000, "local-eu", delivery="qos1")
    settled = 10_000 + int(QOS1_SETTLED_S * 1000)
    assert final_outcome([], settled) is None
    assert final_outcome([Outcome("accepted", 9_990), routed_q1], settled - 1) is None, "may be parked again"
    assert final_outcome([Outcome("accepted", 9_990), routed_q1], settled) == "delivered"
    reparked = Outcome("parked", 10_500, reason="its connection ended as it was sent")
    assert final_outcome([routed_q1, reparked], settled + 60_000) is None, "parked again: it goes on"
    routed_q0 = Outcome("routed", 10_000, "local-eu", delivery="qos0")
    assert final_outcome([routed_q0], settled + 60_000) is None, "a QoS 0 device acknowledges"
    assert final_outcome([routed_q0, Outcome("acknowledged", 10_200)], 10_200) == "acknowledged"
    assert final_outcome([Outcome("routed", 10_000, "local-eu")], settled) is None, "unknown subscriptions"
    assert final_outcome([Outcome("deadlettered", 10_000, reason="expired")], 10_000) == "deadlettered"


def test_ids_spread_over_every_partition():
    # that it is the partition librdkafka writes a key to (CRC-32 of the key, its default
    # partitioner) the integration tests show: they read every step back from it alone
    assert {partition_of(f"{i:032x}", 3) for i in range(100)} == {0, 1, 2}


class _PartitionWithoutLeaderYet:
    """A consumer whose topic exists but whose partition's leader is not elected yet: what a
    single broker answered once in CI right after the topic was created."""

    def __init__(self, refusals: int, error: int = KafkaError.NOT_LEADER_FOR_PARTITION):
        self.refusals, self.error, self.assigned = refusals, error, []

    def list_topics(self, topic, timeout):
        meta = SimpleNamespace(partitions={0: None, 1: None, 2: None}, error=None)
        return SimpleNamespace(topics={topic: meta})

    def get_watermark_offsets(self, tp, timeout):
        if self.refusals:
            self.refusals -= 1
            raise KafkaException(KafkaError(self.error))
        return 0, 4

    def assign(self, parts):
        self.assigned = parts

    def close(self):
        pass


def _follower(monkeypatch, consumer) -> OutcomeFollower:
    monkeypatch.setattr("backend.command_outcomes.throwaway_consumer", lambda bootstrap, purpose: consumer)
    return OutcomeFollower("127.0.0.1:1", "c0ffee")


def test_a_partition_without_its_leader_yet_is_looked_at_again_not_an_error(monkeypatch):
    consumer = _PartitionWithoutLeaderYet(refusals=2)
    follower = _follower(monkeypatch, consumer)
    assert [follower._assign() for _ in range(3)] == [False, False, True]
    assert follower.assigned and [tp.partition for tp in consumer.assigned] == [partition_of("c0ffee", 3)]
    assert not follower.caught_up, "4 records on record, none read yet"


def test_a_refusal_that_will_not_pass_is_raised(monkeypatch):
    refusing = _PartitionWithoutLeaderYet(refusals=1, error=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    follower = _follower(monkeypatch, refusing)
    with pytest.raises(KafkaException):
        follower._assign()
