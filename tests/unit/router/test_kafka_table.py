"""A router's view of a compacted topic (router/stores.py KafkaTable) reads every partition.

Right after a router creates its tables' topics, Kafka's metadata can list a topic with no
partitions yet.  A view assigned none then tailed nothing for the router's whole life: on a
fresh HA federation, a standby router never saw what the leader parked, and a takeover lost
those commands (34 of 165 in tests/ha/test_ha_double_fault.py, 2026-12-06)."""

from __future__ import annotations

from types import SimpleNamespace

from router.stores import PARKED_TOPIC, KafkaTable


class _Consumer:
    """librdkafka's consumer as the view asks it for metadata: a topic just created lists no
    partitions the first times, then its three."""

    def __init__(self, empty_answers: int):
        self.empty_answers, self.asked = empty_answers, 0

    def list_topics(self, topic: str, timeout: float) -> SimpleNamespace:
        self.asked += 1
        partitions = {} if self.asked <= self.empty_answers else {2: None, 0: None, 1: None}
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=partitions)})


def _view(consumer: _Consumer) -> KafkaTable:
    table = KafkaTable("127.0.0.1:1", PARKED_TOPIC, None, "test")  # type: ignore[arg-type]
    table._consumer.close()
    table._consumer = consumer  # type: ignore[assignment]
    return table


def test_a_topic_listed_without_partitions_is_asked_again_until_it_has_them(monkeypatch):
    monkeypatch.setattr("router.stores.time.sleep", lambda s: None)
    consumer = _Consumer(empty_answers=3)
    parts = _view(consumer)._partitions()
    assert [p.partition for p in parts] == [0, 1, 2], "every partition, not none"
    assert consumer.asked == 4


def test_a_topic_that_never_lists_partitions_is_an_error_not_an_empty_view(monkeypatch):
    monkeypatch.setattr("router.stores.time.sleep", lambda s: None)
    consumer = _Consumer(empty_answers=10**9)
    try:
        _view(consumer)._partitions(timeout=0.0)
    except RuntimeError as e:
        assert PARKED_TOPIC in str(e) and "no partitions" in str(e)
    else:
        raise AssertionError("an empty view would tail nothing, silently")
