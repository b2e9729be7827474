"""The producer's stall guard (router/kafka.py): a record that waited `kafka_stall_s` for its
delivery report while Kafka answers -- the router fails /health and exits 1 for its supervisor.
Kafka away is no stall: it is ridden out, and a record's wait counts from when Kafka is back."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

from confluent_kafka import KafkaError, KafkaException

from router.kafka import AsyncProducer, producer_config
from router.service import Router
from router.settings import load_router_settings


class _Client:
    """librdkafka's producer as the guard asks it: Kafka's metadata, answered or not."""

    def __init__(self, answers: bool):
        self.answers, self.asked = answers, 0

    def __len__(self) -> int:
        return 0

    def list_topics(self, timeout: float) -> SimpleNamespace:
        self.asked += 1
        if not self.answers:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down"))
        return SimpleNamespace(brokers={1: "b1", 2: "b2"})


def _guarded(answers: bool, stall_after_s: float = 10.0) -> tuple[AsyncProducer, list[str]]:
    """The guard's own client stands for Kafka; the producer's handle points at a port nothing
    listens at, so it answers nothing (as a wedged handle does)."""
    said: list[str] = []
    p = AsyncProducer(producer_config("127.0.0.1:1"), stall_after_s=stall_after_s, on_stall=said.append)
    p._prober = _Client(answers)  # type: ignore[assignment]
    return p, said


def _waiting_since(p: AsyncProducer, *ages: float) -> None:
    """Records produced `ages` seconds ago, oldest first, none reported yet."""
    now = time.monotonic()
    p._waiting = {n: now - age for n, age in enumerate(ages, 1)}


def _waited_s(said: str) -> int:
    """The seconds a stall message says the oldest record waited: at least its age when the
    test set it, more on a busy machine (a suite run once said 12 for a record set 11 s old)."""
    found = re.search(r"has waited (\d+) s", said)
    assert found, said
    return int(found.group(1))


def test_a_record_waiting_past_kafka_stall_s_while_kafka_answers_is_a_stall_said_once():
    async def scenario():
        p, said = _guarded(answers=True)
        _waiting_since(p, 1)
        assert await p.check_stall() is None
        assert p._prober.asked == 0, "a record waiting a second is no reason to ask Kafka"  # type: ignore[attr-defined]
        _waiting_since(p, 8, 1)
        assert await p.check_stall() is None, "waited less than kafka_stall_s"
        _waiting_since(p, 11, 1, 0)
        why = await p.check_stall()
        assert why is not None and _waited_s(why) >= 11 and "3 in flight" in why and "2 brokers" in why
        assert said == [why]
        assert await p.check_stall() == why and said == [why], "said once"

    asyncio.run(scenario())


def test_one_stuck_record_is_a_stall_however_many_others_are_reported():
    """A frozen broker's partitions: their records wait while the other brokers' records are
    reported.  The time since the last report would never grow; the oldest record's wait does."""

    async def scenario():
        p, said = _guarded(answers=True)
        _waiting_since(p, 25)
        stuck = next(iter(p._waiting))
        for n in range(100, 110):  # records of the other partitions, produced and reported
            p._waiting[n] = time.monotonic()
            p._dispatch([(lambda err, msg: None, None, None, n)])  # type: ignore[list-item]
        assert list(p._waiting) == [stuck]
        assert await p.check_stall() is not None and said

    asyncio.run(scenario())


def test_kafka_away_is_no_stall_and_the_wait_counts_from_when_it_answers_again():
    async def scenario():
        p, said = _guarded(answers=False)
        _waiting_since(p, 30)
        assert await p.check_stall() is None and said == []
        assert p.oldest_wait() < 1, "the wait counts from Kafka's return"
        p._prober.answers = True  # type: ignore[attr-defined]
        assert await p.check_stall() is None, "back for less than kafka_stall_s: not yet"

    asyncio.run(scenario())


