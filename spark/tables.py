"""The tables: Apache Iceberg tables named by a catalog, how a micro-batch lands in
them exactly once, and how queries see them.

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
minute's group, a reject's Kafka offset), and a batch lands by a MERGE that
inserts only the rows whose key the table does not hold yet.  A MERGE is one
Iceberg commit, all or nothing, so a batch replayed after a crash, a copy
redelivered by RabbitMQ, or a gateway resending after 30 minutes or a day adds
nothing: the table already holds the key.  No watermark, no state to expire.
"""

from __future__ import annotations

import datetime as dt
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

    def land(self, table: Table, rows: DataFrame) -> None:
        """Insert the rows of `rows` whose key `table` does not hold yet, in one commit (none
        for an empty frame).  The key is looked up only in the dates a copy can have
        (copy_dates): the MERGE reads those partitions, not the whole table."""
        rows = rows.persist()  # read twice: for its dates, then by the MERGE
        try:
            dates = copy_dates(table, rows, self.settings.dedupe_lookback_days)
            if dates is None:
                return
            view = f"fedgate_batch_{table.name}"
            rows.createOrReplaceTempView(view)
            on = " AND ".join(f"t.{_quote(k)} = s.{_quote(k)}" for k in table.key)
            first, last = (d.isoformat() for d in dates)
            # the view lives in the frame's own session: in foreachBatch, the streaming query's clone
            rows.sparkSession.sql(
                f"MERGE INTO {self.name(table)} t USING {view} s "
                f"ON {on} AND t.date BETWEEN DATE'{first}' AND DATE'{last}' WHEN NOT MATCHED THEN INSERT *"
            )
        finally:
            rows.unpersist()

    def replace_dates(self, table: Table, rows: DataFrame, dates: list[dt.date]) -> None:
        """Replace `table`'s rows of `dates` with `rows` (holding only those dates) in one commit."""
        rows.writeTo(self.name(table)).overwrite(F.col("date").isin(dates))


def copy_dates(table: Table, rows: DataFrame, lookback_days: int) -> tuple[dt.date, dt.date] | None:
    """The dates (first, last) among which the earlier copies of `rows` can be; None if empty.

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
    first, last = rows.select(F.min(earliest), F.max("date")).first()  # type: ignore[misc]
    return None if first is None else (first, last)


def register_views(spark: SparkSession, settings: SparkSettings) -> dict[str, DataFrame]:
    """Make the tables' namespace current (`SHOW TABLES`, names without a prefix) and
    register the aggregates as temporary views with their open minutes; return them.

    The aggregate tables hold minutes the streaming job has closed (their
    watermark passed); the minutes still open are computed from
    telemetry_raw at query time with the same transform, so a query sees
    every accepted message.  Column `final` tells them apart.  The stored
    tables stay readable by their full names (fedgate.telemetry.device_minute).
    """
    catalog = Catalog(spark, settings)
    catalog.create_tables()
    spark.sql(f"USE {catalog.namespace}")
    raw = catalog.read(RAW)
    views: dict[str, DataFrame] = {RAW.name: raw, REJECTS.name: catalog.read(REJECTS)}
    for table, transform in ((DEVICE_MINUTE, tr.device_minute), (REGION_MINUTE, tr.region_minute)):
        closed = catalog.read(table)
        boundary = closed.agg(F.max("minute")).first()[0]  # type: ignore[index]
        open_rows = (
            raw
            if boundary is None
            else raw.where(F.col("event_time") >= F.lit(boundary) + F.expr("INTERVAL 1 MINUTE"))
        )
        views[table.name] = closed.withColumn("final", F.lit(True)).unionByName(
            transform(open_rows).withColumn("final", F.lit(False))
        )
        views[table.name].createOrReplaceTempView(table.name)
    return views
