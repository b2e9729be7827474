"""The Iceberg tables: exactly once by key however late a copy comes, a late reading
counted in its minute, compaction, the recompute's date overwrite, and the catalog that
names them (Spark SQL and, without Spark, pyiceberg)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import json

import pytest
from pyspark.sql import functions as F

from spark import tables
from spark import transforms as tr
from spark.tables import (
    DEVICE_MINUTE,
    RAW,
    REGION_MINUTE,
    REJECTS,
    TABLES,
    Catalog,
    TimeSpan,
    coarsen,
    copy_window,
    schemas,
    summarize_batch,
    unit_spans,
)
from tests.unit.spark.test_transforms import NOW, NOW_MS, UNMATCHED, bridge_headers, decode, record

pytestmark = pytest.mark.spark

DAY1, DAY2 = dt.date(2026, 11, 21), dt.date(2026, 11, 22)
_namespaces = itertools.count()


@pytest.fixture
def catalog(spark, spark_settings) -> Catalog:
    """A catalog namespace of its own for each test, its tables created."""
    settings = dataclasses.replace(spark_settings, namespace=f"t{next(_namespaces)}")
    cat = Catalog(spark, settings)
    cat.create_tables()
    return cat


def region_rows(spark, rows):
    """region_minute rows: (date, region, messages)."""
    # date, minute, region, messages, devices, latencies; the states: devices' sketch,
    # latency histogram, batches counted
    schema = schemas(spark)[REGION_MINUTE.name]
    full = [
        (d, dt.datetime.combine(d, dt.time(10)), region, n, 1, 2, 3, 4, 5, b"", {}, None)
        for d, region, n in rows
    ]
    return spark.createDataFrame(full, schema)


def messages(catalog):
    return sorted((r["date"], r["region"], r["messages"]) for r in catalog.read(REGION_MINUTE).collect())


def raw_frame(spark, readings):
    """telemetry_raw rows of (payload, offset, Kafka time) readings."""
    return tr.raw_rows(decode(spark, [record(p, offset, ts=ts) for p, offset, ts in readings]))


def raw_batch(spark, readings, lookback_days=2):
    """telemetry_raw rows of readings, and the dates a MERGE looks in."""
    rows = raw_frame(spark, readings)
    return rows, copy_window(RAW, rows, lookback_days)


def land_raw(spark, catalog, readings):
    catalog.land(RAW, raw_frame(spark, readings))


def utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.UTC)


def ms(t: dt.datetime) -> int:
    return int(t.replace(tzinfo=dt.UTC).timestamp() * 1000)


def test_every_table_is_in_the_catalog_by_name(spark, catalog):
    shown = {r["tableName"] for r in spark.sql(f"SHOW TABLES IN {catalog.namespace}").collect()}
    assert shown == {t.name for t in TABLES}
    described = {r["col_name"] for r in spark.sql(f"DESCRIBE TABLE {catalog.name(RAW)}").collect()}
    assert {"message_id", "device", "event_time", "date", "region"} <= described


def test_a_replayed_batch_adds_nothing(spark, catalog):
    batch = region_rows(spark, [(DAY1, "local-eu", 5), (DAY2, "local-us", 7)])
    catalog.land(REGION_MINUTE, batch)
    catalog.land(REGION_MINUTE, batch)
    assert messages(catalog) == [(DAY1, "local-eu", 5), (DAY2, "local-us", 7)], "the replay added rows"


def test_a_copy_produced_a_day_after_its_original_is_still_one_row(spark, catalog):
    sent = NOW - dt.timedelta(seconds=1)
    reading = {"ts": ms(sent), "seq": 1, "temp_c": 20}
    land_raw(spark, catalog, [(reading, 1, NOW)])
    # a gateway back after a day resends it, beside a reading of that day
    later = NOW + dt.timedelta(days=1, minutes=30)
    land_raw(spark, catalog, [(reading, 7, later), ({"ts": ms(later), "seq": 2}, 8, later)])
    rows = catalog.read(RAW).select("message_id", "kafka_offset").collect()
    assert sorted(r["kafka_offset"] for r in rows) == [1, 8], "the day-late copy became a second row"


def test_a_late_copy_of_a_reading_whose_time_came_from_kafka_is_still_one_row(spark, catalog):
    """A clamped fast clock or a missing device time: the copy's event time (its own Kafka
    time) is a later date than the original's; the device time, or for a reading without
    one the lookback, finds the original."""
    fast = {"ts": ms(NOW + dt.timedelta(hours=3)), "seq": 1}
    no_clock = {"seq": 2}
    land_raw(spark, catalog, [(fast, 1, NOW), (no_clock, 2, NOW)])
    later = NOW + dt.timedelta(days=1)
    rows, window = raw_batch(spark, [(fast, 7, later), (no_clock, 8, later)])
    fast_second = utc(NOW.replace(microsecond=0) + dt.timedelta(hours=3))
    assert window == TimeSpan(
        utc(NOW + dt.timedelta(hours=3)),
        utc(later),
        device_times=((fast_second, fast_second + dt.timedelta(seconds=1)),),
        kafka_times=(utc(later - dt.timedelta(days=2)), utc(later)),
    )
    catalog.land(RAW, rows)
    assert sorted(r["kafka_offset"] for r in catalog.read(RAW).collect()) == [1, 2]


def test_copies_are_looked_for_only_among_the_same_device_times(spark):
    """A batch of readings with their device's time looks for copies only in the seconds of
    those times: a lone reading from 2019 adds its second, not the years between."""
    old = dt.datetime(2019, 5, 1, 12, 0, 10)
    _, window = raw_batch(
        spark,
        [({"ts": ms(NOW), "seq": 1}, 1, NOW), ({"ts": ms(old), "seq": 2}, 2, NOW)],
    )
    now_second, old_second = utc(NOW.replace(microsecond=0)), utc(old)
    second = dt.timedelta(seconds=1)
    assert window.device_times == ((old_second, old_second + second), (now_second, now_second + second))
    assert window.kafka_times is None, "no reading without a device time: no lookback"


def test_one_action_tells_the_job_both_tables_copy_windows_and_the_batchs_own_copies(spark):
    """The job's one action per micro-batch (summarize_batch) gives each MERGE the window
    that copy_window would, and says whether the batch repeats a message.  Tried: readings
    with a device time, from 2019, without one, a fast clock, a record of the unmatched topic,
    a redelivered copy right behind its original, and an empty batch."""
    old = dt.datetime(2019, 5, 1, 12, 0, 10)
    later = NOW + dt.timedelta(minutes=3)
    reading = {"ts": ms(NOW), "seq": 1}
    records = [
        record(reading, 1),
        record({"ts": ms(old), "seq": 2}, 2),
        record({"seq": 3}, 3, ts=later),
        record({"ts": ms(NOW + dt.timedelta(hours=1)), "seq": 4}, 4),
        record({"seq": 5}, 5, topic=UNMATCHED, ts=later),
    ]
    decoded = decode(spark, records)
    summary = summarize_batch(tr.parse(decoded), lookback_days=2)
    assert summary.raw == copy_window(RAW, tr.raw_rows(decoded), 2)
    assert summary.rejects == copy_window(REJECTS, tr.reject_rows(decoded), 2)
    assert summary.raw_copies is False, "every message once: no in-batch dedupe needed"
    # what the job's metrics count: records per table, and the oldest record's Kafka time
    assert (summary.raw_records, summary.rejected_records) == (4, 1)
    assert summary.kafka_first_s == pytest.approx(min(r[5] for r in records).timestamp())
    with_copy = decode(spark, [*records, record(reading, 6)])
    again = summarize_batch(tr.parse(with_copy), lookback_days=2)
    assert again.raw_copies is True, "the redelivered copy was not seen"
    assert again.raw == summary.raw, "a copy has its original's times: the window is the same"
    clean = decode(spark, records[:2])
    assert summarize_batch(tr.parse(clean), 2).rejects is None
    # a record carrying another message's id with a payload of its own (another device second,
    # so no per-second group holds both): still a copy, as the MERGE's key says
    borrowed = record(
        {"ts": ms(later), "seq": 9}, 7, headers=bridge_headers(payload=json.dumps(reading).encode())
    )
    assert summarize_batch(tr.parse(decode(spark, [*records, borrowed])), 2).raw_copies is True
    empty = summarize_batch(tr.parse(decode(spark, [])), 2)
    assert empty == tables.BatchSummary(None, None, False, 0, 0, None)


def test_a_device_sending_random_times_makes_a_short_condition():
    assert coarsen([(0, 1), (3, 4), (10, 11), (12, 13)], 2) == [(0, 4), (10, 13)]
    assert coarsen([(0, 1)], 2) == [(0, 1)]


def test_a_late_copy_of_a_fast_clocks_clamped_reading_is_still_one_row(spark, catalog):
    """The original came 10 minutes before its device's (fast) time: clamped to Kafka
    time.  Its copy comes 30 minutes later, after the device's time: not clamped, its event
    time is the device's, 10 minutes after the original's."""
    reading = {"ts": ms(NOW + dt.timedelta(minutes=10)), "seq": 1}
    land_raw(spark, catalog, [(reading, 1, NOW)])
    land_raw(spark, catalog, [(reading, 7, NOW + dt.timedelta(minutes=30))])
    assert [r["kafka_offset"] for r in catalog.read(RAW).collect()] == [1]


def test_replace_dates_replaces_those_dates_and_keeps_the_others(spark, catalog):
    catalog.land(REGION_MINUTE, region_rows(spark, [(DAY1, "local-eu", 5), (DAY2, "local-eu", 7)]))
    catalog.replace_dates(REGION_MINUTE, region_rows(spark, [(DAY2, "local-eu", 9)]), [DAY2])
    assert messages(catalog) == [(DAY1, "local-eu", 5), (DAY2, "local-eu", 9)]


def test_python_without_spark_reads_the_tables_through_the_catalog(spark, spark_settings, catalog):
    from spark.reading import duckdb_with_tables, open_catalog

    land_raw(spark, catalog, [({"ts": ms(NOW), "seq": 1}, 1, NOW), ({"ts": ms(NOW), "seq": 2}, 2, NOW)])
    py = open_catalog(catalog.settings)
    assert (catalog.settings.namespace, RAW.name) in py.list_tables(catalog.settings.namespace)
    frame = py.load_table(f"{catalog.settings.namespace}.{RAW.name}").scan().to_pandas()
    assert sorted(frame["kafka_offset"]) == [1, 2]
    con = duckdb_with_tables(catalog.settings)
    assert con.execute("SELECT count(*), count(DISTINCT message_id) FROM telemetry_raw").fetchall() == [
        (2, 2)
    ]


def test_an_open_session_sees_what_another_writer_commits_after_it_started(spark, catalog):
    """An analyst's session stays open while the job commits: each query sees the latest
    commit (Iceberg's JDBC catalog on SQLite once pinned a session to its first read)."""
    from spark.reading import open_catalog

    land_raw(spark, catalog, [({"ts": ms(NOW), "seq": 1}, 1, NOW)])
    assert spark.table(catalog.name(RAW)).count() == 1
    other = open_catalog(catalog.settings).load_table(f"{catalog.settings.namespace}.{RAW.name}")
    other.append(other.scan().to_arrow())  # another process's commit, as the job's are to a query
    assert spark.table(catalog.name(RAW)).count() == 2, "the open session did not see the new commit"


def land_batch(catalog, rows, batch):
    """What the job does with micro-batch `batch`'s telemetry_raw rows: land them, then count
    them in the aggregates' minutes (the job does that every aggregate_interval_s)."""

    catalog.land(RAW, rows.withColumn("ingest_batch", F.lit(batch).cast("long")))
    catalog.refresh(batch)


def minute_counts(catalog):
    per_device = {
        (r["device"], r["minute"].minute): r["count"]
        for r in catalog.read(DEVICE_MINUTE).where("field = '*'").collect()
    }
    per_region = {
        (r["region"], r["minute"].minute): r["messages"] for r in catalog.read(REGION_MINUTE).collect()
    }
    return per_device, per_region


def device_frame(spark, readings):
    """telemetry_raw rows of (device, payload, offset, Kafka time) readings."""
    return tr.raw_rows(decode(spark, [record(p, o, ts=ts, device=d) for d, p, o, ts in readings]))


def test_a_reading_three_hours_late_is_counted_in_its_minute_once(spark, catalog):
    """Tried: two devices' readings of one minute land; three hours later one device's
    buffered reading of that minute arrives, then the same batch is replayed (a crash after
    its commits).  The late reading is in the minute's counts, once; the other device's
    counts and the next minute are untouched."""
    minute = NOW.replace(second=0, microsecond=0)
    at = [minute + dt.timedelta(seconds=s) for s in (1, 2, 3, 61)]
    m0, m1 = minute.minute, minute.minute + 1
    land_batch(
        catalog,
        device_frame(
            spark,
            [
                ("dev-1", {"ts": ms(at[0]), "seq": 1}, 1, at[0]),
                ("dev-2", {"ts": ms(at[1]), "seq": 2}, 2, at[1]),
                ("dev-1", {"ts": ms(at[3]), "seq": 3}, 3, at[3]),
            ],
        ),
        1,
    )
    assert minute_counts(catalog) == (
        {("dev-1", m0): 1, ("dev-2", m0): 1, ("dev-1", m1): 1},
        {("local-eu", m0): 2, ("local-eu", m1): 1},
    )
    late = device_frame(spark, [("dev-1", {"ts": ms(at[2]), "seq": 4}, 9, at[2] + dt.timedelta(hours=3))])
    land_batch(catalog, late, 2)
    land_batch(catalog, late, 2)  # replayed
    assert minute_counts(catalog) == (
        {("dev-1", m0): 2, ("dev-2", m0): 1, ("dev-1", m1): 1},
        {("local-eu", m0): 3, ("local-eu", m1): 1},
    )
    assert catalog.read(RAW).count() == 4


def test_seconds_or_minutes_become_the_fewest_runs():
    assert unit_spans([5, 3, 4, 9, 9, 11, 10]) == [(3, 6), (9, 12)]
    assert unit_spans([]) == []


def test_compaction_rewrites_small_files_into_one_and_keeps_every_row(spark, catalog, monkeypatch):
    for seq in range(4):  # four micro-batches: four small files, four snapshots
        land_raw(spark, catalog, [({"ts": ms(NOW), "seq": seq}, seq, NOW)])
    name = catalog.name(RAW)
    assert spark.sql(f"SELECT count(*) FROM {name}.files").first()[0] == 4
    done = catalog.compact(RAW, NOW.date(), dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))
    assert (done["files_rewritten"], done["files_added"]) == (4, 1)
    assert done["rewrite_ms"] > 0 and done["expire_ms"] > 0  # where its time went, for progress.json
    assert spark.sql(f"SELECT count(*) FROM {name}.files").first()[0] == 1
    assert sorted(r["kafka_offset"] for r in catalog.read(RAW).collect()) == [0, 1, 2, 3]
    assert spark.sql(f"SELECT count(*) FROM {name}.snapshots").first()[0] == 5, "the latest 5 are kept"

    # two more micro-batches, then a compaction of their files only (spark.job, between two
    # of every file) and between two expiries (a sixth of the time-travel window apart)
    for seq in range(4, 6):
        land_raw(spark, catalog, [({"ts": ms(NOW), "seq": seq}, seq, NOW)])
    sizes = sorted(r[0] for r in spark.sql(f"SELECT file_size_in_bytes FROM {name}.files").collect())
    assert sizes[-1] > sizes[-2], "the compacted file is the largest"
    monkeypatch.setattr(tables, "SMALL_FILE_BYTES", sizes[-1])  # below it: the batches' own
    done = catalog.compact(RAW, NOW.date(), None, small_files_only=True)
    assert (done["files_rewritten"], done["snapshots_expired"], done["expire_ms"]) == (2, 0, 0)
    assert spark.sql(f"SELECT count(*) FROM {name}.files").first()[0] == 2
    assert spark.sql(f"SELECT count(*) FROM {name}.snapshots").first()[0] == 8, "none expired"
    done = catalog.compact(RAW, NOW.date(), None)  # every file below the target size
    assert (done["files_rewritten"], done["files_added"]) == (2, 1)
    assert sorted(r["kafka_offset"] for r in catalog.read(RAW).collect()) == list(range(6))


