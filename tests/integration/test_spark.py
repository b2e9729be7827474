"""The Spark job against the real federation: MQTT devices -> Kafka -> tables.

The session federation runs the job (node `spark`); these tests read its
warehouse with a second SparkSession, as an analyst's `fedgate query` does.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from backend import contract as c
from fedgate.devices import publish_properties
from spark.tables import register_views
from tests.helpers import device, operator_client

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark(federation):
    from spark.query import session

    with session(federation.spark_settings()) as s:
        yield s


def query(spark, federation, sql: str) -> list:
    register_views(spark, federation.spark_settings())  # sees rows landed since
    return spark.sql(sql).collect()


def wait_rows(spark, federation, sql: str, expect: int, timeout: float = 120.0) -> int:
    """Poll a count(*) query until it reaches `expect`; return the last count."""
    deadline = time.monotonic() + timeout
    n = -1
    while time.monotonic() < deadline:
        n = query(spark, federation, sql)[0][0]
        if n >= expect:
            # a little longer: a duplicate would land in a later micro-batch
            time.sleep(3)
            return int(query(spark, federation, sql)[0][0])
        time.sleep(2)
    return int(n)


def ms(t: dt.datetime) -> int:
    return int(t.timestamp() * 1000)


def wait_closed_minutes(
    spark, federation, bootstrap: str, device: str, expect: int, *, clock: str, timeout: float = 150
) -> dict[bool, int]:
    """Until `device`'s readings in closed minutes of device_minute reach `expect`: its
    message counts by `final`.  Every 3 s a fresh reading of the device `clock` moves the
    aggregates' watermark, as live traffic would."""
    deadline = time.monotonic() + timeout
    while True:
        produce_bridge_records(bootstrap, [(clock, json.dumps({"ts": ms(dt.datetime.now(dt.UTC))}).encode())])
        rows = query(
            spark,
            federation,
            f"SELECT final, sum(count) FROM device_minute WHERE device = '{device}' AND field = '*' "
            "GROUP BY final",
        )
        counts = {r[0]: r[1] for r in rows}
        if counts.get(True) == expect or time.monotonic() > deadline:
            return counts
        time.sleep(3)


def produce_bridge_records(
    bootstrap: str, records: list[tuple[str, bytes]], *, with_id: bool = True, timestamp_ms: int = 0
) -> None:
    """Records as the bridge writes them: (device, payload) into telemetry.telemetry; a
    `timestamp_ms` counts only on a topic that keeps producers' times (producer_timestamps)."""
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for dev, payload in records:
        topic = c.device_telemetry_topic(dev)
        headers = [
            (c.KAFKA_REGION_HEADER, b"local-eu"),
            (c.KAFKA_MQTT_TOPIC_HEADER, topic.encode()),
            (c.KAFKA_DEVICE_HEADER, dev.encode()),
            (c.KAFKA_RECEIVED_AT_HEADER, str(int(time.time() * 1000)).encode()),
        ]
        if with_id:
            headers.append((c.KAFKA_MESSAGE_ID_HEADER, c.message_id(topic, payload).encode()))
        p.produce("telemetry.telemetry", payload, dev.encode(), headers=headers, timestamp=timestamp_ms)
        p.poll(0)
    assert p.flush(30) == 0, "Kafka did not confirm every record"


