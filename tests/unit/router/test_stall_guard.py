"""The producer's stall guard (router/kafka.py): records in flight, no delivery report for
`kafka_stall_s`, and Kafka answering -- the router fails /health and exits 1 for its supervisor.
Kafka away is no stall: it is ridden out, and the clock starts again when Kafka answers."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from confluent_kafka import KafkaError, KafkaException

from router.kafka import AsyncProducer, producer_config
from router.service import Router
from router.settings import load_router_settings


class _Client:
    """librdkafka's producer as the guard asks it: records in flight, and Kafka's metadata."""

    def __init__(self, in_flight: int, answers: bool):
        self.in_flight, self.answers, self.asked = in_flight, answers, 0

    def __len__(self) -> int:
        return self.in_flight

    def list_topics(self, timeout: float) -> SimpleNamespace:
        self.asked += 1
        if not self.answers:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down"))
        return SimpleNamespace(brokers={1: "127.0.0.1:9092"})


def _guarded(client: _Client, stall_after_s: float = 10.0) -> tuple[AsyncProducer, list[str]]:
    said: list[str] = []
    p = AsyncProducer(producer_config("127.0.0.1:1"), stall_after_s=stall_after_s, on_stall=said.append)
    p._producer = client  # type: ignore[assignment]
    return p, said


def test_records_in_flight_with_no_report_while_kafka_answers_is_a_stall_said_once():
    async def scenario():
        p, said = _guarded(_Client(in_flight=3, answers=True))
        p._loop = asyncio.get_running_loop()
        assert p.check_stall() is None, "quiet for less than kafka_stall_s"
        assert p._producer.asked == 0, "Kafka is not asked before then"  # type: ignore[attr-defined]
        p._progress_at = time.monotonic() - 11
        why = p.check_stall()
        assert why is not None and "3 records in flight" in why and "1 brokers" in why
        await asyncio.sleep(0.01)
        assert said == [why]
        assert p.check_stall() == why and said == [why], "said once"

    asyncio.run(scenario())


def test_kafka_away_is_no_stall_and_the_clock_starts_again_when_it_answers():
    p, said = _guarded(_Client(in_flight=3, answers=False))
    p._progress_at = time.monotonic() - 11
    assert p.check_stall() is None and said == []
    assert time.monotonic() - p._progress_at < 1, "the clock starts again"
    p._producer.answers = True  # type: ignore[attr-defined]
    assert p.check_stall() is None, "back for less than kafka_stall_s: not yet"


def test_nothing_in_flight_is_no_stall():
    p, said = _guarded(_Client(in_flight=0, answers=True))
    p._progress_at = time.monotonic() - 600
    assert p.check_stall() is None and said == []


def test_a_real_producer_whose_kafka_is_away_is_not_taken_as_stalled():
    """librdkafka's own client, a record queued for a Kafka nothing listens at."""
    p = AsyncProducer(producer_config("127.0.0.1:1"), stall_after_s=0.5)
    p._producer.produce("t", b"x")
    time.sleep(0.6)
    assert len(p._producer) >= 1, "the record waits for Kafka"
    assert p.check_stall() is None and p.stalled is None
    p._producer.purge()  # the record is the test's: dropped, not left for librdkafka to warn of
    p._producer.flush(0)


def test_a_stalled_producer_fails_health_with_the_reason_and_ends_the_router(tmp_path):
    async def scenario():
        cfg = tmp_path / "router.toml"
        cfg.write_text('amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:1"\n')
        router = Router(load_router_settings(cfg, env={"FEDGATE_ROUTER_KAFKA_STALL_S": "10"}))
        router.ready = True
        router.producer._loop = asyncio.get_running_loop()  # as start() sets it
        router.producer._producer = _Client(in_flight=5, answers=True)  # type: ignore[assignment]
        router.producer._progress_at = time.monotonic() - 11
        router.producer.check_stall()
        await asyncio.wait_for(router.failed_event.wait(), 2)
        status, _, body = router.health()
        assert status == 503 and body.startswith("failed: Kafka producer: stalled: 5 records in flight")
        assert router.metrics.total("fedgate_router_fatal_errors_total") == 1

    asyncio.run(scenario())
