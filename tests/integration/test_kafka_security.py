"""Kafka over TLS with SASL/SCRAM, what Amazon MSK asks for: the local Kafka's SASL_SSL
listener (beside its plaintext one, with tls) and the router's and the CLI's Kafka clients
configured by the settings (backend/kafka_security.py).  The Spark job's source over the
same listener: tests/integration/test_spark.py."""

from __future__ import annotations

import dataclasses

import pytest
from confluent_kafka import Producer

from backend import kafka_read
from router.kafka import KafkaUnavailable, ensure_topics, producer_config
from router.settings import load_router_settings
from tests.helpers import sasl_security

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def test_the_routers_kafka_clients_produce_and_read_back_over_sasl_ssl_with_scram(federation, endpoints, uid):
    """Tried: the router's settings with SASL_SSL (SCRAM-SHA-512, the local CA) create a
    topic, produce 50 records with the router's producer settings (idempotent, acks=all), and
    the CLI's read-back reads them with the same credentials: 50 of 50, in order."""
    security = sasl_security(federation)
    sasl = endpoints["kafka"]["sasl_bootstrap"]
    settings = load_router_settings(
        None,
        {
            "FEDGATE_ROUTER_AMQP_URL": "amqp://u:p@127.0.0.1:1/%2F",
            "FEDGATE_ROUTER_KAFKA_BOOTSTRAP": sasl,
            "FEDGATE_ROUTER_KAFKA_SECURITY_PROTOCOL": security.protocol,
            "FEDGATE_ROUTER_KAFKA_SASL_USERNAME": security.username,
            "FEDGATE_ROUTER_KAFKA_SASL_PASSWORD": security.password,
            "FEDGATE_ROUTER_KAFKA_CA_FILE": security.ca_file,
        },
    )
    topic = f"sasl.{uid}"
    assert ensure_topics(settings.kafka_client, [topic], 1, 1) == [topic]
    producer = Producer(producer_config(settings.kafka_client))
    for i in range(50):
        producer.produce(topic, str(i).encode(), key=b"dev")
    assert producer.flush(30) == 0, "Kafka confirmed every record over SASL_SSL"
    got = kafka_read.read_records(sasl, topic, lambda m, h: True, 50, settle_s=1.0, security=security)
    print(f"sasl_ssl: produced=50 read_back={len(got)}")
    assert [m.value() for m, _ in got] == [str(i).encode() for i in range(50)]


def test_a_wrong_password_or_a_plaintext_client_is_refused_with_the_reason(federation, endpoints, uid):
    """Tried: the right user with a wrong password, and a client without SASL or TLS, at the
    SASL_SSL listener.  Both are refused; the wrong password's error says the login failed."""
    security = sasl_security(federation)
    sasl = endpoints["kafka"]["sasl_bootstrap"]
    wrong = dataclasses.replace(security, password=security.password + "x")
    with pytest.raises(KafkaUnavailable, match="refused the login: .*SASL authentication"):
        ensure_topics({"bootstrap.servers": sasl, **wrong.librdkafka()}, [f"sasl.{uid}"], 1, 1, timeout=8)
    with pytest.raises(KafkaUnavailable, match="unreachable"):
        ensure_topics(sasl, [f"sasl.{uid}"], 1, 1, timeout=5)
