"""One Kafka security setting set, rendered for librdkafka (router, CLI) and the Java
client (Spark), and refused by name when incomplete."""

from __future__ import annotations

import pytest

from backend.kafka_security import KafkaSecurity, KafkaSecurityError
from router.settings import RouterSettingsError, load_router_settings
from spark.settings import SparkSettings, SparkSettingsError

SCRAM = KafkaSecurity("SASL_SSL", "SCRAM-SHA-512", "fedgate-router", "s3cret", "/etc/fedgate/ca.pem")


def test_scram_over_tls_renders_for_both_clients():
    assert SCRAM.librdkafka() == {
        "security.protocol": "sasl_ssl",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "fedgate-router",
        "sasl.password": "s3cret",
        "ssl.ca.location": "/etc/fedgate/ca.pem",
    }
    java = SCRAM.java()
    assert java["security.protocol"] == "SASL_SSL"
    assert java["sasl.jaas.config"] == (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="fedgate-router" password="s3cret";'
    )
    assert (java["ssl.truststore.type"], java["ssl.truststore.location"]) == ("PEM", "/etc/fedgate/ca.pem")


def test_plaintext_is_the_default_and_adds_no_credentials():
    assert KafkaSecurity().librdkafka() == {"security.protocol": "plaintext"}
    assert KafkaSecurity().java() == {"security.protocol": "PLAINTEXT"}
    assert "ssl.ca.location" not in KafkaSecurity("SSL").librdkafka(), "no CA file: the system's trust store"


@pytest.mark.parametrize(
    ("security", "named"),
    [
        (KafkaSecurity("SASL_PLAIN"), "kafka_security_protocol"),
        (KafkaSecurity("SASL_SSL", "PLAIN", "u", "p"), "kafka_sasl_mechanism"),
        (KafkaSecurity("SASL_SSL", username="u"), "kafka_sasl_password"),
        (KafkaSecurity("SASL_SSL", password="p"), "kafka_sasl_username"),
        (KafkaSecurity("SASL_SSL", username="u", password='p"; evil'), "kafka_sasl_password"),
    ],
)
def test_an_incomplete_or_unsafe_setting_is_refused_by_name(security, named):
    with pytest.raises(KafkaSecurityError, match=named):
        security.validate()


def test_the_router_and_the_job_take_them_as_settings(tmp_path):
    env = {
        "FEDGATE_ROUTER_AMQP_URL": "amqp://u:p@h:5672/%2F",
        "FEDGATE_ROUTER_KAFKA_BOOTSTRAP": "b-1.msk:9096",
        "FEDGATE_ROUTER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "FEDGATE_ROUTER_KAFKA_SASL_USERNAME": "fedgate-router",
        "FEDGATE_ROUTER_KAFKA_SASL_PASSWORD": "s3cret",
    }
    router = load_router_settings(None, env)
    assert router.kafka_client == {
        "bootstrap.servers": "b-1.msk:9096",
        "security.protocol": "sasl_ssl",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "fedgate-router",
        "sasl.password": "s3cret",
    }
    with pytest.raises(RouterSettingsError, match="kafka_sasl_password"):
        load_router_settings(None, {**env, "FEDGATE_ROUTER_KAFKA_SASL_PASSWORD": ""})
    job = SparkSettings.load(
        kafka_bootstrap="b-1.msk:9096",
        warehouse=str(tmp_path),
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_username="fedgate-spark",
        kafka_sasl_password="s3cret",
    )
    options = job.kafka_options()
    assert options["kafka.bootstrap.servers"] == "b-1.msk:9096"
    assert options["kafka.security.protocol"] == "SASL_SSL"
    assert 'username="fedgate-spark"' in options["kafka.sasl.jaas.config"]
    with pytest.raises(SparkSettingsError, match="kafka_sasl_username"):
        SparkSettings.load(kafka_bootstrap="b:1", warehouse=str(tmp_path), kafka_security_protocol="SASL_SSL")