def test_which_batches_the_aggregates_count_is_kept_with_the_tables(spark, catalog):
    """The job resumes counting after the last batch the aggregates count: a crash between a
    batch's telemetry_raw commit and the aggregates' leaves that batch to the next refresh."""
    assert catalog.refreshed_through() == -1
    land_batch(catalog, device_frame(spark, [("dev-1", {"ts": ms(NOW), "seq": 1}, 1, NOW)]), 41)
    assert Catalog(spark, catalog.settings).refreshed_through() == 41


def readings_of_one_minute(spark, offsets, devices=5):
    """telemetry_raw rows of one minute: devices 0..4 in two regions, latencies from 3 ms to
    ~2.5 s, two numeric fields, in random order of send time."""
    import random

    rng = random.Random(offsets.start)
    minute = NOW.replace(second=0, microsecond=0)
    readings = []
    for o in offsets:
        sent = minute + dt.timedelta(seconds=rng.uniform(0, 50))
        arrived = sent + dt.timedelta(milliseconds=rng.choice([3, 40, 99, 150, 700, 2500]) + o % 7)
        payload = {"ts": ms(sent), "seq": o, "temp_c": rng.uniform(-5, 30), "rssi": -rng.randint(40, 90)}
        region = "local-eu" if o % devices < 3 else "local-us"
        readings.append((f"dev-{o % devices}", payload, o, arrived, region))
    return tr.raw_rows(
        decode(spark, [record(p, o, ts=ts, device=d, region=r) for d, p, o, ts, r in readings])
    )


