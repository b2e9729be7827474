"""The warehouse: where each table lives, how a micro-batch lands in it exactly
once, and how queries see the tables as views.

    <warehouse>/telemetry_raw/date=.../region=.../*.parquet
    <warehouse>/device_minute/date=.../*.parquet
    <warehouse>/region_minute/date=.../*.parquet
    <warehouse>/rejects/date=.../*.parquet
    <warehouse>/_staging/   a batch being written (never read)
    <warehouse>/_commits/   one marker per committed micro-batch and query
    <warehouse>/_checkpoints/  Spark's streaming checkpoints

Exactly once: Structured Streaming replays a micro-batch whose commit it did
not record, with the same records.  A batch is written to _staging first and
then moved into the table file by file (a rename, atomic per file); the
marker in _commits says the move finished.  Before the first file moves, the
list of files about to move in is written next to where the marker will be
(`<batch>.moving`).  A replay of a batch that has its marker writes nothing; a
replay of one that died half-way first deletes the files that list names, so
landing never has to list the table itself, however many files it holds.  Readers
never see a half-written file, and the folders are plain Hive-style Parquet
that pandas, DuckDB or any Spark can read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark import transforms as tr

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

#: Markers of this many recent batches are kept (only the last can be replayed).
KEEP_MARKERS = 50


@dataclass(frozen=True)
class Table:
    name: str
    partition_by: tuple[str, ...]
    doc: str


RAW = Table("telemetry_raw", ("date", "region"), "one row per device message, exactly once")
DEVICE_MINUTE = Table("device_minute", ("date",), "per device, minute and numeric field")
REGION_MINUTE = Table("region_minute", ("date",), "per region and minute: messages, devices, latency")
REJECTS = Table("rejects", ("date",), "records that could not become rows, with the reason")
TABLES = (RAW, DEVICE_MINUTE, REGION_MINUTE, REJECTS)


def table_path(warehouse: str, table: Table) -> str:
    return f"{warehouse.rstrip('/')}/{table.name}"


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


class Warehouse:
    """Filesystem operations through Hadoop's FileSystem, so the same code
    works on a local folder, HDFS or an object store."""

    def __init__(self, spark: SparkSession, root: str):
        self.spark = spark
        self.root = root.rstrip("/")
        jvm = spark._jvm  # type: ignore[attr-defined]
        assert jvm is not None
        self._Path = jvm.org.apache.hadoop.fs.Path
        self.fs = self._Path(self.root).getFileSystem(spark._jsc.hadoopConfiguration())  # type: ignore[attr-defined]

    def path(self, *parts: str) -> Any:
        return self._Path("/".join([self.root, *parts]))

    def exists(self, *parts: str) -> bool:
        return bool(self.fs.exists(self.path(*parts)))

    def has_data(self, table: Table) -> bool:
        if not self.exists(table.name):
            return False
        files = self.fs.listFiles(self.path(table.name), True)
        while files.hasNext():
            if files.next().getPath().getName().endswith(".parquet"):
                return True
        return False

    def marker_path(self, query: str, batch_id: int) -> Any:
        return self.path("_commits", query, f"{batch_id:012d}")

    def committed(self, query: str, batch_id: int) -> bool:
        return bool(self.fs.exists(self.marker_path(query, batch_id)))

    def land(
        self,
        query: str,
        batch_id: int,
        build: Callable[[], tuple[list[tuple[Table, DataFrame]], dict[str, Any]]],
    ) -> bool:
        """Land one micro-batch in its tables exactly once; False if it had landed already.

        `build` returns the batch's (table, frame) pairs and its stats; it is
        not called for a batch that has its marker (a replay after a crash).
        """
        if self.committed(query, batch_id):
            return False
        moving = self.path("_commits", query, f"{batch_id:012d}.moving")
        if self.fs.exists(moving):
            self._undo_moves(moving)
        frames, stats = build()
        prefix = f"b{batch_id:012d}-{query}-"
        staged = [(table, self._stage(query, table, df)) for table, df in frames]
        moves = [m for table, staging in staged for m in self._plan_moves(staging, table, prefix)]
        self._write_json(moving, {"files": [dest.toString() for _, _, dest in moves]})
        self._move(moves)
        for _, staging in staged:
            self.fs.delete(staging, True)
        marker = {"batch": batch_id, "query": query, "committed_ms": int(time.time() * 1000), **stats}
        self._write_json(self.marker_path(query, batch_id), marker)
        self.fs.delete(moving, False)
        if batch_id >= KEEP_MARKERS:
            self.fs.delete(self.marker_path(query, batch_id - KEEP_MARKERS), False)
        return True

    def _stage(self, name: str, table: Table, df: DataFrame) -> Any:
        """Write `df` as `table`'s partitions into a staging folder no reader looks at."""
        staging = self.path("_staging", name, table.name)
        self.fs.delete(staging, True)
        df.write.mode("overwrite").partitionBy(*table.partition_by).parquet(staging.toString())
        return staging

    def _write_json(self, path: Any, value: dict[str, Any]) -> None:
        out = self.fs.create(path, True)
        try:
            out.write(json.dumps(value).encode())
        finally:
            out.close()

    def _undo_moves(self, moving: Any) -> None:
        """Take out the files a dead attempt of a batch had moved into its tables."""
        stream = self.fs.open(moving)
        try:
            raw = bytes(stream.readAllBytes())
        finally:
            stream.close()
        try:
            files = json.loads(raw)["files"]
        except (ValueError, KeyError):
            files = []  # the attempt died writing the list: nothing had moved yet
        for f in files:
            self.fs.delete(self._Path(f), False)
        self.fs.delete(moving, False)

    def _move_in(self, staging: Any, table: Table, prefix: str) -> None:
        """Move the staged Parquet files into the table, partition folders kept, names prefixed."""
        self._move(self._plan_moves(staging, table, prefix))
        self.fs.delete(staging, True)

    def _plan_moves(self, staging: Any, table: Table, prefix: str) -> list[tuple[Any, Any, Any]]:
        """(staged file, table folder, table file) for each Parquet file staged for `table`."""
        if not self.fs.exists(staging):
            return []  # an empty frame writes nothing
        base = staging.toUri().getPath().rstrip("/")
        files = self.fs.listFiles(staging, True)
        moves = []
        while files.hasNext():
            src = files.next().getPath()
            if not src.getName().endswith(".parquet"):
                continue
            rel_dir = src.getParent().toUri().getPath()[len(base) :].strip("/")
            dest_dir = self.path(table.name, rel_dir) if rel_dir else self.path(table.name)
            moves.append((src, dest_dir, self._Path(dest_dir, prefix + src.getName())))
        return moves

    def _move(self, moves: list[tuple[Any, Any, Any]]) -> None:
        made: set[str] = set()
        for src, dest_dir, dest in moves:
            if dest_dir.toString() not in made:
                self.fs.mkdirs(dest_dir)
                made.add(dest_dir.toString())
            if not self.fs.rename(src, dest):
                raise OSError(f"could not move {src} to {dest}")

    def overwrite_dates(self, table: Table, df: DataFrame, dates: list[str], tag: str) -> None:
        """Replace `table`'s partitions for `dates` with `df` (holding only those dates): the recompute."""
        staging = self._stage("recompute", table, df)
        for date in dates:
            self.fs.delete(self.path(table.name, f"date={date}"), True)
        self._move_in(staging, table, f"{tag}-")