def test_device_readings_become_raw_rows_and_aggregates(federation, endpoints, spark, uid):
    """local-eu's device speaks MQTT 5 and tags its readings with user properties,
    local-us's speaks MQTT 3.1.1: both become rows, each with what it sent."""
    sent: dict[str, list[float]] = {}
    started = time.time()
    tags = {"unit": "celsius", "fw": "2.1.0"}
    for region in ("local-eu", "local-us"):
        dev_id = f"spark-{region}-{uid}"
        five = region == "local-eu"
        d = device(endpoints, region, dev_id, mqtt5=five)
        try:
            for i in range(10):
                temp = 20.0 + i
                d.publish(
                    c.device_telemetry_topic(dev_id),
                    {"ts": ms(dt.datetime.now(dt.UTC)), "temp_c": temp, "i": i},
                    properties=publish_properties(user=tags) if five else None,
                )
                sent.setdefault(dev_id, []).append(temp)
        finally:
            d.close()
    devices = "', '".join(sent)
    n = wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device IN ('{devices}')", 20)
    assert n == 20, f"20 readings sent by MQTT, {n} rows in telemetry_raw"

    rows = query(spark, federation, f"SELECT * FROM telemetry_raw WHERE device IN ('{devices}')")
    for r in rows:
        region = "local-eu" if "local-eu" in r["device"] else "local-us"
        assert r["region"] == region, "each row carries the region of the gateway the device used"
        assert r["mqtt_topic"] == c.device_telemetry_topic(r["device"])
        assert r["kafka_topic"] == "telemetry.telemetry" and r["kafka_offset"] >= 0
        assert r["parse_error"] is None
        # device -> Kafka from the device's own timestamp: it cannot exceed the time since the send
        assert 0 <= r["latency_ms"] <= (time.time() - started) * 1000
        assert r["ingest_batch"] is not None
        assert r["user_properties"] == (tags if region == "local-eu" else {}), "MQTT 5 user properties"
    assert len({r["message_id"] for r in rows}) == 20

    per_device = query(
        spark,
        federation,
        f"""SELECT device, field, sum(count) AS n, min(min) AS lo, max(max) AS hi,
                   sum(avg * count) / sum(count) AS mean
            FROM device_minute WHERE device IN ('{devices}') GROUP BY device, field""",
    )
    stats = {(r["device"], r["field"]): r for r in per_device}
    for dev_id, temps in sent.items():
        assert stats[(dev_id, "*")]["n"] == 10, "device_minute counts every message once"
        t = stats[(dev_id, "temp_c")]
        assert (t["n"], t["lo"], t["hi"]) == (10, min(temps), max(temps))
        assert t["mean"] == pytest.approx(sum(temps) / len(temps))

    since = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)).strftime("%Y-%m-%d %H:%M:%S")
    regions = query(
        spark,
        federation,
        f"""SELECT region, sum(messages) AS messages, max(latency_p99_ms) AS p99 FROM region_minute
            WHERE minute >= '{since}' GROUP BY region""",
    )
    by_region = {r["region"]: r for r in regions}
    for region in ("local-eu", "local-us"):
        assert by_region[region]["messages"] >= 10
        assert by_region[region]["p99"] is not None


def test_duplicates_injected_into_kafka_appear_once(federation, endpoints, spark, uid):
    dev = f"dup-{uid}"
    now = ms(dt.datetime.now(dt.UTC))
    payloads = [json.dumps({"ts": now + i, "seq": i, "v": i}).encode() for i in range(50)]
    bootstrap = endpoints["kafka"]["bootstrap"]
    # what a router crash does: the same records produced again, later
    produce_bridge_records(bootstrap, [(dev, p) for p in payloads])
    produce_bridge_records(bootstrap, [(dev, p) for p in payloads[:30]])
    time.sleep(3)  # the copies in another micro-batch than the first ones
    produce_bridge_records(bootstrap, [(dev, p) for p in payloads[10:40]])
    # and copies without the identity header (an older bridge): the same identity is derived
    produce_bridge_records(bootstrap, [(dev, p) for p in payloads[:5]], with_id=False)

    n = wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device = '{dev}'", 50)
    assert n == 50, f"115 records of 50 messages produced; telemetry_raw has {n} rows"
    seqs = Counter(
        r[0]
        for r in query(spark, federation, f"SELECT fields['seq'] FROM telemetry_raw WHERE device = '{dev}'")
    )
    assert set(seqs) == {str(i) for i in range(50)} and set(seqs.values()) == {1}
    (total,) = query(
        spark, federation, f"SELECT sum(count) FROM device_minute WHERE device = '{dev}' AND field = '*'"
    )
    assert total[0] == 50, "the aggregates count each message once"