def table_rows(df, key):
    return {tuple(r[k] for k in key): r.asDict() for r in df.collect()}


def same_rows(stored, computed, key):
    """The stored rows are the computed ones: sketches compared by their estimates, floats to
    rounding (a sum of two batches' sums is not summed in the same order)."""
    got, want = table_rows(stored, key), table_rows(computed, key)
    assert got.keys() == want.keys()
    for k, row in want.items():
        for column, value in row.items():
            if column == "devices_sketch":
                continue
            if isinstance(value, float):
                assert got[k][column] == pytest.approx(value, rel=1e-12), (k, column)
            else:
                assert got[k][column] == value, (k, column)


def test_counts_added_batch_by_batch_are_the_counts_of_all_the_rows_at_once(spark, catalog):
    """Tried: three batches of one minute's readings (five devices, two regions, latencies
    across the exact and the logarithmic buckets) counted one refresh after another; a
    refresh again with nothing new.  The aggregates hold what counting all the rows in one
    go gives: counts, min, max, avg, last, region, devices, latency percentiles."""
    batches = [readings_of_one_minute(spark, range(start, start + 40)) for start in (0, 40, 80)]
    for number, rows in enumerate(batches, 1):
        land_batch(catalog, rows, number)
    catalog.refresh(3)  # nothing new: adds nothing
    everything = catalog.read(RAW)
    assert everything.count() == 120
    same_rows(catalog.read(DEVICE_MINUTE), tr.device_minute(everything), DEVICE_MINUTE.key)
    same_rows(catalog.read(REGION_MINUTE), tr.region_minute(everything), REGION_MINUTE.key)
    eu = catalog.read(REGION_MINUTE).where(F.col("region") == "local-eu").first()
    assert (eu["messages"], eu["devices"], eu["counted_through"]) == (72, 3, 3)