def test_a_wait_counts_from_kafkas_return_however_long_it_was_away(monkeypatch):
    """Tried: a record waits while Kafka is away for 30 s, then Kafka answers again; the guard
    looks once a second (kafka_stall_s 20).  The stall may be said 20 s after Kafka's return
    at the earliest: before, Kafka was asked only once a record had waited 20 s, the wait
    counted from that look (t=20), and the look at t=40 took Kafka, back at t=30, for a stall."""
    from router import kafka

    clock = [1000.0]
    monkeypatch.setattr(kafka.time, "monotonic", lambda: clock[0])

    async def scenario() -> float | None:
        p, said = _guarded(answers=False, stall_after_s=20.0)
        p._waiting = {1: clock[0]}  # produced at t=0, never reported
        for t in range(1, 90):
            clock[0] = 1000.0 + t
            p._prober.answers = t >= 30  # type: ignore[attr-defined]
            if await p.check_stall() is not None:
                return float(t)
        return None

    stalled_at = asyncio.run(scenario())
    assert stalled_at is not None, "a record Kafka never reports is a stall in the end"
    assert stalled_at >= 30 + 20 - kafka.STALL_CHECK_EVERY_S, f"said at t={stalled_at}, Kafka back at t=30"


def test_nothing_in_flight_is_no_stall():
    async def scenario():
        p, said = _guarded(answers=True)
        assert p.oldest_wait() == 0.0 and await p.check_stall() is None and said == []

    asyncio.run(scenario())


def test_a_real_producer_whose_kafka_is_away_is_not_taken_as_stalled():
    """librdkafka's own client, a record produced for a Kafka nothing listens at."""

    async def scenario():
        p = AsyncProducer(producer_config("127.0.0.1:1"), stall_after_s=0.5)
        await p.start()
        try:
            p.produce("t", b"x", None, None, lambda err, msg: None)
            await asyncio.sleep(0.6)
            assert p.oldest_wait() >= 0.5, "the record waits for Kafka"
            assert await p.check_stall() is None and p.stalled is None
        finally:
            p._producer.purge()  # the record is the test's: dropped, not left for librdkafka to warn of
            await p.stop()

    asyncio.run(scenario())


def test_a_producer_handle_that_answers_nothing_while_kafka_does_is_a_stall():
    """Tried: the producer's own librdkafka handle pointed at a port nothing listens at (as a
    wedged handle: it answers no metadata request), a record waiting past kafka_stall_s, and
    Kafka -- the guard's own client -- answering.  A stall: the guard asks its own client,
    so a handle that stopped talking to Kafka is not taken for Kafka away."""

    async def scenario():
        p, said = _guarded(answers=True)
        _waiting_since(p, 11)
        why = await p.check_stall()
        assert why is not None and "2 brokers" in why and said == [why]

    asyncio.run(scenario())


def test_the_guards_own_client_takes_where_kafka_is_and_the_login_not_the_producers_settings():
    from router.kafka import probe_config, with_debug_log

    config = with_debug_log(
        producer_config({"bootstrap.servers": "k:9093", "security.protocol": "SASL_SSL"}), "broker"
    )
    probe = probe_config(config)
    assert probe["bootstrap.servers"] == "k:9093" and probe["security.protocol"] == "SASL_SSL"
    assert not {"enable.idempotence", "acks", "linger.ms", "debug", "logger"} & set(probe)


def test_a_stalled_producer_fails_health_with_the_reason_and_ends_the_router(tmp_path):
    async def scenario():
        cfg = tmp_path / "router.toml"
        cfg.write_text('amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:1"\n')
        router = Router(load_router_settings(cfg, env={"FEDGATE_ROUTER_KAFKA_STALL_S": "10"}))
        router.ready = True
        router.producer._prober = _Client(answers=True)  # type: ignore[assignment]
        _waiting_since(router.producer, 11)
        await router.producer.check_stall()
        await asyncio.wait_for(router.failed_event.wait(), 2)
        status, _, body = router.health()
        assert status == 503 and body.startswith("failed: Kafka producer: stalled: a record has waited")
        assert _waited_s(body) >= 11, body
        assert router.metrics.total("fedgate_router_fatal_errors_total") == 1

    asyncio.run(scenario())
