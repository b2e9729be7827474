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
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from backend import contract as c
from backend.polling import wait_until
from fedgate.devices import publish_properties
from tests.helpers import device, operator_client, produce_bridge_records

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.usefixtures("spark_job"),
]


@pytest.fixture(scope="module")
def spark(federation):
    from spark.query import session

    # a Spark of the tests' own, as a notebook's: reading the tables beside the job
    with session(federation.spark_settings(), remote=False) as s:
        yield s


#: How long a test waits for the job to answer a count (`fedgate count-now`).  A count is
#: wall time on a machine the whole suite shares: the first in a freshly started job (a cold
#: JVM, the batches its predecessor left to count read back from telemetry_raw) took 28-61 s
#: in suite runs here, and CI's machines take up to several times as long.
COUNT_ANSWER_TIMEOUT_S = 240.0


def counted_now(federation) -> int:
    """Ask the job to count what it landed (count_aggregates_now); the last batch counted.
    Without an answer, fail with what the job was doing: its report and its log's end."""
    through = federation.count_aggregates_now(timeout=COUNT_ANSWER_TIMEOUT_S)
    if through is None:
        job = federation.node("spark")
        log = job.stdout_log.read_text(errors="replace").splitlines()[-40:] if job.stdout_log.exists() else []
        pytest.fail(
            f"the job did not answer a count in {COUNT_ANSWER_TIMEOUT_S:g} s; it reported "
            f"{json.dumps(job.progress(), default=str)[:2000]}; the end of {job.stdout_log}:\n"
            + "\n".join(log)
        )
    return through


def query(spark, federation, sql: str) -> list:
    return spark.sql(sql).collect()


def wait_rows(
    spark, federation, sql: str, expect: int, timeout: float = 120.0, *, count_first: bool = False
) -> int:
    """Poll a count(*) query until it reaches `expect`; return the last count.  With
    `count_first`, each look asks the job to count what it landed in the aggregates first."""
    n = -1

    def look() -> int:
        if count_first:
            counted_now(federation)
        return int(query(spark, federation, sql)[0][0])

    def reached() -> bool:
        nonlocal n
        n = look()
        return n >= expect

    if wait_until(reached, timeout, 2):
        # a little longer: a duplicate would land in a later micro-batch
        time.sleep(3)
        return look()
    return n


def ms(t: dt.datetime) -> int:
    return int(t.timestamp() * 1000)


def wait_counted(spark, federation, device: str, expect: int, timeout: float = 120.0) -> int:
    """Until device_minute counts `expect` of `device`'s messages; the count.  The job counts
    every aggregate_interval_s (a minute); each look asks it to count now (`fedgate count-now`),
    as an analyst who wants the minutes of what just landed does."""
    sql = f"SELECT coalesce(sum(count), 0) FROM device_minute WHERE device = '{device}' AND field = '*'"
    return wait_rows(spark, federation, sql, expect, timeout, count_first=True)


def wait_aggregates(spark, federation, where: str, timeout: float = 90.0) -> None:
    """Until the aggregates count the telemetry_raw rows `where`: the job, asked to count now,
    answers that it counts the batch that landed them (and the aggregates' own mark says so)."""
    from spark.tables import Catalog

    ((landed,),) = query(spark, federation, f"SELECT max(ingest_batch) FROM telemetry_raw WHERE {where}")
    catalog = Catalog(spark, federation.spark_settings())

    def counted() -> bool:
        through = counted_now(federation)
        return through >= landed and catalog.refreshed_through() >= landed

    assert wait_until(counted, timeout, 1), f"the aggregates did not count batch {landed} in {timeout:g} s"


def counts_per_minute(spark, federation, where: str) -> tuple[dict, dict]:
    """(telemetry_raw's rows, device_minute's counts) per device and minute, `where` they are."""
    raw = query(
        spark,
        federation,
        "SELECT device, date_trunc('minute', event_time) AS m, count(*) FROM telemetry_raw "
        f"WHERE {where} GROUP BY 1, 2",
    )
    agg = query(
        spark, federation, f"SELECT device, minute, count FROM device_minute WHERE {where} AND field = '*'"
    )
    return {(r[0], r[1]): r[2] for r in raw}, {(r[0], r[1]): r[2] for r in agg}


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

    wait_aggregates(spark, federation, f"device IN ('{devices}')")
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