def test_a_crash_between_the_aggregates_commits_counts_no_batch_twice(spark, catalog):
    """Tried: batch 2 lands and only device_minute counts it (the job killed before
    region_minute's commit); the next refresh counts batch 2 in region_minute alone."""
    first, second = (readings_of_one_minute(spark, range(s, s + 30)) for s in (0, 30))
    land_batch(catalog, first, 1)
    catalog.land(RAW, second.withColumn("ingest_batch", F.lit(2).cast("long")))
    new = catalog.read(RAW).where("ingest_batch = 2")
    catalog.land(DEVICE_MINUTE, tr.device_minute(new), merge=tr.DEVICE_MINUTE_MERGE)
    assert (catalog.counted_through(DEVICE_MINUTE), catalog.refreshed_through()) == (2, 1)
    catalog.refresh(2)
    everything = catalog.read(RAW)
    same_rows(catalog.read(DEVICE_MINUTE), tr.device_minute(everything), DEVICE_MINUTE.key)
    same_rows(catalog.read(REGION_MINUTE), tr.region_minute(everything), REGION_MINUTE.key)
    assert catalog.refreshed_through() == 2


def test_an_aggregate_whose_count_fails_beside_the_other_is_counted_at_the_next_refresh(
    spark, catalog, monkeypatch
):
    """Tried: the aggregates count at once, each on its own thread (tables.each_aggregate),
    and region_minute's MERGE fails (its commit lost, say): the refresh raises that error
    once device_minute's count has ended, device_minute counts batch 2 all the same, and
    the next refresh counts batch 2 in region_minute alone -- every row once in each."""
    first, second = (readings_of_one_minute(spark, range(s, s + 30)) for s in (0, 30))
    land_batch(catalog, first, 1)
    catalog.land(RAW, second.withColumn("ingest_batch", F.lit(2).cast("long")))
    land = catalog.land

    def region_minute_fails(table, rows, **kwargs):
        if table is REGION_MINUTE:
            raise RuntimeError("region_minute's commit lost")
        return land(table, rows, **kwargs)

    monkeypatch.setattr(catalog, "land", region_minute_fails)
    with pytest.raises(RuntimeError, match="commit lost"):
        catalog.refresh(2)
    assert (catalog.counted_through(DEVICE_MINUTE), catalog.counted_through(REGION_MINUTE)) == (2, 1)
    monkeypatch.undo()
    catalog.refresh(2)
    everything = catalog.read(RAW)
    same_rows(catalog.read(DEVICE_MINUTE), tr.device_minute(everything), DEVICE_MINUTE.key)
    same_rows(catalog.read(REGION_MINUTE), tr.region_minute(everything), REGION_MINUTE.key)
    assert catalog.refreshed_through() == 2