def test_bad_input_lands_with_reasons_and_the_job_keeps_running(federation, endpoints, spark, uid):
    dev_id = f"bad-{uid}"
    d = device(endpoints, "local-eu", dev_id)
    try:
        d.publish(c.device_telemetry_topic(dev_id), b'{"temp_c": ')  # invalid JSON
        d.publish(c.device_telemetry_topic(dev_id), b"[1, 2]")  # not an object
        d.publish(c.device_telemetry_topic(dev_id), {"temp_c": 1})  # no timestamp
        d.publish(c.device_telemetry_topic(dev_id), {"ts": "soon", "temp_c": "hot"})  # wrong types
        d.publish(c.device_telemetry_topic(dev_id), b"\xff\xfe not utf-8")  # dead-lettered by the bridge
    finally:
        d.close()
    with operator_client(endpoints, "local-eu", f"op-{uid}") as op:  # devices may only use devices/<id>/
        op.publish(f"elsewhere/{uid}/x", b"unmapped")  # no mapping rule: fedgate.unmatched
    p = Producer({"bootstrap.servers": endpoints["kafka"]["bootstrap"]})
    p.produce("telemetry.telemetry", f"headerless-{uid}".encode())  # not from the bridge
    assert p.flush(10) == 0

    n = wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device = '{dev_id}'", 4)
    assert n == 4, "every decodable payload is a row, however broken"
    errors = sorted(
        r[0]
        for r in query(spark, federation, f"SELECT parse_error FROM telemetry_raw WHERE device = '{dev_id}'")
    )
    assert errors[0].startswith("device timestamp (field ts) is neither epoch nor ISO 8601")
    assert errors[1].startswith("no device timestamp")
    assert errors[2:] == ["payload is not a JSON object", "payload is not valid JSON"]

    wait_rows(
        spark,
        federation,
        f"SELECT count(*) FROM rejects WHERE mqtt_topic LIKE '%{uid}%' OR payload_preview LIKE '%{uid}%'",
        3,
    )
    reasons = [
        r[0]
        for r in query(
            spark,
            federation,
            f"SELECT reason FROM rejects WHERE mqtt_topic LIKE '%{uid}%' OR payload_preview LIKE '%{uid}%'",
        )
    ]
    assert f"no mapping rule for MQTT topic elsewhere/{uid}/x" in reasons
    assert any(r.startswith("dead-lettered by the bridge: payload is not valid UTF-8") for r in reasons)
    assert "record without fedgate headers (not produced by the bridge)" in reasons
    assert federation.node("spark").ready(), "bad input never stops the job"


def test_job_killed_mid_stream_and_restarted_leaves_complete_tables_without_duplicates(
    federation, endpoints, spark, uid
):
    """SIGKILL (no chance to finish a batch) while records stream in; restart; count.

    Then readings of a clock device move the watermark (5 s in the tests'
    federation) past the readings' minute, so it closes and lands in the
    device_minute table itself (final = true), not only in the live view.
    """
    dev = f"kill-{uid}"
    bootstrap = endpoints["kafka"]["bootstrap"]
    start = ms(dt.datetime.now(dt.UTC))
    payloads = [json.dumps({"ts": start + i, "seq": i, "v": 1}).encode() for i in range(3000)]
    node = federation.node("spark")
    produce_bridge_records(bootstrap, [(dev, p) for p in payloads[:1000]])
    time.sleep(2.5)  # mid-batch, most likely
    # SIGKILL every process of the job at once (its JVM may exit by itself as its Python dies)
    node.kill()
    produce_bridge_records(bootstrap, [(dev, p) for p in payloads[1000:]])
    produce_bridge_records(bootstrap, [(dev, p) for p in payloads[500:1500]])  # and redelivered copies
    federation.start_node("spark")

    n = wait_rows(
        spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device = '{dev}'", 3000, timeout=180
    )
    assert n == 3000, f"4000 records of 3000 readings, job killed once: {n} rows in telemetry_raw"
    (distinct,) = query(
        spark, federation, f"SELECT count(DISTINCT fields['seq']) FROM telemetry_raw WHERE device = '{dev}'"
    )
    assert distinct[0] == 3000

    counts = wait_closed_minutes(spark, federation, bootstrap, dev, 3000, clock=f"clock-{uid}")
    assert counts == {True: 3000}, (
        f"closed minutes in the device_minute table count each reading once: {counts}"
    )


