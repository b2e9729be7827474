"""The pure transforms on small frames with a real local SparkSession (no Kafka)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from backend import contract as c
from spark import transforms as tr
from spark.tables import KAFKA_SOURCE_SCHEMA

pytestmark = pytest.mark.spark

NOW = dt.datetime(2026, 11, 22, 10, 0, 30)
NOW_MS = int(NOW.replace(tzinfo=dt.UTC).timestamp() * 1000)
UNMATCHED, DEADLETTER = c.KAFKA_UNMATCHED_TOPIC, c.KAFKA_DEADLETTER_TOPIC


def bridge_headers(
    device: str = "d1", region: str = "local-eu", topic: str | None = None, payload: bytes = b""
):
    mqtt_topic = topic or f"devices/{device}/telemetry"
    return [
        (c.KAFKA_REGION_HEADER, region.encode()),
        (c.KAFKA_MQTT_TOPIC_HEADER, mqtt_topic.encode()),
        (c.KAFKA_DEVICE_HEADER, device.encode()),
        (c.KAFKA_RECEIVED_AT_HEADER, str(NOW_MS).encode()),
        (c.KAFKA_MESSAGE_ID_HEADER, c.message_id(mqtt_topic, payload).encode()),
    ]


def record(
    payload: bytes | dict, offset: int, topic: str = "telemetry.telemetry", headers=None, ts=NOW, **kw
):
    value = json.dumps(payload).encode() if isinstance(payload, dict) else payload
    hdrs = bridge_headers(payload=value, **kw) if headers is None else headers
    return (b"d1", value, topic, 0, offset, ts, 0, hdrs)


def decode(spark, rows, max_bytes=1024):
    df = spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA)
    return tr.decode_kafka(df, UNMATCHED, DEADLETTER, max_bytes)


def by_offset(df):
    return {r["kafka_offset"]: r for r in df.collect()}


def test_a_reading_becomes_one_raw_row_with_parsed_fields(spark):
    d = decode(spark, [record({"ts": NOW_MS - 25, "temp_c": 21.5, "ok": True, "seq": 7}, 1)])
    (row,) = tr.raw_rows(d).collect()
    assert row["device"] == "d1" and row["region"] == "local-eu"
    assert row["mqtt_topic"] == "devices/d1/telemetry"
    assert (row["kafka_topic"], row["kafka_partition"], row["kafka_offset"]) == ("telemetry.telemetry", 0, 1)
    assert row["fields"]["ok"] == "true"
    assert row["numeric_fields"] == {"temp_c": 21.5, "seq": 7.0}  # the timestamp and booleans are not metrics
    assert row["device_ts"] == NOW - dt.timedelta(milliseconds=25)
    assert row["event_time"] == row["device_ts"]
    assert row["latency_ms"] == 25
    assert row["received_at"] == NOW
    assert row["parse_error"] is None
    assert row["date"] == NOW.date()


def test_device_timestamps_in_seconds_milliseconds_and_iso_8601_agree(spark):
    sent = NOW - dt.timedelta(seconds=2)
    ms = int(sent.replace(tzinfo=dt.UTC).timestamp() * 1000)
    d = decode(
        spark,
        [
            record({"ts": ms}, 1),
            record({"ts": ms / 1000}, 2),
            record({"ts": sent.isoformat() + "Z"}, 3),
        ],
    )
    rows = by_offset(tr.raw_rows(d))
    assert {r["device_ts"] for r in rows.values()} == {sent}
    assert {r["latency_ms"] for r in rows.values()} == {2000}


def test_bad_payloads_are_kept_with_the_reason_never_dropped(spark):
    d = decode(
        spark,
        [
            record(b'{"temp_c": ', 1),
            record(b"[1, 2, 3]", 2),
            record({"temp_c": 3}, 3),
            record({"ts": "yesterday", "temp_c": "warm"}, 4),
            record({"ts": 1, "temp_c": 4}, 5),
        ],
    )
    rows = by_offset(tr.raw_rows(d))
    assert len(rows) == 5, "every record is a row"
    assert rows[1]["parse_error"] == "payload is not valid JSON" and rows[1]["payload"] == '{"temp_c": '
    assert rows[2]["parse_error"] == "payload is not a JSON object"
    assert rows[3]["parse_error"].startswith("no device timestamp")
    assert rows[3]["numeric_fields"] == {"temp_c": 3.0}
    assert "neither epoch nor ISO 8601" in rows[4]["parse_error"]
    assert rows[4]["numeric_fields"] == {}, "a string where a number was expected is no metric"
    assert "more than 7 days before" in rows[5]["parse_error"]
    for r in rows.values():
        if r["device_ts"] is None or r["parse_error"]:
            assert r["event_time"] == NOW, "Kafka time stands in for a missing or implausible device time"
            assert r["latency_ms"] is None


def test_a_fast_device_clock_is_clamped_to_kafka_time_kept_and_flagged(spark):
    """A reading cannot reach Kafka before it was sent: a device time after Kafka's is a fast
    clock.  Its event time (the minute the aggregates count it in) is clamped to Kafka time,
    its own time kept in device_ts; beyond the tolerance it is flagged and has no latency."""
    ahead = lambda s: int((NOW + dt.timedelta(seconds=s)).replace(tzinfo=dt.UTC).timestamp() * 1000)  # noqa: E731
    d = decode(
        spark, [record({"ts": ahead(600)}, 1), record({"ts": ahead(1)}, 2), record({"ts": ahead(7200)}, 3)]
    )
    rows = by_offset(tr.raw_rows(d))
    ten_minutes, skew, two_hours = rows[1], rows[2], rows[3]
    assert ten_minutes["device_ts"] == NOW + dt.timedelta(minutes=10), "the device's own time is kept"
    assert ten_minutes["event_time"] == NOW and ten_minutes["date"] == NOW.date()
    assert ten_minutes["parse_error"] == "device clock 600.0 s ahead of Kafka time; event time clamped to it"
    assert ten_minutes["latency_ms"] is None, "no latency from a clock known to be wrong"
    assert two_hours["event_time"] == NOW and "7200.0 s ahead" in two_hours["parse_error"]
    # within the tolerance: the skew of synchronised clocks, clamped but not a flaw
    assert skew["event_time"] == NOW and skew["parse_error"] is None and skew["latency_ms"] == -1000


def test_records_that_cannot_be_rows_are_rejects_with_a_reason(spark):
    d = decode(
        spark,
        [
            record(b"x" * 2000, 1),
            record({"a": 1}, 2, topic=UNMATCHED),
            record(b"oops", 3, topic=DEADLETTER, headers=[(c.KAFKA_DEADLETTER_REASON_HEADER, b"not UTF-8")]),
            record({"a": 1}, 4, headers=[]),
            record({"ts": NOW_MS}, 5),
        ],
        max_bytes=1024,
    )
    assert [r["kafka_offset"] for r in tr.raw_rows(d).collect()] == [5]
    rejects = by_offset(tr.reject_rows(d))
    assert rejects[1]["reason"] == "payload of 2000 bytes is over the limit of 1024"
    assert rejects[1]["payload_bytes"] == 2000
    assert rejects[2]["reason"] == "no mapping rule for MQTT topic devices/d1/telemetry"
    assert rejects[3]["reason"] == "dead-lettered by the bridge: not UTF-8"
    assert rejects[4]["reason"] == "record without fedgate headers (not produced by the bridge)"
    assert rejects[4]["payload_preview"] == '{"a": 1}'


def test_message_id_is_the_same_with_or_without_the_bridge_header(spark):
    payload = json.dumps({"ts": NOW_MS, "seq": 1}).encode()
    with_header = record(payload, 1)
    without = record(
        payload, 2, headers=[h for h in bridge_headers(payload=payload) if h[0] != c.KAFKA_MESSAGE_ID_HEADER]
    )
    other = record(json.dumps({"ts": NOW_MS, "seq": 2}).encode(), 3)
    rows = by_offset(decode(spark, [with_header, without, other]))
    assert rows[1]["message_id"] == rows[2]["message_id"] == c.message_id("devices/d1/telemetry", payload)
    assert rows[3]["message_id"] != rows[1]["message_id"]


def test_device_minute_counts_messages_and_summarises_each_numeric_field(spark):
    t0 = NOW.replace(second=0)
    ms = lambda t: int(t.replace(tzinfo=dt.UTC).timestamp() * 1000)  # noqa: E731
    at = lambda s: t0 + dt.timedelta(seconds=s)  # noqa: E731
    # each in Kafka 80 s after it was sent: the third arrives last though it was sent second
    rows = [
        record({"ts": ms(at(1)), "temp_c": 20.0}, 1, ts=at(81)),
        record({"ts": ms(at(30)), "temp_c": 24.0, "rssi": -70}, 2, ts=at(110)),
        record({"ts": ms(at(10)), "temp_c": 22.0}, 3, ts=at(115)),
        record({"ts": ms(at(5))}, 4, ts=at(85)),  # no metric: counts as a message
        record({"ts": ms(at(70)), "temp_c": 30.0}, 5, ts=at(150)),  # next minute
    ]
    agg = tr.device_minute(tr.raw_rows(decode(spark, rows)))
    got = {(r["minute"], r["field"]): r for r in agg.collect()}
    first = got[(t0, "temp_c")]
    assert (first["count"], first["min"], first["max"], first["avg"]) == (3, 20.0, 24.0, 22.0)
    assert first["last"] == 24.0, "last by device time, not by arrival"
    assert got[(t0, tr.ALL_MESSAGES_FIELD)]["count"] == 4
    assert got[(t0, "rssi")]["count"] == 1
    assert got[(t0 + dt.timedelta(minutes=1), "temp_c")]["count"] == 1
    assert first["region"] == "local-eu" and first["date"] == NOW.date()


def test_a_device_that_moved_region_in_a_minute_is_in_the_region_of_its_last_reading(spark):
    """device_minute keeps the region of the device's last reading of the minute (by device
    time, whatever the arrival order); other devices keep theirs."""
    t0 = NOW.replace(second=0)
    at = lambda s: int((t0 + dt.timedelta(seconds=s)).replace(tzinfo=dt.UTC).timestamp() * 1000)  # noqa: E731
    kafka = t0 + dt.timedelta(seconds=90)  # all in Kafka after they were sent
    rows = [
        record({"ts": at(1), "temp_c": 20.0}, 1, ts=kafka, device="mover", region="local-eu"),
        record({"ts": at(40), "temp_c": 21.0}, 2, ts=kafka, device="mover", region="local-us"),  # moved
        record({"ts": at(20), "temp_c": 22.0}, 3, ts=kafka, device="mover", region="local-ap"),  # sent 2nd
        record({"ts": at(50), "temp_c": 23.0}, 4, ts=kafka, device="stayer", region="local-eu"),
        record({"ts": at(10), "temp_c": 24.0}, 5, ts=kafka, device="stayer", region="local-eu"),
    ]
    agg = tr.device_minute(tr.raw_rows(decode(spark, rows)))
    regions = {(r["device"], r["field"]): r["region"] for r in agg.collect()}
    assert regions == {
        ("mover", tr.ALL_MESSAGES_FIELD): "local-us",
        ("mover", "temp_c"): "local-us",
        ("stayer", tr.ALL_MESSAGES_FIELD): "local-eu",
        ("stayer", "temp_c"): "local-eu",
    }


def test_region_minute_counts_devices_and_latency_percentiles(spark):
    rows = []
    for i in range(100):
        dev = f"d{i % 4}"
        rows.append(record({"ts": NOW_MS - (i + 1), "i": i}, i, device=dev))
    rows.append(record({"ts": NOW_MS - 5}, 200, device="u1", region="local-us"))
    agg = {r["region"]: r for r in tr.region_minute(tr.raw_rows(decode(spark, rows))).collect()}
    eu = agg["local-eu"]
    assert (eu["messages"], eu["devices"]) == (100, 4)
    assert eu["latency_p50_ms"] == 50 and eu["latency_p95_ms"] == 95 and eu["latency_p99_ms"] == 99
    assert eu["latency_max_ms"] == 100
    assert (agg["local-us"]["messages"], agg["local-us"]["devices"]) == (1, 1)


def test_latency_percentiles_over_100_ms_are_within_half_a_percent(spark):
    """Latencies of 1..2000 ms, and one reading with no device time (no latency)."""
    rows = [record({"ts": NOW_MS - (i + 1), "i": i}, i, device=f"d{i % 50}") for i in range(2000)]
    rows.append(record({"i": "no clock"}, 5000))
    eu = tr.region_minute(tr.raw_rows(decode(spark, rows))).first()
    assert (eu["messages"], eu["devices"], eu["latency_max_ms"]) == (2001, 50, 2000)
    for column, exact in (("latency_p50_ms", 1000), ("latency_p95_ms", 1900), ("latency_p99_ms", 1980)):
        assert eu[column] == pytest.approx(exact, rel=0.005), column
    assert sum(eu["latency_histogram"].values()) == 2000


def test_an_mqtt5_readings_user_properties_are_a_column_and_an_mqtt311_reading_has_none(spark):
    five = bridge_headers() + [
        (c.KAFKA_USER_PROPERTY_PREFIX + "unit", b"celsius"),
        (c.KAFKA_USER_PROPERTY_PREFIX + "fw", b"2.1.0"),
        (c.KAFKA_CONTENT_TYPE_HEADER, b"application/json"),
    ]
    d = decode(spark, [record({"temp_c": 21.5}, 1, headers=five), record({"temp_c": 19.0}, 2)])
    rows = by_offset(tr.raw_rows(d))
    assert rows[1]["user_properties"] == {"unit": "celsius", "fw": "2.1.0"}
    assert rows[2]["user_properties"] == {}


def test_a_repeated_key_in_headers_or_payload_never_fails_the_batch(spark):
    # not what the bridge writes (RabbitMQ keeps the first of a repeated user property), but a
    # record written to the topic by anyone else must not stop the job: the last value wins
    hdrs = bridge_headers() + [
        (c.KAFKA_USER_PROPERTY_PREFIX + "unit", b"C"),
        (c.KAFKA_USER_PROPERTY_PREFIX + "unit", b"K"),
    ]
    d = decode(spark, [record(b'{"temp_c": 1, "temp_c": 2}', 1, headers=hdrs)])
    (row,) = tr.raw_rows(d).collect()
    assert row["user_properties"] == {"unit": "K"}
    assert row["numeric_fields"] == {"temp_c": 2.0}


def test_a_small_batch_planned_without_generated_code_gives_the_same_rows(spark):
    """The job plans a steady stream's small batches without Spark's generated code
    (spark.job.interpreted_for): every expression of the batch's path -- decode, parse, the
    summary, the rows of both tables -- must give the same rows interpreted, and the plan
    must really be interpreted (no whole-stage code)."""
    from spark.job import INTERPRETED_BELOW_RECORDS, interpreted_for
    from spark.tables import summarize_batch

    five = bridge_headers() + [(c.KAFKA_USER_PROPERTY_PREFIX + "unit", b"celsius")]
    records = [
        record({"ts": NOW_MS - 25, "temp_c": 21.5, "ok": True, "seq": 7}, 1),
        record({"ts": "2026-11-22T10:00:29.500Z", "rh": 40}, 2, device="d2"),
        record({"temp_c": 19.0}, 3, headers=five),  # no device time; MQTT 5 user properties
        record({"ts": NOW_MS + 3_600_000 * 5, "temp_c": 1}, 4),  # a clock hours fast: clamped
        record(b"not json", 5),
        record(b"x" * 2000, 6),
        record({"a": 1}, 7, topic=UNMATCHED),
        record(b"oops", 8, topic=DEADLETTER, headers=[(c.KAFKA_DEADLETTER_REASON_HEADER, b"not UTF-8")]),
        record(
            {"ts": NOW_MS},
            9,
            headers=bridge_headers(
                payload=json.dumps({"ts": NOW_MS - 25, "temp_c": 21.5, "ok": True, "seq": 7}).encode()
            ),
        ),  # a copy of offset 1's id
    ]

    def outcome(records_in_batch: int):
        interpreted_for(spark, records_in_batch)
        parsed = tr.parse(decode(spark, records))
        raw = tr.accepted_rows(parsed)
        plan = raw._jdf.queryExecution().executedPlan().toString()
        rows = sorted(raw.collect(), key=lambda r: r["kafka_offset"])
        rejects = sorted(tr.reject_rows(parsed).collect(), key=lambda r: r["kafka_offset"])
        return plan, rows, rejects, summarize_batch(parsed, lookback_days=2)

    try:
        generated = outcome(INTERPRETED_BELOW_RECORDS)
        interpreted = outcome(INTERPRETED_BELOW_RECORDS - 1)
    finally:
        interpreted_for(spark, INTERPRETED_BELOW_RECORDS)  # the session's defaults again
    assert "*(" in generated[0] and "*(" not in interpreted[0]  # whole-stage code, then none
    assert [r["kafka_offset"] for r in generated[1]] == [1, 2, 3, 4, 5, 9]
    assert [r["kafka_offset"] for r in generated[2]] == [6, 7, 8]
    assert interpreted[1:] == generated[1:]
    assert interpreted[3].raw_copies is True