def test_an_aggregate_made_before_its_states_is_counted_again_from_telemetry_raw(spark, catalog):
    """An operator upgrades: device_minute was made without the columns that later rows are
    added to.  The next start adds them and counts the table again from telemetry_raw."""
    land_batch(catalog, readings_of_one_minute(spark, range(20)), 1)
    name = catalog.name(DEVICE_MINUTE)
    old = ["date", "minute", "device", "region", "field", "count", "min", "max", "avg", "last"]
    before = spark.createDataFrame(catalog.read(DEVICE_MINUTE).select(*old).collect())
    spark.sql(f"DROP TABLE {name}")
    before.writeTo(name).using("iceberg").partitionedBy(F.col("date")).create()
    Catalog(spark, catalog.settings).create_tables()
    assert "counted_through" not in spark.table(name).columns, "a reader's session upgraded it"
    Catalog(spark, catalog.settings).create_tables(upgrade=True)  # the job's start
    assert "counted_through" in spark.table(name).columns
    properties = {r[0]: r[1] for r in spark.sql(f"SHOW TBLPROPERTIES {name}").collect()}
    assert properties["write.target-file-size-bytes"] == "33554432", "the table's properties are kept"
    assert spark.table(f"{name}.partitions").schema["partition"].dataType.names == ["date"]
    same_rows(catalog.read(DEVICE_MINUTE), tr.device_minute(catalog.read(RAW)), DEVICE_MINUTE.key)
    land_batch(catalog, readings_of_one_minute(spark, range(20, 40)), 2)
    same_rows(catalog.read(DEVICE_MINUTE), tr.device_minute(catalog.read(RAW)), DEVICE_MINUTE.key)


