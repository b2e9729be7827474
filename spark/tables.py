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
aggregates' rows of every minute a batch touched are then computed again from
telemetry_raw and replace the stored ones (Catalog.refresh): a reading however
late is counted in its minute, and once.  No watermark, no state to expire.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark import transforms as tr
from spark.settings import SparkSettings

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
    doc: str


RAW = Table("telemetry_raw", ("date", "region"), ("message_id",), "one row per device message, exactly once")
DEVICE_MINUTE = Table(
    "device_minute", ("date",), ("minute", "device", "field"), "per device, minute and numeric field"
)
REGION_MINUTE = Table(
    "region_minute", ("date",), ("minute", "region"), "per region and minute: messages, devices, latency"
)
REJECTS = Table(
    "rejects",
    ("date",),
    ("kafka_topic", "kafka_partition", "kafka_offset"),
    "records that could not become rows, with the reason",
)
TABLES = (RAW, DEVICE_MINUTE, REGION_MINUTE, REJECTS)


@dataclass(frozen=True)
class Aggregate:
    """A table computed from telemetry_raw by a transform, per minute and `group`."""

    table: Table
    transform: Callable[[DataFrame], DataFrame]
    #: with the minute, which rows of telemetry_raw one of its rows is computed from
    group: str


AGGREGATES = (
    Aggregate(DEVICE_MINUTE, tr.device_minute, "device"),
    Aggregate(REGION_MINUTE, tr.region_minute, "region"),
)

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

    def create_tables(self) -> None:
        """Create the namespace and any missing table (never alters one that exists)."""
        self.spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {self.namespace}")
        all_schemas = schemas(self.spark)
        for table in TABLES:
            columns = ", ".join(
                f"{_quote(f.name)} {f.dataType.simpleString()}" for f in all_schemas[table.name].fields
            )
            self.spark.sql(
                f"CREATE TABLE IF NOT EXISTS {self.name(table)} ({columns}) USING iceberg "
                f"PARTITIONED BY ({', '.join(table.partition_by)}) "
                f"COMMENT '{table.doc}' "
                "TBLPROPERTIES ("
                "'format-version'='2', "
                "'write.parquet.compression-codec'='zstd', "
                # a micro-batch is small: no shuffle to lay out files by partition before writing
                "'write.distribution-mode'='none', "
                # readers of a table the job commits to every 2 s find its metadata small
                "'write.metadata.delete-after-commit.enabled'='true', "
                "'write.metadata.previous-versions-max'='20')"
            )

    def read(self, table: Table) -> DataFrame:
        return self.spark.table(self.name(table))

    def land(self, table: Table, rows: DataFrame, *, replace: bool = False) -> DateSpan | None:
        """Insert the rows of `rows` whose key `table` does not hold yet -- with `replace`,
        replace the rows it holds too -- in one commit (none for an empty frame); return the
        dates of `rows`.  The key is looked up only in the dates a copy can have
        (copy_dates): the MERGE reads those partitions, not the whole table."""
        owned = not rows.is_cached
        if owned:
            rows = rows.persist()  # read twice: for its dates, then by the MERGE
        try:
            span = copy_dates(table, rows, self.settings.dedupe_lookback_days)
            if span is None:
                return None
            view = f"fedgate_batch_{table.name}"
            rows.createOrReplaceTempView(view)
            on = " AND ".join(f"t.{_quote(k)} = s.{_quote(k)}" for k in table.key)
            first, last = span.lookup_from.isoformat(), span.last.isoformat()
            matched = "WHEN MATCHED THEN UPDATE SET * " if replace else ""
            # the view lives in the frame's own session: in foreachBatch, the streaming query's clone
            rows.sparkSession.sql(
                f"MERGE INTO {self.name(table)} t USING {view} s "
                f"ON {on} AND t.date BETWEEN DATE'{first}' AND DATE'{last}' "
                f"{matched}WHEN NOT MATCHED THEN INSERT *"
            )
            return span
        finally:
            if owned:
                rows.unpersist()

    def refresh(self, aggregate: Aggregate, rows: DataFrame) -> DateSpan | None:
        """Recompute `aggregate`'s rows of every group `rows` (telemetry_raw rows, landed)
        fall in -- their minute and device, or minute and region -- from all of telemetry_raw,
        and replace them in one commit; return their dates.

        From telemetry_raw, not from `rows` added to the stored counts: distinct devices and
        latency percentiles do not add up, and a batch replayed after a crash between the raw
        table's commit and this one recomputes the same rows instead of counting them twice."""
        minute = F.floor(F.unix_seconds("event_time") / 60).cast("long")
        touched = rows.select(minute.alias("_minute"), aggregate.group).distinct().persist()
        try:
            minutes = [r[0] for r in touched.select("_minute").distinct().collect()]
            if not minutes:
                return None
            spans = minute_spans(minutes)
            in_spans = F.lit(False)
            for lo, hi in spans:
                # literals, so that Iceberg skips the files whose event_time range is outside
                in_spans = in_spans | (
                    (F.col("event_time") >= F.timestamp_seconds(F.lit(lo * 60)))
                    & (F.col("event_time") < F.timestamp_seconds(F.lit(hi * 60)))
                )
            dates = sorted({_utc_date(m) for lo, hi in spans for m in (lo, hi - 1)})
            raw = (
                rows.sparkSession.table(self.name(RAW))
                .where(F.col("date").between(F.lit(dates[0]), F.lit(dates[-1])) & in_spans)
                .withColumn("_minute", minute)
                .join(F.broadcast(touched), ["_minute", aggregate.group], "left_semi")
            )
            return self.land(aggregate.table, aggregate.transform(raw), replace=True)
        finally:
            touched.unpersist()

    def replace_dates(self, table: Table, rows: DataFrame, dates: list[dt.date]) -> None:
        """Replace `table`'s rows of `dates` with `rows` (holding only those dates) in one commit."""
        rows.writeTo(self.name(table)).overwrite(F.col("date").isin(dates))

    def compact(self, table: Table, since: dt.date, snapshots_older_than: dt.datetime) -> dict[str, int]:
        """Rewrite the small files of `table`'s dates from `since` into large ones, then expire
        the snapshots older than `snapshots_older_than` (and the files only they used); return
        Iceberg's counts.  A micro-batch every 2 s leaves a small file per batch and partition
        and a snapshot per commit: unbounded, both slow every read."""
        name = f"{self.settings.namespace}.{table.name}"
        call = f"CALL {self.settings.catalog}.system"
        rewritten = self.spark.sql(
            f"{call}.rewrite_data_files(table => '{name}', where => \"date >= '{since.isoformat()}'\", "
            "options => map('min-input-files', '2', 'partial-progress.enabled', 'true'))"
        ).first()
        older_than = snapshots_older_than.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        expired = self.spark.sql(
            f"{call}.expire_snapshots(table => '{name}', older_than => TIMESTAMP '{older_than}', "
            "retain_last => 5)"
        ).first()
        return {
            "files_rewritten": int(rewritten["rewritten_data_files_count"]) if rewritten else 0,
            "files_added": int(rewritten["added_data_files_count"]) if rewritten else 0,
            "snapshots_expired": int(expired["deleted_manifest_lists_count"]) if expired else 0,
        }


