"""kafka_debug: an operator chasing a stalled producer turns on librdkafka's own log
(docs/operations.md, Troubleshooting) and reads its lines in the router's log."""

from __future__ import annotations

import logging

from confluent_kafka import Producer

from router.kafka import producer_config, with_debug_log
from router.settings import load_router_settings


def test_the_setting_comes_from_the_environment_and_is_off_by_default(tmp_path):
    p = tmp_path / "router.toml"
    p.write_text('amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:1"\n')
    assert load_router_settings(p, env={}).kafka_debug == ""
    on = load_router_settings(p, env={"FEDGATE_ROUTER_KAFKA_DEBUG": "broker,eos"})
    assert on.kafka_debug == "broker,eos"
    # off: the producer's settings untouched (against a fresh copy: one changed in place and
    # returned would equal itself)
    assert with_debug_log(producer_config("127.0.0.1:1"), "") == producer_config("127.0.0.1:1")


def test_librdkafkas_lines_reach_the_routers_log_at_its_info_level(caplog, monkeypatch):
    # a router's root logger is at INFO (router/service.py main); the debug lines asked for
    # must show all the same
    monkeypatch.setattr(logging.getLogger(), "level", logging.INFO)
    producer = Producer(with_debug_log(producer_config("127.0.0.1:1"), "broker"))
    for _ in range(10):
        producer.poll(0.1)  # the lines are served by poll(), as the router's poll thread does
    # librdkafka's errors (the refused connection) show without the setting; its debug lines not
    debug = [r.getMessage() for r in caplog.records if r.name == "librdkafka" and r.levelno == logging.DEBUG]
    assert any("127.0.0.1:1" in line for line in debug), debug[:5]
    producer.purge()


def test_the_producers_linger_is_the_routers_setting(tmp_path, monkeypatch):
    """kafka_linger_ms (5 by default: the gateways' batches fill a request at once) reaches the
    router's producer; the producer of records sent alone never lingers."""
    import router.service as service

    p = tmp_path / "router.toml"
    p.write_text('amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:1"\n')
    real = service.AsyncProducer
    lingers: list[int] = []

    def recording(config, *args, **kwargs):
        lingers.append(config["linger.ms"])
        return real(config, *args, **kwargs)

    monkeypatch.setattr(service, "AsyncProducer", recording)
    service.Router(load_router_settings(p, env={}))
    service.Router(load_router_settings(p, env={"FEDGATE_ROUTER_KAFKA_LINGER_MS": "25"}))
    assert lingers == [5, 0, 25, 0]


def test_the_router_producer_keeps_one_request_in_flight_per_broker():
    """With more, librdkafka takes a later request's success as proof that an earlier one which
    failed in transit was stored, and reports its records delivered; a new partition leader
    accepts any first sequence from a producer it does not know, so a producer's first records
    to a partition, in flight to a leader that died, were lost while reported stored (the HA
    kill-every-engine test, 2 runs of 20).  One in flight also sent larger requests: 3,000
    records/s took the producer 50 us each against 240, p99 30 ms against 140 (2026-12-01)."""
    config = producer_config("127.0.0.1:1")
    assert config["enable.idempotence"] is True and config["acks"] == "all"
    assert config["max.in.flight.requests.per.connection"] == 1