def test_a_recompute_leaves_the_batches_the_job_has_not_counted_to_the_job(spark, catalog):
    """Tried: batch 2 lands a late reading of yesterday and one of today, and the job stops
    before counting it; an operator recomputes yesterday; the job then counts batch 2.
    Each reading is counted once: the recompute did not count batch 2 (which would have
    marked it counted and left today's reading out)."""
    from spark.query import recompute

    today = NOW + dt.timedelta(days=1)
    land_batch(catalog, device_frame(spark, [("dev-1", {"ts": ms(NOW), "seq": 1}, 1, NOW)]), 1)
    late_and_now = device_frame(
        spark,
        [
            ("dev-1", {"ts": ms(NOW + dt.timedelta(seconds=1)), "seq": 2}, 2, today),
            ("dev-1", {"ts": ms(today), "seq": 3}, 3, today),
        ],
    )
    catalog.land(RAW, late_and_now.withColumn("ingest_batch", F.lit(2).cast("long")))
    recompute(spark, catalog.settings, NOW.date(), NOW.date())
    catalog.refresh(2)
    same_rows(catalog.read(DEVICE_MINUTE), tr.device_minute(catalog.read(RAW)), DEVICE_MINUTE.key)
    same_rows(catalog.read(REGION_MINUTE), tr.region_minute(catalog.read(RAW)), REGION_MINUTE.key)