@dataclass(frozen=True)
class DateSpan:
    """The dates of a frame's rows, and the first date an earlier copy of one of them can have."""

    lookup_from: dt.date
    first: dt.date
    last: dt.date


def copy_dates(table: Table, rows: DataFrame, lookback_days: int) -> DateSpan | None:
    """The dates of `rows` and the first among which their earlier copies can be; None if empty.

    A copy has the same key, and the key fixes the date: a minute's group its minute, a
    reject its Kafka record (and time).  A telemetry_raw copy carries the same payload,
    hence the same device time: a row whose event time is its device's time has the same
    date in every copy.  A row whose event time came from Kafka (a clamped fast clock, an
    implausible or missing device time) is later in a later copy: its original can be up
    to `lookback_days` earlier."""
    earliest = F.col("date")
    if table is RAW:
        own_time = F.col("device_ts").isNotNull() & (F.col("event_time") == F.col("device_ts"))
        earliest = F.when(own_time, earliest).otherwise(F.date_sub("date", lookback_days))
    lookup_from, first, last = rows.select(F.min(earliest), F.min("date"), F.max("date")).first()  # type: ignore[misc]
    return None if first is None else DateSpan(lookup_from, first, last)


def minute_spans(minutes: list[int]) -> list[tuple[int, int]]:
    """Epoch minutes -> the fewest [first, end) runs of consecutive minutes covering them."""
    spans: list[tuple[int, int]] = []
    for m in sorted(set(minutes)):
        if spans and spans[-1][1] == m:
            spans[-1] = (spans[-1][0], m + 1)
        else:
            spans.append((m, m + 1))
    return spans


def _utc_date(epoch_minute: int) -> dt.date:
    return dt.datetime.fromtimestamp(epoch_minute * 60, dt.UTC).date()


def use_tables(spark: SparkSession, settings: SparkSettings) -> None:
    """Create any missing table and make their namespace current: `SHOW TABLES`, and the
    tables by their short names (telemetry_raw, device_minute...).

    The catalog caches no table: each query reads the table's latest commit."""
    catalog = Catalog(spark, settings)
    catalog.create_tables()
    spark.sql(f"USE {catalog.namespace}")
