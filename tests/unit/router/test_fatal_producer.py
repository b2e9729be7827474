"""A fatal Kafka producer error (the idempotent producer lost its guarantees, so every later
record fails): the router says so on /health and ends with exit code 1 for its supervisor,
instead of reporting healthy and bridging nothing."""

from __future__ import annotations

import asyncio

from confluent_kafka import KafkaError

from router.service import Router
from router.settings import load_router_settings


def _router(tmp_path) -> Router:
    p = tmp_path / "router.toml"
    p.write_text('amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:1"\n')
    return Router(load_router_settings(p, env={}))


def test_a_fatal_producer_error_fails_health_with_the_reason_and_ends_the_router(tmp_path):
    async def scenario():
        router = _router(tmp_path)
        router.ready = True
        router.producer._loop = asyncio.get_running_loop()  # as start() sets it
        assert router.health()[0] == 200
        # librdkafka's error callback, as its poll thread calls it: Kafka away is ridden out
        router.producer._on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "all brokers down"))
        await asyncio.sleep(0.05)
        assert router.health()[0] == 200 and not router.failed_event.is_set()
        router.producer._on_error(KafkaError(KafkaError._FATAL, "out of order sequence number", fatal=True))
        await asyncio.wait_for(router.failed_event.wait(), 2)
        status, _, body = router.health()
        assert status == 503 and body.startswith("failed: Kafka producer") and "out of order" in body
        assert router.metrics.total("fedgate_router_fatal_errors_total") == 1

    asyncio.run(scenario())
