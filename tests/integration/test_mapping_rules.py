"""A mapping rule added to the local federation's settings, end to end.

The session federation's `[router]` table (tests/conftest.py ROUTER_TABLE)
carries a rule besides the default one:

    devices/{device}/energy/{kind:power|total}  ->  energy.{kind}, key {device}

Nothing else is configured for it: the local driver passes the table to every
router (which creates the rule's topics and maps by it) and derives the Spark
job's topics from it.  A device's reading on that topic must reach the rule's
Kafka topic with the right key, and telemetry_raw with its topics recorded.
"""

from __future__ import annotations

import datetime as dt

import pytest

from backend import contract as c
from tests.conftest import ENERGY_RULE
from tests.helpers import device, kafka_records
from tests.integration.test_spark import query, wait_rows

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.usefixtures("spark_job"),
]


@pytest.fixture(scope="module")
def spark(federation):
    from spark.query import session

    with session(federation.spark_settings()) as s:
        yield s


def test_a_rule_added_to_the_settings_reaches_its_kafka_topic_and_the_tables(
    federation, endpoints, spark, uid
):
    assert ENERGY_RULE in federation.settings.router["rules"], "the session federation carries the rule"
    dev_id = f"energy-{uid}"
    readings = {"power": 812.5, "total": 40211.0}
    d = device(endpoints, "local-eu", dev_id)
    try:
        for kind, value in readings.items():
            ts = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
            d.publish(f"devices/{dev_id}/energy/{kind}", {"ts": ts, "value": value})
    finally:
        d.close()

    for kind in readings:
        records = kafka_records(
            endpoints,
            f"energy.{kind}",
            lambda msg, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id,
            expect=1,
            settle_s=3.0,  # without it the read stops at the first: a copy could not be seen
        )
        assert len(records) == 1, f"the reading on devices/{dev_id}/energy/{kind} is in energy.{kind} once"
        msg, headers = records[0]
        assert msg.key() == dev_id.encode(), "the rule's key template: {device}"
        assert headers[c.KAFKA_MQTT_TOPIC_HEADER] == f"devices/{dev_id}/energy/{kind}"
        assert headers[c.KAFKA_REGION_HEADER] == "local-eu"

    n = wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device = '{dev_id}'", 2)
    assert n == 2, f"2 readings on the rule's topics, {n} rows in telemetry_raw"
    rows = {
        r["kafka_topic"]: r
        for r in query(spark, federation, f"SELECT * FROM telemetry_raw WHERE device = '{dev_id}'")
    }
    assert set(rows) == {"energy.power", "energy.total"}
    for kind, value in readings.items():
        r = rows[f"energy.{kind}"]
        assert r["mqtt_topic"] == f"devices/{dev_id}/energy/{kind}"
        assert r["region"] == "local-eu" and r["parse_error"] is None
        assert r["numeric_fields"] == {"value": value}

    # nothing of it went to the catch-all (where it went before the rule existed)
    unmatched = kafka_records(
        endpoints,
        c.KAFKA_UNMATCHED_TOPIC,
        lambda msg, h: dev_id in h.get(c.KAFKA_MQTT_TOPIC_HEADER, ""),
        expect=1,
        timeout=3,
    )
    assert not unmatched, f"{len(unmatched)} of the readings in {c.KAFKA_UNMATCHED_TOPIC}"