def test_fedgate_query_is_answered_by_the_jobs_own_session(federation, spark, uid):
    """`fedgate query` with the job running: the job's Spark session answers over Spark
    Connect (no Spark start in the CLI), and what it answers is what the tables hold."""
    import os
    import subprocess
    import sys

    sql = "SELECT count(*) AS n FROM telemetry_raw"
    env = {**os.environ, "FEDGATE_STATE_DIR": str(federation.state_dir)}
    t0 = time.monotonic()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "fedgate"), "query", sql, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    print(f"fedgate query through the job's session: {took:.1f} s, exit {done.returncode}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "answered by the Spark job's session" in done.stderr
    (answer,) = json.loads(done.stdout)
    (now,) = query(spark, federation, sql)
    assert 0 < answer["n"] <= now[0], "the job's session reads the same tables"


def test_fedgate_count_now_counts_what_landed_without_waiting_for_the_minute(
    federation, endpoints, spark, uid
):
    """The job counts its batches in the aggregates every aggregate_interval_s (a minute);
    `fedgate count-now` asks it to count now (SIGUSR1).  Tried: 30 readings land, then the
    command: it ends once the job answered, naming the last batch counted, and device_minute
    counts all 30 at that moment, without another look."""
    from tests.helpers import run_fedgate

    dev = f"count-now-{uid}"
    now = ms(dt.datetime.now(dt.UTC))
    produce_bridge_records(
        endpoints["kafka"]["bootstrap"],
        [(dev, json.dumps({"ts": now + i, "seq": i}).encode()) for i in range(30)],
    )
    sql = f"SELECT count(*), max(ingest_batch) FROM telemetry_raw WHERE device = '{dev}'"
    assert wait_until(lambda: query(spark, federation, sql)[0][0] == 30, 60, 1), "30 rows in telemetry_raw"
    ((_, landed),) = query(spark, federation, sql)
    done = run_fedgate(
        federation.state_dir,
        federation.settings.port_base,
        "count-now",
        "--timeout",
        f"{COUNT_ANSWER_TIMEOUT_S:g}",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    through = int(re.search(r"through (\d+)", done.stdout).group(1))  # type: ignore[union-attr]
    assert through >= landed, f"the batch that landed the readings ({landed}) is counted: {done.stdout}"
    ((counted,),) = query(
        spark,
        federation,
        f"SELECT coalesce(sum(count), 0) FROM device_minute WHERE device = '{dev}' AND field = '*'",
    )
    assert counted == 30, f"device_minute counts the 30 readings once count-now returned: {counted}"


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
    wait_aggregates(spark, federation, f"device = '{dev}'")
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
    """SIGKILL (no chance to finish a batch, or between two tables' commits) while records
    stream in; restart; count the rows and the aggregates' counts."""
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

    counted = wait_counted(spark, federation, dev, 3000)
    assert counted == 3000, f"device_minute counts each reading once: {counted}"


def test_a_job_killed_between_landing_readings_and_counting_them_counts_them_once_at_restart(
    federation, endpoints, spark, uid
):
    """Tried: readings land in telemetry_raw; the job is SIGKILLed before its next refresh of
    the aggregates (between the two tables' commits) and started again, with no new record
    after it.  The batches the aggregates had not counted are counted at the restart, once:
    found by the mark the aggregates keep (`refreshed_through`) and telemetry_raw's
    `ingest_batch`, not by the next batch's traffic."""
    from spark.tables import Catalog

    bootstrap = endpoints["kafka"]["bootstrap"]
    node = federation.node("spark")
    catalog = Catalog(spark, federation.spark_settings())
    reading = lambda i: json.dumps({"ts": ms(dt.datetime.now(dt.UTC)) + i, "seq": i}).encode()  # noqa: E731
    for attempt in range(3):
        dev = f"uncounted-{uid}-{attempt}"
        # right after a count, the next is aggregate_interval_s (a minute) away: the window
        counted_now(federation)
        deadline = time.monotonic() + 60
        produce_bridge_records(bootstrap, [(dev, reading(i)) for i in range(40)])
        landed = None
        while landed is None:
            assert time.monotonic() < deadline + 60, "the readings did not land in 60 s"
            ((n, batch),) = query(
                spark,
                federation,
                f"SELECT count(*), max(ingest_batch) FROM telemetry_raw WHERE device = '{dev}'",
            )
            landed = batch if n == 40 else None
            time.sleep(0.2)
        node.kill()
        if catalog.refreshed_through() < landed:  # the kill came before the refresh: the fault tried
            break
        federation.start_node("spark")  # a refresh came first: try again
    else:
        pytest.fail("three times the job had counted the readings before the kill")
    federation.start_node("spark")
    # the mark first: a refresh the kill cut short (after its rewrite, before its mark) may
    # already count the readings, and the restart's refresh must count them again, not twice
    wait_aggregates(spark, federation, f"device = '{dev}'", timeout=90)
    counted = wait_counted(spark, federation, dev, 40, timeout=30)
    print(
        f"killed after batch {landed} landed, before its refresh: {counted} of 40 counted after the restart"
    )
    assert counted == 40, f"the readings landed before the kill are counted once at the restart: {counted}"


def test_a_device_10_minutes_fast_leaves_every_other_devices_aggregates_intact(
    federation, endpoints, spark, uid
):
    """Tried: a device whose clock runs 10 minutes fast sends a reading, then another device
    sends 20 readings on time.  With a watermark on event time (the job before this one), the
    fast reading moved it 10 minutes ahead and the 20 fell behind it: rows of telemetry_raw,
    missing from every closed minute.  Now the fast reading's time is clamped to Kafka's (its
    own kept in device_ts, the flaw named), and the 20 are counted in their minutes."""
    fast, on_time = f"fast-{uid}", f"ontime-{uid}"
    bootstrap = endpoints["kafka"]["bootstrap"]
    ten_minutes_ahead = ms(dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10))
    produce_bridge_records(bootstrap, [(fast, json.dumps({"ts": ten_minutes_ahead, "v": 1}).encode())])
    assert wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE device = '{fast}'", 1) == 1

    now = ms(dt.datetime.now(dt.UTC))
    produce_bridge_records(
        bootstrap, [(on_time, json.dumps({"ts": now - 10 * i, "seq": i}).encode()) for i in range(20)]
    )
    counted = wait_counted(spark, federation, on_time, 20)
    raw, agg = counts_per_minute(spark, federation, f"device IN ('{fast}', '{on_time}')")
    (row,) = query(spark, federation, f"SELECT * FROM telemetry_raw WHERE device = '{fast}'")
    print(
        f"fast device: device_ts={row['device_ts']} event_time={row['event_time']} "
        f"kafka_ts={row['kafka_ts']}; on-time device counted {counted} of 20"
    )
    assert counted == 20, f"the on-time device's 20 readings in device_minute: {counted}"
    assert agg == raw, "each device's minutes count its rows of telemetry_raw, the fast one's included"
    assert row["device_ts"] == dt.datetime.fromtimestamp(ten_minutes_ahead / 1000, dt.UTC).replace(
        tzinfo=None
    )
    assert row["event_time"] == row["kafka_ts"], "clamped to Kafka time"
    assert re.fullmatch(
        r"device clock (59\d|60\d)\.\d s ahead of Kafka time; event time clamped to it", row["parse_error"]
    )
    assert row["latency_ms"] is None


def test_a_backlog_of_hours_read_unevenly_loses_no_row(federation, endpoints, spark, uid):
    """Tried: one partition's readings of the present land first; then another partition
    delivers the backlog of a site that was offline for four hours -- 3 devices, a reading a
    minute each.  A job keeping a watermark on event time (the one before this) dropped the
    whole backlog from the aggregates.  Every reading is a row, counted in its minute of
    device_minute and region_minute."""
    bootstrap = endpoints["kafka"]["bootstrap"]
    region = f"site-{uid}"
    now = dt.datetime.now(dt.UTC)
    present = [(f"now-{uid}", json.dumps({"ts": ms(now), "seq": 0}).encode())]
    produce_bridge_records(bootstrap, present, region=region, partition=0)
    assert wait_counted(spark, federation, f"now-{uid}", 1) == 1
    backlog = [
        (f"offline-{uid}-{d}", json.dumps({"ts": ms(now - dt.timedelta(minutes=m)), "seq": m}).encode())
        for m in range(240, 0, -1)
        for d in range(3)
    ]
    produce_bridge_records(bootstrap, backlog, region=region, partition=1)
    devices = f"device LIKE 'offline-{uid}-%'"
    n = wait_rows(spark, federation, f"SELECT count(*) FROM telemetry_raw WHERE {devices}", 720)
    assert n == 720, f"720 readings of 4 hours: {n} rows"
    region_sql = f"SELECT sum(messages) FROM region_minute WHERE region = '{region}'"
    raw, agg, messages = {}, {}, [None]

    def counted() -> bool:
        nonlocal raw, agg, messages
        counted_now(federation)
        raw, agg = counts_per_minute(spark, federation, devices)
        (messages,) = query(spark, federation, region_sql)  # committed after device_minute
        return raw == agg and messages[0] == 721

    wait_until(counted, 90, 2)
    print(f"backlog: {n} rows, {sum(agg.values())} counted in device_minute, {messages[0]} in region_minute")
    assert len(raw) == 720 and set(raw.values()) == {1}, "a row per device and minute"
    assert agg == raw, "device_minute counts every reading of the backlog in its minute"
    assert messages[0] == 721, "region_minute counts the backlog and the present reading"


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