def test_a_device_10_minutes_fast_leaves_every_other_devices_aggregates_intact(
    federation, endpoints, spark, uid
):
    """Tried: a device whose clock runs 10 minutes fast sends a reading; once the aggregate
    queries have run over it, another device sends 20 readings on time, and a clock device's
    fresh readings move the watermark on.  Unclamped, the fast reading had moved the
    aggregates' watermark 10 minutes ahead, and the 20 fell behind it: rows in telemetry_raw,
    missing from every closed minute.  Clamped to Kafka time, the fast reading keeps its own
    time in device_ts with the flaw named, and the 20 are counted in their closed minutes."""
    fast, on_time = f"fast-{uid}", f"ontime-{uid}"
    bootstrap = endpoints["kafka"]["bootstrap"]
    ten_minutes_ahead = ms(dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10))
    produce_bridge_records(bootstrap, [(fast, json.dumps({"ts": ten_minutes_ahead, "v": 1}).encode())])
    assert wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device = '{fast}'", 1) == 1
    time.sleep(2 * federation.spark_settings().aggregate_trigger_s + 2)  # the aggregates saw it

    now = ms(dt.datetime.now(dt.UTC))
    produce_bridge_records(
        bootstrap, [(on_time, json.dumps({"ts": now - 10 * i, "seq": i}).encode()) for i in range(20)]
    )
    counts = wait_closed_minutes(spark, federation, bootstrap, on_time, 20, clock=f"clock-{uid}")
    (row,) = query(spark, federation, f"SELECT * FROM telemetry_raw WHERE device = '{fast}'")
    print(
        f"fast device: device_ts={row['device_ts']} event_time={row['event_time']} kafka_ts={row['kafka_ts']}"
    )
    assert counts == {True: 20}, f"the on-time device's 20 readings in its closed minutes: {counts}"
    assert row["device_ts"] == dt.datetime.fromtimestamp(ten_minutes_ahead / 1000, dt.UTC).replace(
        tzinfo=None
    )
    assert row["event_time"] == row["kafka_ts"], "clamped to Kafka time"
    assert re.fullmatch(
        r"device clock (59\d|60\d)\.\d s ahead of Kafka time; event time clamped to it", row["parse_error"]
    )
    assert row["latency_ms"] is None


def test_readings_behind_the_watermark_are_in_telemetry_raw_and_counted_as_left_out_of_the_aggregates(
    federation, endpoints, spark, uid
):
    """Tried: with the watermark at the present (a clock device's fresh reading, the aggregate
    queries run over it), a device sends 5 readings stamped 3 minutes ago -- a device back
    from a dead zone with what it buffered.  Their minutes have closed: the aggregates cannot
    take them, and must not lose them silently.  They are rows of telemetry_raw, and the job's
    progress (what `fedgate status` shows) counts them as left out of both aggregates."""
    late = f"late-{uid}"
    bootstrap = endpoints["kafka"]["bootstrap"]
    node = federation.node("spark")
    trigger_s = federation.spark_settings().aggregate_trigger_s

    def left_out() -> dict[str, int]:
        queries = node.progress().get("queries", {})
        return {q: queries.get(q, {}).get("late_rows_dropped", 0) for q in ("device_minute", "region_minute")}

    produce_bridge_records(
        bootstrap, [(f"clock-{uid}", json.dumps({"ts": ms(dt.datetime.now(dt.UTC))}).encode())]
    )
    time.sleep(2 * trigger_s + 2)  # the aggregates' watermark is at the present
    before = left_out()
    three_minutes_ago = ms(dt.datetime.now(dt.UTC) - dt.timedelta(minutes=3))
    produce_bridge_records(
        bootstrap, [(late, json.dumps({"ts": three_minutes_ago + i, "seq": i}).encode()) for i in range(5)]
    )
    n = wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device = '{late}'", 5)
    assert n == 5, f"every late reading is a row of telemetry_raw: {n}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = left_out()
        if all(after[q] - before[q] >= 5 for q in after):
            break
        time.sleep(2)
    print(f"left out of the aggregates before {before}, after {after}")
    assert all(after[q] - before[q] >= 5 for q in after), f"the 5 late readings counted: {before} -> {after}"
    (closed,) = query(
        spark, federation, f"SELECT count(*) FROM device_minute WHERE device = '{late}' AND final"
    )
    assert closed[0] == 0, "a closed minute is never changed by a late reading"