def test_the_end_of_a_backlog_is_counted_without_waiting_for_the_clock(spark, catalog, monkeypatch):
    """The aggregates count as soon as aggregate_after_rows rows wait (a backlog), and then
    the rows of the backlog's last batches, however few, without waiting for
    aggregate_interval_s: `make bench` saw a backlog's last 41,000 rows counted a minute after
    the rest.  Tried (aggregate_after_rows 3): a batch of 3 readings, counted; a batch of 1,
    counted at once as the backlog's end; then a batch of 1 at a steady rate waits for the
    clock.  Every reading is counted once."""
    import spark.job as job_module

    monkeypatch.setattr(job_module, "build_session", lambda *args, **kwargs: spark)
    job = job_module.TelemetryJob(dataclasses.replace(catalog.settings, aggregate_after_rows=3))

    def land(batch_id, seqs):
        readings = [record({"ts": NOW_MS, "seq": s}, s, device=f"dev-{s}") for s in seqs]
        job.land_batch(tr.parse(decode(spark, readings)), batch_id)

    land(1, [1, 2, 3])
    assert job._counting_due_by_rows()
    job.refresh_aggregates()
    land(2, [4])
    assert job._counting_due_by_rows(), "the backlog's last rows wait for the clock"
    job.refresh_aggregates()
    land(3, [5])
    assert not job._counting_due_by_rows(), "a steady rate's batch is counted by the clock"
    job.refresh_aggregates()  # the clock's count
    counted = catalog.read(DEVICE_MINUTE).where(F.col("field") == tr.ALL_MESSAGES_FIELD)
    assert counted.agg(F.sum("count")).first()[0] == 5


def test_a_backlogs_batch_is_counted_from_memory_once_and_a_batch_of_copies_is_not(
    spark, catalog, monkeypatch
):
    """A backlog's batch (aggregate_after_rows or more) stays in memory until run() counts
    it from there, after the batches before it (read back from telemetry_raw).  Tried
    (aggregate_after_rows 3): a steady batch of 1 reading, then a backlog batch of 3, counted
    together; that batch replayed (a crash before the checkpoint: nothing counted twice,
    nothing left in memory); a batch of 3 copies of readings telemetry_raw already holds and
    1 new (not counted from memory, which would count the copies: read back, the new one
    counted).  Each reading is counted once, and the aggregates hold what counting
    telemetry_raw's rows at once gives."""
    import spark.job as job_module

    monkeypatch.setattr(job_module, "build_session", lambda *args, **kwargs: spark)
    job = job_module.TelemetryJob(dataclasses.replace(catalog.settings, aggregate_after_rows=3))

    def land(batch_id, seqs):
        readings = [record({"ts": NOW_MS, "seq": s}, s, device=f"dev-{s}") for s in seqs]
        job.land_batch(tr.parse(decode(spark, readings)), batch_id)

    def counted():
        rows = catalog.read(DEVICE_MINUTE).where(F.col("field") == tr.ALL_MESSAGES_FIELD)
        return rows.agg(F.sum("count")).first()[0]

    land(1, [1])
    land(2, [2, 3, 4])
    assert list(job._in_memory) == [2], "the backlog batch waits in memory, the steady one does not"
    assert job._counting_due_by_rows()
    job.refresh_aggregates()
    assert (catalog.refreshed_through(), counted(), job._in_memory) == (2, 4, {})
    assert catalog.read(REGION_MINUTE).agg(F.sum("messages")).first()[0] == 4
    land(2, [2, 3, 4])  # the replay
    job.refresh_aggregates()
    assert (catalog.refreshed_through(), counted(), job._in_memory) == (2, 4, {})
    land(3, [2, 3, 4, 5])
    assert job._in_memory == {}, "copies kept in memory"
    job.refresh_aggregates()
    assert (catalog.refreshed_through(), counted()) == (3, 5)
    assert catalog.read(RAW).count() == 5
    # every column as counting telemetry_raw's rows at once gives
    same_rows(catalog.read(DEVICE_MINUTE), tr.device_minute(catalog.read(RAW)), DEVICE_MINUTE.key)
    same_rows(catalog.read(REGION_MINUTE), tr.region_minute(catalog.read(RAW)), REGION_MINUTE.key)


