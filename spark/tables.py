"""The tables: Apache Iceberg tables named by a catalog, and how a micro-batch lands in
them exactly once.

    fedgate.telemetry.telemetry_raw   partitioned by date, region
    fedgate.telemetry.device_minute   partitioned by date
    fedgate.telemetry.region_minute   partitioned by date
    fedgate.telemetry.rejects         partitioned by date

(catalog `fedgate` and namespace `telemetry` are settings.)  Data and metadata
live under the warehouse folder; the catalog (a JDBC catalog, a SQLite file
beside the warehouse by default) maps each name to the table's current
metadata.  Spark SQL (`SHOW TABLES`, `DESCRIBE`), pyiceberg, and through its
Arrow output DuckDB and pandas, read the same tables (spark/reading.py).

Exactly once: every table has a key (a device message's `message_id`, a
minute's group, a reject's Kafka offset).  A batch lands in telemetry_raw and
rejects by a MERGE that inserts only the rows whose key the table does not
hold yet.  A MERGE is one Iceberg commit, all or nothing, so a batch replayed
after a crash, a copy redelivered by RabbitMQ, or a gateway resending after 30
minutes or a day adds nothing: the table already holds the key.  The
aggregates then count the rows that micro-batches added to telemetry_raw
(Catalog.refresh): those rows' counts, sums, sketches and histograms per
minute are added to the stored rows of those minutes by one MERGE per
aggregate, whose rows say which batches they count (`counted_through`), in
the same commit: a reading however late is counted in its minute, and once.
No watermark, no state to expire.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import InheritableThread
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark import transforms as tr
from spark.settings import SparkSettings

log = logging.getLogger("fedgate.spark")

R = TypeVar("R")

KAFKA_SOURCE_SCHEMA = T.StructType(
    [
        T.StructField("key", T.BinaryType()),
        T.StructField("value", T.BinaryType()),
        T.StructField("topic", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("offset", T.LongType()),
        T.StructField("timestamp", T.TimestampType()),
        T.StructField("timestampType", T.IntegerType()),
        T.StructField(
            "headers",
            T.ArrayType(
                T.StructType([T.StructField("key", T.StringType()), T.StructField("value", T.BinaryType())])
            ),
        ),
    ]
)


@dataclass(frozen=True)
class Table:
    name: str
    partition_by: tuple[str, ...]
    #: what makes a row the same row: a batch inserts only rows with a key not yet held
    key: tuple[str, ...]
    #: the row's time: a MERGE looks for a key only in the files whose range of it (for
    #: telemetry_raw: of device_ts, see copy_window) meets the batch's, and compaction sorts
    #: by it so that those ranges stay narrow
    time: str
    doc: str


RAW = Table(
    "telemetry_raw",
    ("date", "region"),
    ("message_id",),
    "event_time",
    "one row per device message, exactly once",
)
DEVICE_MINUTE = Table(
    "device_minute",
    ("date",),
    ("minute", "device", "field"),
    "minute",
    "per device, minute and numeric field",
)
REGION_MINUTE = Table(
    "region_minute",
    ("date",),
    ("minute", "region"),
    "minute",
    "per region and minute: messages, devices, latency",
)
REJECTS = Table(
    "rejects",
    ("date",),
    ("kafka_topic", "kafka_partition", "kafka_offset"),
    "kafka_ts",
    "records that could not become rows, with the reason",
)

TABLES = (RAW, DEVICE_MINUTE, REGION_MINUTE, REJECTS)


@dataclass(frozen=True)
class Aggregate:
    """A table computed from telemetry_raw by a transform, per minute and key: the
    transform of some rows gives the rows' counts, and `merge` adds those to the stored
    counts of the same key."""

    table: Table
    transform: Callable[[DataFrame], DataFrame]
    #: column -> SQL: the stored row `t` and the new rows' `s` of one key, as one row
    merge: Mapping[str, str]


AGGREGATES = (
    Aggregate(DEVICE_MINUTE, tr.device_minute, tr.DEVICE_MINUTE_MERGE),
    Aggregate(REGION_MINUTE, tr.region_minute, tr.REGION_MINUTE_MERGE),
)


def each_aggregate(count: Callable[[Aggregate], R]) -> dict[Table, R]:
    """`count` of every aggregate, all at once, each aggregate on a thread of its own (the
    first on the caller's); an error of any is raised once all have ended.

    Why at once: an aggregate's MERGE is a chain of small Spark jobs, each planned and
    committed by the driver while one core computes, and the last of a backlog's counts
    runs alone after its last batch -- the two aggregates one after the other left a core
    idle for much of it.  Each commits on its own (its own mark, counted_through), so
    either may fail alone and be counted again from its mark.  The threads inherit the
    caller's scheduler pool (InheritableThread)."""
    results: dict[Table, R] = {}
    errors: list[BaseException] = []

    def one(aggregate: Aggregate) -> None:
        try:
            results[aggregate.table] = count(aggregate)
        except BaseException as e:  # raised by the caller's thread below
            errors.append(e)

    threads = [InheritableThread(target=one, args=(a,)) for a in AGGREGATES[1:]]
    for thread in threads:
        thread.start()
    one(AGGREGATES[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


#: an aggregate's column: the last micro-batch whose telemetry_raw rows the row counts;
#: the table's greatest is the table's own mark, moving in the same commit as its counts
COUNTED_THROUGH = "counted_through"

#: A file below this size is a micro-batch's own (at 300 readings/s: 16-50 kB each; a
#: compaction's file of their 2 minutes ~1.5 MB): rewritten at every compaction.  The files
#: above it are merged up to the target size less often (spark.job.FULL_COMPACTION_EVERY_S):
#: rewriting every file below the target at every compaction rewrote a row up to 15 times
#: (8 on average) before its file reached the 24 MB that ends it (zstd: ~31 minutes at 300
#: readings/s); now ~3.
SMALL_FILE_BYTES = 1 << 20

#: Every table's Iceberg properties.
TABLE_PROPERTIES = {
    "format-version": "2",
    "write.parquet.compression-codec": "zstd",
    # a micro-batch is small: no shuffle to lay out files by partition before writing
    "write.distribution-mode": "none",
    # readers of a table the job commits to every 2 s find its metadata small
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "20",
    # compacted files of ~40 minutes of a busy fleet (300 readings/s, zstd): a MERGE's key
    # lookup reads the few whose time range meets the batch's, not hours of rows
    "write.target-file-size-bytes": "33554432",
}

#: the telemetry_raw columns the aggregates' transforms read
_AGGREGATES_READ = ("device", "region", "event_time", "ingest_batch", "numeric_fields", "latency_ms")

_SCHEMAS: dict[str, T.StructType] = {}


def schemas(spark: SparkSession) -> dict[str, T.StructType]:
    """Each table's schema, derived from the transforms themselves (an empty frame through them)."""
    if not _SCHEMAS:
        _SCHEMAS.update(_derive_schemas(spark))
    return _SCHEMAS


def _derive_schemas(spark: SparkSession) -> dict[str, T.StructType]:
    empty = spark.createDataFrame([], KAFKA_SOURCE_SCHEMA)
    decoded = tr.decode_kafka(empty, "u", "d", 1)
    raw = tr.raw_rows(decoded)
    return {
        RAW.name: raw.schema,
        DEVICE_MINUTE.name: tr.device_minute(raw).schema,
        REGION_MINUTE.name: tr.region_minute(raw).schema,
        REJECTS.name: tr.reject_rows(decoded).schema,
    }


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


class Catalog:
    """fedgate's tables in the Iceberg catalog of a session (spark/session.py configures it)."""

    def __init__(self, spark: SparkSession, settings: SparkSettings):
        self.spark = spark
        self.settings = settings
        self.namespace = f"{settings.catalog}.{settings.namespace}"

    def name(self, table: Table) -> str:
        return f"{self.namespace}.{table.name}"

    def create_tables(self, *, upgrade: bool = False) -> None:
        """Create the namespace and any missing table.  With `upgrade` (the job, at its
        start), an aggregate made before it kept the states that later rows are added to is
        brought up to date (upgrade_aggregate); a reader's session never rewrites a table."""
        self.spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {self.namespace}")
        all_schemas = schemas(self.spark)
        for table in TABLES:
            columns = ", ".join(
                f"{_quote(f.name)} {f.dataType.simpleString()}" for f in all_schemas[table.name].fields
            )
            properties = ", ".join(f"'{k}'='{v}'" for k, v in TABLE_PROPERTIES.items())
            self.spark.sql(
                f"CREATE TABLE IF NOT EXISTS {self.name(table)} ({columns}) USING iceberg "
                f"PARTITIONED BY ({', '.join(table.partition_by)}) "
                f"COMMENT '{table.doc}' TBLPROPERTIES ({properties})"
            )
        if upgrade:
            for aggregate in AGGREGATES:
                self.upgrade_aggregate(aggregate, all_schemas[aggregate.table.name])

    def upgrade_aggregate(self, aggregate: Aggregate, schema: T.StructType) -> None:
        """An aggregate table without some of its columns (made by an earlier fedgate, before
        it kept the states that batches' counts are added to) is replaced by one that has
        them, its rows computed again from all of telemetry_raw -- one commit, schema and
        rows together: stored rows without their states could not be added to, and a crash
        half way must not leave such rows under the new schema."""
        name = self.name(aggregate.table)
        held = set(self.spark.table(name).columns)
        missing = [f.name for f in schema.fields if f.name not in held]
        if not missing:
            return
        log.warning("%s lacks %s: counting it again from telemetry_raw", name, ", ".join(missing))
        writer = (
            aggregate.transform(self.read(RAW))
            .writeTo(name)
            .using("iceberg")
            .partitionedBy(*(F.col(c) for c in aggregate.table.partition_by))
            .tableProperty("comment", aggregate.table.doc)
        )
        for key, value in TABLE_PROPERTIES.items():
            writer = writer.tableProperty(key, value)
        writer.createOrReplace()

    def read(self, table: Table) -> DataFrame:
        return self.spark.table(self.name(table))

    def land(
        self,
        table: Table,
        rows: DataFrame,
        *,
        merge: Mapping[str, str] | None = None,
        span: TimeSpan | None = None,
    ) -> TimeSpan | None:
        """Insert the rows of `rows` whose key `table` does not hold yet -- with `merge`
        (column -> SQL over the stored row `t` and the new `s`), update the rows it holds
        too -- in one commit (none for an empty frame); return the span of `rows`.  The key
        is looked up only in the time a copy can have (copy_window, or `span` when the
        caller computed it already): the MERGE reads the files of those dates whose time
        range meets it, not the table."""
        owned = span is None and not rows.is_cached
        if owned:
            rows = rows.persist()  # read twice: for its times, then by the MERGE
        try:
            if span is None:
                span = copy_window(table, rows, self.settings.dedupe_lookback_days)
            if span is None:
                return None
            view = f"fedgate_batch_{table.name}"
            rows.createOrReplaceTempView(view)
            on = " AND ".join(f"t.{_quote(k)} = s.{_quote(k)}" for k in table.key)
            matched = ""
            if merge:
                sets = ", ".join(f"t.{_quote(column)} = {sql}" for column, sql in merge.items())
                matched = f"WHEN MATCHED THEN UPDATE SET {sets} "
            # the view lives in the frame's own session: in foreachBatch, the streaming query's clone
            rows.sparkSession.sql(
                f"MERGE INTO {self.name(table)} t USING {view} s ON {on} AND {span.condition(table)} "
                f"{matched}WHEN NOT MATCHED THEN INSERT *"
            )
            return span
        finally:
            if owned:
                rows.unpersist()

    def refresh(self, through_batch: int) -> dict[Table, TimeSpan | None]:
        """Count in each aggregate the telemetry_raw rows of the micro-batches up to
        `through_batch` that it does not count yet (those after its `counted_through`): the
        transform of those rows gives their counts, states included, per minute and key,
        and one MERGE per aggregate adds them to the stored rows (Aggregate.merge) or
        inserts them.  Return each aggregate's span.

        The rows read are the new ones only (a file's range of `ingest_batch` prunes the
        rest), not their minutes' others: a backlog's minutes are counted batch by batch,
        not again from all of it each time.  A row's `counted_through` moves in the commit
        that adds its counts: after a crash between the two aggregates' commits, each
        counts from its own mark, and no batch is counted twice."""
        marks = {a.table: self.counted_through(a.table) for a in AGGREGATES}
        after = min(marks.values())
        if after >= through_batch:
            return {}
        batch = F.col("ingest_batch")
        new = (
            self.read(RAW)
            .where((batch > after) & (batch <= through_batch))
            .select(*_AGGREGATES_READ)
            .persist()  # read once for both aggregates
        )

        def count(aggregate: Aggregate) -> TimeSpan | None:
            mark = marks[aggregate.table]
            rows = new.where(batch > mark) if mark > after else new
            return self.land(aggregate.table, aggregate.transform(rows), merge=aggregate.merge)

        try:
            return each_aggregate(count)
        finally:
            new.unpersist()

    def count_landed(self, rows: DataFrame, batch_id: int, span: TimeSpan) -> dict[Table, TimeSpan]:
        """Count micro-batch `batch_id` in each aggregate that does not count it yet, from
        `rows`: the rows of `span` that telemetry_raw holds as the batch's (landed_rows), the
        batch's own still in memory, instead of reading them back -- one MERGE per
        aggregate in the minutes of `span`, without reading the rows first to find those.
        Return each counting aggregate's span.

        The caller counts every earlier batch first: an aggregate's mark says that it
        counts every batch up to it."""
        minutes = TimeSpan(_minute(span.first), _minute(span.last))
        new = rows.select(*_AGGREGATES_READ)

        def count(aggregate: Aggregate) -> TimeSpan | None:
            if self.counted_through(aggregate.table) >= batch_id:
                return None
            self.land(aggregate.table, aggregate.transform(new), merge=aggregate.merge, span=minutes)
            return minutes

        return {table: span for table, span in each_aggregate(count).items() if span is not None}

    def landed_rows(self, batch_id: int) -> int:
        """How many rows telemetry_raw holds as micro-batch `batch_id`'s."""
        return self.read(RAW).where(F.col("ingest_batch") == batch_id).count()

    def counted_through(self, table: Table) -> int:
        """The last micro-batch whose telemetry_raw rows aggregate `table` counts (-1: none)
        -- Iceberg answers the greatest from its files' statistics, without reading them."""
        mark = self.read(table).agg(F.max(COUNTED_THROUGH)).first()
        return -1 if mark is None or mark[0] is None else int(mark[0])

    def refreshed_through(self) -> int:
        """The last micro-batch whose rows every aggregate counts (-1: none yet)."""
        return min(self.counted_through(a.table) for a in AGGREGATES)

    def replace_dates(self, table: Table, rows: DataFrame, dates: list[dt.date]) -> None:
        """Replace `table`'s rows of `dates` with `rows` (holding only those dates) in one commit."""
        rows.writeTo(self.name(table)).overwrite(F.col("date").isin(dates))

    def compact(
        self,
        table: Table,
        since: dt.date,
        snapshots_older_than: dt.datetime | None,
        *,
        small_files_only: bool = False,
    ) -> dict[str, int]:
        """Rewrite the small files of `table`'s dates from `since` into large ones, then expire
        the snapshots older than `snapshots_older_than` (and the files only they used; None:
        none this time); return Iceberg's counts.  A micro-batch every few seconds leaves a
        small file per batch and partition and a snapshot per commit: unbounded, both slow
        every read.

        `small_files_only`: only the micro-batches' own files (below SMALL_FILE_BYTES) are
        rewritten, into one file of the minutes since the last compaction; the others wait
        for a compaction of every file below the target size (write.target-file-size-bytes)."""
        name = f"{self.settings.namespace}.{table.name}"
        # what the MERGEs look copies up by (TimeSpan.condition) keeps each file's range short
        sort_order = f"{table.time} ASC NULLS LAST"
        if table is RAW:
            sort_order = f"device_ts ASC NULLS LAST, {sort_order}"
        options = "'min-input-files', '2', 'partial-progress.enabled', 'true'"
        if small_files_only:
            options += f", 'min-file-size-bytes', '{SMALL_FILE_BYTES}'"
        call = f"CALL {self.settings.catalog}.system"
        t0 = time.monotonic()
        rewritten = self.spark.sql(
            f"{call}.rewrite_data_files(table => '{name}', where => \"date >= '{since.isoformat()}'\", "
            f"strategy => 'sort', sort_order => '{sort_order}', options => map({options}))"
        ).first()
        t1 = time.monotonic()
        expired = None
        if snapshots_older_than is not None:
            older_than = snapshots_older_than.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
            expired = self.spark.sql(
                f"{call}.expire_snapshots(table => '{name}', older_than => TIMESTAMP '{older_than}', "
                "retain_last => 5)"
            ).first()
        t2 = time.monotonic()
        return {
            # what each step took (wall), for progress.json: where a compaction's time goes
            "rewrite_ms": round((t1 - t0) * 1000),
            "expire_ms": round((t2 - t1) * 1000),
            "files_rewritten": int(rewritten["rewritten_data_files_count"]) if rewritten else 0,
            "files_added": int(rewritten["added_data_files_count"]) if rewritten else 0,
            "snapshots_expired": int(expired["deleted_manifest_lists_count"]) if expired else 0,
        }


@dataclass(frozen=True)
class TimeSpan:
    """Where a frame's earlier copies can be, and the span of its rows' times (Table.time)."""

    first: dt.datetime
    last: dt.datetime
    #: telemetry_raw: the [start, end) runs of seconds of device time (payload `ts`) of the
    #: rows that have one -- every copy has the same
    device_times: tuple[tuple[dt.datetime, dt.datetime], ...] = ()
    #: telemetry_raw: the event times, less the lookback, of the rows without a device time
    kafka_times: tuple[dt.datetime, dt.datetime] | None = None

    def condition(self, table: Table) -> str:
        """SQL on the target `t` of a MERGE: true for every row that can be a copy of one of
        the frame's.  Literal bounds only, so that Iceberg reads just the files whose ranges
        of those columns meet them."""
        if table is not RAW:
            return (
                f"t.date BETWEEN DATE'{self.first.date()}' AND DATE'{self.last.date()}' AND "
                f"t.{table.time} BETWEEN {_timestamp(self.first)} AND {_timestamp(self.last)}"
            )
        parts = [_in_runs("t.device_ts", self.device_times)] if self.device_times else []
        if self.kafka_times is not None:
            lo, hi = self.kafka_times
            parts.append(
                f"(t.device_ts IS NULL AND t.date BETWEEN DATE'{lo.date()}' AND DATE'{hi.date()}' "
                f"AND t.event_time BETWEEN {_timestamp(lo)} AND {_timestamp(hi)})"
            )
        return "(" + " OR ".join(parts) + ")"


#: At most this many runs of time in one condition (a MERGE's, a refresh's): a device
#: sending random times makes the nearest runs one instead of a condition of thousands.
MAX_TIME_RUNS = 16


def copy_window(table: Table, rows: DataFrame, lookback_days: int) -> TimeSpan | None:
    """Where the earlier copies of `rows` can be, and the span of their times; None if the
    frame is empty.

    A copy has the same key, and the key fixes the time: a minute's group its minute, a
    reject its Kafka record.  A telemetry_raw copy carries the same payload, hence the same
    device time, whatever its event time (a clamped fast clock, an implausible time, a copy
    a day later): copies are looked for among the rows of the same device times, to the
    second.  (To the minute, a live batch's lookup met every file the last minute's batches
    wrote -- 60 small files a region before compaction; to the second, the last two or
    three batches' files.)  A row
    without a device time has only the Kafka time of its copy, later than its original's:
    that is looked for up to `lookback_days` before it."""
    time = F.unix_micros(F.col(table.time))
    if table is not RAW:
        first, last = rows.select(F.min(time), F.max(time)).first()  # type: ignore[misc]
        return None if first is None else TimeSpan(_utc(first), _utc(last))
    return _raw_window(
        [
            r.asDict()
            for r in rows.groupBy(_device_second())
            .agg(F.min(time).alias("first"), F.max(time).alias("last"))
            .collect()
        ],
        lookback_days,
    )


def _device_second() -> Column:
    """A row's device time as whole seconds: a telemetry_raw copy's is its original's (copy_window)."""
    return F.expr(_DEVICE_SECOND_SQL).alias("second")


def _raw_window(seconds: Sequence[Mapping[str, Any]], lookback_days: int) -> TimeSpan | None:
    """telemetry_raw's copy window (copy_window) from rows of (second, first, last): a
    device second (NULL: no device time) and its rows' first and last times."""
    if not seconds:
        return None
    timeless = [g for g in seconds if g["second"] is None]
    return TimeSpan(
        _utc(min(g["first"] for g in seconds)),
        _utc(max(g["last"] for g in seconds)),
        tuple(time_runs([g["second"] for g in seconds if g["second"] is not None], _SECOND_US)),
        (
            (_utc(timeless[0]["first"]) - dt.timedelta(days=lookback_days), _utc(timeless[0]["last"]))
            if timeless
            else None
        ),
    )


@dataclass(frozen=True)
class BatchSummary:
    """What one action over a parsed micro-batch (transforms.parse) tells about it: where
    each table's MERGE looks for earlier copies, and whether the batch holds a message twice."""

    raw: TimeSpan | None
    rejects: TimeSpan | None
    #: two records of the batch carry one message id (a redelivery right behind its original)
    raw_copies: bool
    #: the batch's records bound for telemetry_raw (copies included)
    raw_records: int
    #: the batch's records bound for rejects
    rejected_records: int = 0
    #: when the batch's oldest record reached Kafka (Unix time, s; None: an empty batch)
    kafka_first_s: float | None = None


def summarize_batch(parsed: DataFrame, lookback_days: int) -> BatchSummary:
    """One look at the batch, in a single Spark job: each table's copy window (what
    copy_window gives, from the same per-second groups) and whether the batch repeats a
    message id -- counted over all its accepted records (per kind), not per second, so that
    two records of one id count as copies whatever their payloads.

    Spark projects the five columns this needs (SQL over a view of the batch: the JVM parses
    it, where the same projection from Python columns cost some fifty calls into the JVM)
    and hands them over as Arrow; Arrow groups them here.  The same groups as one Spark
    aggregate (a ROLLUP with a distinct count: three stages and two shuffles) took 235 ms of
    CPU for 1,000 cached records planned interpreted against 80 this way, and 1,180 against
    310 for 200,000 with generated code (micro-benchmark, local[2], medians of 22 runs)."""
    parsed.createOrReplaceTempView(_SUMMARY_VIEW)
    # the view lives in the frame's own session: in foreachBatch, the streaming query's clone
    columns = parsed.sparkSession.sql(_SUMMARY_SQL).toArrow()
    seconds = _groups(columns, ["raw", "second"])
    kinds = {g["raw"]: g for g in _groups(columns, ["raw"])}
    rejects = [g for g in seconds if not g["raw"]]
    kind, rejected = kinds.get(True), kinds.get(False)
    kafka_first = pc.min(columns["k"]).as_py()
    return BatchSummary(
        _raw_window([g for g in seconds if g["raw"]], lookback_days),
        TimeSpan(_utc(min(g["first"] for g in rejects)), _utc(max(g["last"] for g in rejects)))
        if rejects
        else None,
        kind is not None and kind["records"] > kind["ids"],
        0 if kind is None else kind["records"],
        0 if rejected is None else rejected["records"],
        None if kafka_first is None else kafka_first / _SECOND_US,
    )


def _groups(columns: pa.Table, keys: list[str]) -> list[dict[str, Any]]:
    """The rows of `columns` grouped by `keys` (a NULL key a group of its own): each group's
    keys, its records, distinct message ids (NULL not counted), first and last times."""
    aggregates = [([], "count_all"), ("message_id", "count_distinct"), ("t", "min"), ("t", "max")]
    grouped = columns.group_by(keys).aggregate(aggregates)
    names = {
        "count_all": "records",
        "message_id_count_distinct": "ids",
        "t_min": "first",
        "t_max": "last",
    }
    return grouped.rename_columns([names.get(n, n) for n in grouped.column_names]).to_pylist()


_SUMMARY_VIEW = "fedgate_parsed_batch"
_SECOND_US = 1_000_000
_DEVICE_SECOND_SQL = f"CAST(floor(unix_micros(device_ts) / {_SECOND_US}) AS BIGINT)"
# A record's kind (telemetry_raw's or rejects'), its device time's second (_device_second),
# its time (the table's time column) and when it reached Kafka, in microseconds.
_SUMMARY_SQL = f"""
SELECT reject_reason IS NULL AS raw,
       unix_micros(kafka_ts) AS k,
       {_DEVICE_SECOND_SQL} AS second,
       message_id,
       unix_micros(CASE WHEN reject_reason IS NULL THEN `{RAW.time}` ELSE `{REJECTS.time}` END) AS t
FROM {_SUMMARY_VIEW}
"""


def coarsen(spans: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """At most `most` spans covering `spans` (sorted), by closing the smallest gaps."""
    if len(spans) <= most:
        return spans
    gaps = sorted(range(1, len(spans)), key=lambda i: spans[i][0] - spans[i - 1][1], reverse=True)
    cuts = sorted(gaps[: most - 1])
    starts = [0, *cuts]
    ends = [*cuts, len(spans)]
    return [(spans[a][0], spans[b - 1][1]) for a, b in zip(starts, ends, strict=True)]


def time_runs(units: list[int], unit_us: int) -> list[tuple[dt.datetime, dt.datetime]]:
    """Epoch units of `unit_us` -> at most MAX_TIME_RUNS [start, end) runs of time covering them."""
    runs = coarsen(unit_spans(units), MAX_TIME_RUNS)
    return [(_utc(lo * unit_us), _utc(hi * unit_us)) for lo, hi in runs]


def _in_runs(column: str, runs: Sequence[tuple[dt.datetime, dt.datetime]]) -> str:
    """SQL: `column` in one of the [start, end) runs; literal bounds, so that Iceberg reads
    only the files whose range of the column meets one."""
    return (
        "("
        + " OR ".join(f"({column} >= {_timestamp(lo)} AND {column} < {_timestamp(hi)})" for lo, hi in runs)
        + ")"
    )


def _minute(t: dt.datetime) -> dt.datetime:
    """The start of `t`'s minute: an aggregate's time (transforms: a 1-minute window's start)."""
    return t.replace(second=0, microsecond=0)


def _utc(micros: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=micros)


def _timestamp(t: dt.datetime) -> str:
    """A Spark SQL literal of `t` (the sessions' time zone is UTC: spark/session.py)."""
    return f"TIMESTAMP'{t.astimezone(dt.UTC).strftime('%Y-%m-%d %H:%M:%S.%f')}'"


def unit_spans(units: list[int]) -> list[tuple[int, int]]:
    """Epoch units -> the fewest [first, end) runs of consecutive units covering them."""
    spans: list[tuple[int, int]] = []
    for m in sorted(set(units)):
        if spans and spans[-1][1] == m:
            spans[-1] = (spans[-1][0], m + 1)
        else:
            spans.append((m, m + 1))
    return spans


def use_tables(spark: SparkSession, settings: SparkSettings) -> None:
    """Create any missing table and make their namespace current: `SHOW TABLES`, and the
    tables by their short names (telemetry_raw, device_minute...).

    The catalog caches no table: each query reads the table's latest commit."""
    catalog = Catalog(spark, settings)
    catalog.create_tables()
    spark.sql(f"USE {catalog.namespace}")