@contextmanager
def producer_timestamps(bootstrap: str, topic: str) -> Iterator[None]:
    """Inside, `topic` keeps the producer's timestamps (CreateTime) instead of the brokers'
    append time: the one way a test can stamp a record 30 minutes after another."""
    admin = AdminClient({"bootstrap.servers": bootstrap})

    def alter(op: AlterConfigOpType) -> None:
        entry = ConfigEntry("message.timestamp.type", "CreateTime", incremental_operation=op)
        resource = ConfigResource("topic", topic, incremental_configs=[entry])
        admin.incremental_alter_configs([resource])[resource].result(timeout=30)

    alter(AlterConfigOpType.SET)
    try:
        yield
    finally:
        alter(AlterConfigOpType.DELETE)  # back to the brokers' LogAppendTime


def test_a_copy_produced_30_minutes_after_its_original_is_still_one_row(federation, endpoints, spark, uid):
    """A gateway back after 30 minutes resends what it had not passed on, after newer
    readings have moved Kafka time on by 30 minutes.  A dedupe that remembers message ids
    for a window of Kafka time (the job's before Iceberg: 10 minutes) has forgotten the
    original by then and keeps the copy as a second row."""
    bootstrap = endpoints["kafka"]["bootstrap"]
    dev, clock = f"late-copy-{uid}", f"late-clock-{uid}"
    sent_ms = ms(dt.datetime.now(dt.UTC))
    later_ms = sent_ms + 30 * 60_000
    original = json.dumps({"ts": sent_ms, "seq": 1}).encode()
    count = "SELECT count(*) FROM telemetry_raw WHERE device = '{}'"
    with producer_timestamps(bootstrap, "telemetry.telemetry"):
        produce_bridge_records(bootstrap, [(dev, original)], timestamp_ms=sent_ms)
        assert wait_rows(spark, federation, count.format(dev), 1) == 1, "the original never landed"
        # newer traffic: Kafka time 30 minutes on
        tick = json.dumps({"ts": sent_ms, "seq": 1}).encode()
        produce_bridge_records(bootstrap, [(clock, tick)], timestamp_ms=later_ms)
        assert wait_rows(spark, federation, count.format(clock), 1) == 1
        # the copy, and a reading behind it that says when the copy's batch has landed
        behind = json.dumps({"ts": sent_ms, "seq": 2}).encode()
        produce_bridge_records(bootstrap, [(dev, original), (clock, behind)], timestamp_ms=later_ms)
        assert wait_rows(spark, federation, count.format(clock), 2) == 2
    rows = query(spark, federation, f"SELECT unix_millis(kafka_ts) FROM telemetry_raw WHERE device = '{dev}'")
    print(
        f"original and its copy 30 minutes later (Kafka time): rows={len(rows)}, lost={1 - min(len(rows), 1)}"
    )
    assert len(rows) == 1, f"a copy produced 30 minutes after its original: {len(rows)} rows"
    assert rows[0][0] == sent_ms, "the row is the original's, not the copy's"
