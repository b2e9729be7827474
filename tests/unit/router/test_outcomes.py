"""Each step taken with a command, as the record Kafka gets (router/outcomes.py)."""

from __future__ import annotations

import asyncio
import json

from backend import contract as c
from router.metrics import Metrics
from router.outcomes import MAX_QUEUED, OUTCOMES_TOPIC, CommandOutcomes
from router.settings import RouterSettings


class _Producer:
    def __init__(self, queued: int = 0):
        self.queued = queued
        self.records: list[tuple[str, bytes, object]] = []

    def __len__(self) -> int:
        return self.queued

    def send_soon(self, topic, value, key, headers=None):
        self.records.append((topic, value, key))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def _outcomes(producer: _Producer) -> tuple[CommandOutcomes, Metrics]:
    settings = RouterSettings(amqp_url="amqp://x", kafka_bootstrap="k:1", router_id="router-7")
    metrics = Metrics()
    return CommandOutcomes(producer, metrics, settings), metrics  # type: ignore[arg-type]


def test_a_step_is_one_record_keyed_by_the_command_id():
    producer = _Producer()
    outcomes, metrics = _outcomes(producer)

    async def step() -> None:
        outcomes.of("pump-1", "devices/pump-1/commands/open", b"{}", "routed", region="local-eu")

    asyncio.run(step())
    [(topic, value, key)] = producer.records
    record = json.loads(value)
    assert topic == OUTCOMES_TOPIC and key == c.message_id("devices/pump-1/commands/open", b"{}")
    assert {k: record[k] for k in ("command_id", "device", "outcome", "region", "router")} == {
        "command_id": key,
        "device": "pump-1",
        "outcome": "routed",
        "region": "local-eu",
        "router": "router-7",
    }
    assert metrics.get("fedgate_router_outcomes_total", outcome="routed") == 1


def test_with_kafka_away_and_the_producer_full_a_step_is_dropped_and_counted_not_waited_for():
    producer = _Producer(queued=MAX_QUEUED + 1)
    outcomes, metrics = _outcomes(producer)

    async def step() -> None:
        outcomes.of("pump-1", "devices/pump-1/commands/open", b"{}", "routed", region="local-eu")

    asyncio.run(step())
    assert producer.records == []
    assert metrics.get("fedgate_router_outcomes_dropped_total") == 1


def test_a_commands_way_is_timed_from_its_acceptance_to_each_outcome_that_ends_or_hands_it_on():
    producer = _Producer()
    outcomes, metrics = _outcomes(producer)
    seconds = "fedgate_router_command_seconds"

    async def steps() -> None:
        # QoS 1: routed is its last step
        outcomes.record("a", "pump-1", "t", "accepted")
        outcomes.record("a", "pump-1", "t", "routed", delivery="qos1")
        # QoS 0: routed, then acknowledged by the device
        outcomes.record("b", "pump-2", "t", "accepted")
        outcomes.record("b", "pump-2", "t", "routed", delivery="qos0")
        outcomes.record("b", "pump-2", "t", "acknowledged")
        # parked, then dead-lettered when it expired
        outcomes.record("c", "pump-3", "t", "accepted")
        outcomes.record("c", "pump-3", "t", "parked")
        outcomes.record("c", "pump-3", "t", "deadlettered")
        # accepted by another router (it died): not timed here
        outcomes.record("d", "pump-4", "t", "acknowledged")
        # an acknowledgement repeated: timed once
        outcomes.record("b", "pump-2", "t", "acknowledged")

    asyncio.run(steps())
    assert metrics.observations(seconds, outcome="routed") == 2
    assert metrics.observations(seconds, outcome="acknowledged") == 1
    assert metrics.observations(seconds, outcome="deadlettered") == 1
    assert metrics.observations(seconds, outcome="parked") == 0