def read_table(spark: SparkSession, warehouse: Warehouse, table: Table) -> DataFrame:
    schema = schemas(spark)[table.name]
    if not warehouse.has_data(table):
        return spark.createDataFrame([], schema)
    path = warehouse.path(table.name).toString()
    return spark.read.schema(schema).option("basePath", path).parquet(path)


def register_views(spark: SparkSession, warehouse_root: str) -> dict[str, DataFrame]:
    """Register the tables as temporary views by name and return them.

    The aggregate tables hold minutes the streaming job has closed (their
    watermark passed); the minutes still open are computed from
    telemetry_raw at query time with the same transform, so a query sees
    every accepted message.  Column `final` tells them apart.
    """
    wh = Warehouse(spark, warehouse_root)
    raw = read_table(spark, wh, RAW)
    views: dict[str, DataFrame] = {RAW.name: raw, REJECTS.name: read_table(spark, wh, REJECTS)}
    for table, transform in ((DEVICE_MINUTE, tr.device_minute), (REGION_MINUTE, tr.region_minute)):
        closed = read_table(spark, wh, table)
        boundary = closed.agg(F.max("minute")).first()[0]  # type: ignore[index]
        open_rows = (
            raw
            if boundary is None
            else raw.where(F.col("event_time") >= F.lit(boundary) + F.expr("INTERVAL 1 MINUTE"))
        )
        views[table.name] = closed.withColumn("final", F.lit(True)).unionByName(
            transform(open_rows).withColumn("final", F.lit(False))
        )
    for name, df in views.items():
        df.createOrReplaceTempView(name)
    return views