def test_the_job_compacts_batch_files_each_time_every_file_and_expiry_less_often(spark, catalog, monkeypatch):
    """The job's compactions (TelemetryJob.compact): each rewrites the micro-batches' files;
    every FULL_COMPACTION_EVERY_S one rewrites every file below the target size, and
    snapshots expire a sixth of the time-travel window apart (10 minutes of an hour).  Tried:
    three compactions, the clock moved past both periods before the third."""
    import spark.job as job_module

    monkeypatch.setattr(job_module, "build_session", lambda *args, **kwargs: spark)
    job = job_module.TelemetryJob(catalog.settings)

    def land_and_compact(seq):
        job.land_batch(tr.parse(decode(spark, [record({"ts": NOW_MS, "seq": seq}, seq)])), seq)
        job.land_batch(tr.parse(decode(spark, [record({"ts": NOW_MS, "seq": -seq}, 100 + seq)])), 100 + seq)
        job.compact()
        done = job.last_compaction
        return done["every_file"], done["expired"], done["tables"]["telemetry_raw"]["files_rewritten"]

    # files below 1 byte: none is the batches' own, so only a compaction of every file rewrites
    monkeypatch.setattr(tables, "SMALL_FILE_BYTES", 1)
    assert land_and_compact(1) == (False, True, 0), "the first compaction expires, batch files only"
    assert land_and_compact(2) == (False, False, 0)
    job._fully_compacted_at -= job_module.FULL_COMPACTION_EVERY_S
    job._expired_at -= catalog.settings.snapshots_kept_hours * 3600 / 6
    assert land_and_compact(3) == (True, True, 6), "every batch's file since the job began"
    assert catalog.read(RAW).count() == 6


def test_a_batch_commits_while_the_job_compacts_and_every_reading_stays_one_row(spark, catalog, monkeypatch):
    """The run loop compacts beside the batches (TelemetryJob.compact), which land and commit
    meanwhile.  Tried: six batches of 5,000 readings two hours earlier the same day (the
    files the compaction rewrites), then a compaction on a thread of its own, and once its
    rewrite runs, a batch of new readings lands (its MERGE reads none of those files), up
    to three times until the batch's append commits before the rewrite, which commits over
    it.  Every reading is one row, and the date that batch wrote waits for the next
    compaction."""
    import threading
    import time

    import spark.job as job_module

    monkeypatch.setattr(job_module, "build_session", lambda *args, **kwargs: spark)
    job = job_module.TelemetryJob(dataclasses.replace(catalog.settings, freshness_target_s=0))
    earlier = NOW - dt.timedelta(hours=2)

    def land(batch_id, at, seqs):
        readings = [record({"ts": ms(at), "seq": s}, s, device=f"dev-{s % 30}", ts=at) for s in seqs]
        job.land_batch(tr.parse(decode(spark, readings)), batch_id)

    tracker = spark.sparkContext.statusTracker()
    land_merge = job.catalog.land

    def land_inside_a_compaction(batch_id, seqs) -> list[Exception]:
        failed: list[Exception] = []
        compaction = threading.Thread(target=lambda: _record_failure(job.compact, failed))

        def land_once_the_rewrite_runs(table, rows, **kwargs):
            if table is RAW:
                compaction.start()
                while compaction.is_alive() and not tracker.getActiveJobsIds():
                    time.sleep(0.01)
            return land_merge(table, rows, **kwargs)

        monkeypatch.setattr(job.catalog, "land", land_once_the_rewrite_runs)
        land(batch_id, NOW, seqs)
        monkeypatch.setattr(job.catalog, "land", land_merge)
        compaction.join()
        return failed

    for attempt in range(3):  # until the batch commits first (~0.3-0.5 s ahead here)
        for b in range(6):
            first = (attempt * 7 + b) * 5000
            land(attempt * 7 + b, earlier, range(first, first + 5000))
        failed = land_inside_a_compaction(attempt * 7 + 6, range(first + 5000, first + 5003))
        assert not failed, f"the compaction failed: {failed}"
        assert job.last_compaction["tables"]["telemetry_raw"]["files_rewritten"] >= 6
        assert job._uncompacted == {RAW: NOW.date()}, (
            "the batch landed during the compaction waits for the next"
        )
        snapshots = spark.sql(f"SELECT operation FROM {catalog.name(RAW)}.snapshots ORDER BY committed_at")
        if [r["operation"] for r in snapshots.collect()][-2:] == ["append", "replace"]:
            break
    else:
        pytest.fail("in three tries, the batch never committed inside the compaction")
    landed = (attempt + 1) * (6 * 5000 + 3)
    rows = catalog.read(RAW)
    assert (rows.count(), rows.select("message_id").distinct().count()) == (landed, landed)


def _record_failure(call, failures: list) -> None:
    try:
        call()
    except Exception as e:  # on a thread of its own: the test asserts the list empty
        failures.append(e)
