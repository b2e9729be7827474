"""The streaming job: Kafka -> telemetry_raw, rejects, device_minute, region_minute.

Three Structured Streaming queries read the bridge's topics with Spark's
Kafka source, each with its own checkpoint, into Iceberg tables
(spark/tables.py).  The topics are exactly those the router's mapping rules
produce, plus its catch-all and dead-letter topics (settings `topics`, from
router.topics.kafka_topics): a record of any rule's topic becomes a
telemetry_raw row that names its Kafka and MQTT topic, a record of the other
two a reject.

  raw            every record -> telemetry_raw (inserted if its message id is
                 not there yet, however late) + rejects, every `raw_trigger_s`
  device_minute  accepted records, deduplicated, windowed by event time with
  region_minute  the `late_after` watermark -> the minutes that closed,
                 every `aggregate_trigger_s`

Each micro-batch lands by one MERGE per table that inserts only keys the table
lacks (Catalog.land: exactly once).  Stop it anywhere (SIGTERM, SIGKILL, a
crash): the next start resumes from the checkpoints, replays the batch it had
not recorded, and the tables end up complete and free of duplicates.

    python -m spark.job --config state/nodes/spark/spark.toml
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from spark import transforms as tr
from spark.session import build_session
from spark.settings import SparkSettings, SparkSettingsError
from spark.tables import DEVICE_MINUTE, RAW, REGION_MINUTE, REJECTS, Catalog, Table

log = logging.getLogger("fedgate.spark")

#: What a micro-batch becomes: (table, frame) pairs.
Frames = list[tuple[Table, DataFrame]]
Build = Callable[[DataFrame, int], Frames]

QUERY_RAW = "raw"
QUERY_DEVICE_MINUTE = "device_minute"
QUERY_REGION_MINUTE = "region_minute"


def kafka_source(spark: SparkSession, s: SparkSettings) -> DataFrame:
    return (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", s.kafka_bootstrap)
        .option("subscribe", ",".join(s.require_topics()))
        .option("startingOffsets", s.starting_offsets)
        .option("includeHeaders", "true")
        .option("maxOffsetsPerTrigger", s.max_offsets_per_trigger)
        # a listed topic created after the job started (and new partitions) is found within this time
        .option("kafka.metadata.max.age.ms", "30000")
        .load()
    )


def decoded_stream(spark: SparkSession, s: SparkSettings) -> DataFrame:
    return tr.decode_kafka(kafka_source(spark, s), s.unmatched_topic, s.deadletter_topic, s.max_payload_bytes)


def offsets_read(progress: Any) -> int | None:
    """Records read so far, summed over every topic partition (the batch's end offsets).

    Compared with the topics' end offsets it is the query's lag.
    """
    total, seen = 0, False
    for source in progress.get("sources") or []:
        end = source["endOffset"]
        if isinstance(end, str):
            end = json.loads(end) if end.startswith("{") else {}
        for partitions in (end or {}).values():
            total += sum(int(o) for o in partitions.values())
            seen = True
    return total if seen else None


class TelemetryJob:
    def __init__(self, settings: SparkSettings):
        self.settings = settings
        self.spark = build_session(settings, "fedgate-tables")
        self.catalog = Catalog(self.spark, settings)
        self.queries: list[StreamingQuery] = []
        self._stop = threading.Event()
        #: per query, rows its watermark left out since the job started (reported, never silent)
        self.late_rows: dict[str, int] = {}
        self._counted_batch: dict[str, int] = {}

    # --- the three queries ------------------------------------------------------------

    def _checkpoint(self, name: str) -> str:
        return f"{self.settings.checkpoint_dir.rstrip('/')}/{name}"

    def start(self) -> None:
        s = self.settings
        self.catalog.create_tables()
        self.queries.append(
            decoded_stream(self.spark, s)
            .writeStream.queryName(QUERY_RAW)
            .foreachBatch(self._lander(self._raw_frames))
            .option("checkpointLocation", self._checkpoint(QUERY_RAW))
            .trigger(processingTime=f"{s.raw_trigger_s} seconds")
            .start()
        )
        for name, table, transform in (
            (QUERY_DEVICE_MINUTE, DEVICE_MINUTE, tr.device_minute),
            (QUERY_REGION_MINUTE, REGION_MINUTE, tr.region_minute),
        ):
            # A copy older than the watermark is dropped as late, so a
            # duplicate is never counted twice even after its id expired.
            accepted = (
                tr.raw_rows(decoded_stream(self.spark, s))
                .withWatermark("event_time", s.late_after)
                .dropDuplicatesWithinWatermark(["message_id"])
            )
            self.queries.append(
                transform(accepted)
                .writeStream.queryName(name)
                .outputMode("append")
                .foreachBatch(self._lander(self._aggregate_frames(table)))
                .option("checkpointLocation", self._checkpoint(name))
                .trigger(processingTime=f"{s.aggregate_trigger_s} seconds")
                .start()
            )
        log.info(
            "streaming %s from %s into %s (checkpoints %s)",
            ",".join(s.topics),
            s.kafka_bootstrap,
            self.catalog.namespace,
            s.checkpoint_dir,
        )

    def _lander(self, build: Build) -> Callable[[DataFrame, int], None]:
        """foreachBatch function: each table's rows of the batch land by an insert-if-absent
        MERGE (Catalog.land), so a batch replayed after a crash adds nothing twice."""

        def land(batch: DataFrame, batch_id: int) -> None:
            batch = batch.persist()  # read from Kafka once, whatever the tables built from it
            try:
                for table, rows in build(batch, batch_id):
                    self.catalog.land(table, rows)
            finally:
                batch.unpersist()

        return land

    @staticmethod
    def _raw_frames(batch: DataFrame, batch_id: int) -> Frames:
        # one global aggregate, no shuffle: this action also fills the batch's cache
        accepted, rejected = batch.select(
            F.count_if(F.col("reject_reason").isNull()), F.count_if(F.col("reject_reason").isNotNull())
        ).first()  # type: ignore[misc]
        frames = []
        if accepted:
            # copies inside one batch (a redelivery right behind its original) are one row;
            # copies across batches are kept out by the MERGE
            rows = tr.raw_rows(batch).dropDuplicates(["message_id"])
            frames.append((RAW, rows.withColumn("ingest_batch", F.lit(batch_id).cast("long"))))
        if rejected:
            frames.append((REJECTS, tr.reject_rows(batch)))
        return frames

    @staticmethod
    def _aggregate_frames(table: Table) -> Build:
        def build(batch: DataFrame, batch_id: int) -> Frames:
            return [(table, batch)]  # an empty batch lands nothing (Catalog.land)

        return build

    # --- running ------------------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for q in self.queries:
            p: Any = q.lastProgress or {}
            out[q.name] = {
                "active": q.isActive,
                "batch": p.get("batchId"),
                "input_rows": p.get("numInputRows"),
                "input_rows_per_s": p.get("inputRowsPerSecond"),
                "processed_rows_per_s": p.get("processedRowsPerSecond"),
                "batch_ms": (p.get("durationMs") or {}).get("triggerExecution"),
                "watermark": (p.get("eventTime") or {}).get("watermark"),
                "late_rows_dropped": self.late_rows.get(q.name, 0),
                "offsets_read": offsets_read(p),
                "status": q.status.get("message"),
            }
        return out

    def count_late_rows(self) -> None:
        """Add up the rows each query's watermark dropped in the batches since the last call
        (Spark reports them per batch, in its state operators' progress), and say so in the
        log: rows in telemetry_raw (whose query has no watermark and drops nothing) but in no
        closed minute of an aggregate (`fedgate recompute` puts them back)."""
        for q in self.queries:
            seen = self._counted_batch.get(q.name, -1)
            for p in q.recentProgress:
                batch = p.get("batchId", -1)
                if batch <= seen:
                    continue
                seen = batch
                dropped = sum(
                    op.get("numRowsDroppedByWatermark") or 0 for op in p.get("stateOperators") or []
                )
                if dropped:
                    self.late_rows[q.name] = self.late_rows.get(q.name, 0) + dropped
                    where = "behind the watermark: in telemetry_raw, in no closed minute of " + q.name
                    log.warning(
                        "%s: batch %s dropped %d late row(s), %s (watermark %s)",
                        q.name,
                        batch,
                        dropped,
                        where,
                        (p.get("eventTime") or {}).get("watermark"),
                    )
            self._counted_batch[q.name] = seen

    def write_progress(self, state: str) -> None:
        if not self.settings.progress_file:
            return
        path = Path(self.settings.progress_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"state": state, "updated_ms": int(time.time() * 1000), "queries": self.progress()})
        )
        os.replace(tmp, path)

    def run(self) -> int:
        self.start()
        last_batch: dict[str, Any] = {}
        self.write_progress("running")
        while not self._stop.wait(2.0):
            for q in self.queries:
                if not q.isActive:
                    err = q.exception()
                    log.error("query %s stopped: %s", q.name, err)
                    self.stop()
                    self.write_progress("failed")
                    return 1
                p: Any = q.lastProgress
                if p and p.get("numInputRows") and last_batch.get(q.name) != p.get("batchId"):
                    last_batch[q.name] = p.get("batchId")
                    log.info(
                        "%s: batch %s, %s records in %.1f s (%.0f/s)%s",
                        q.name,
                        p["batchId"],
                        p["numInputRows"],
                        (p.get("durationMs") or {}).get("triggerExecution", 0) / 1000,
                        p.get("processedRowsPerSecond") or 0,
                        f", watermark {p['eventTime']['watermark']}"
                        if (p.get("eventTime") or {}).get("watermark")
                        else "",
                    )
            self.count_late_rows()
            self.write_progress("running")
        self.stop()
        self.write_progress("stopped")
        return 0

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        # A query stopped mid-batch replays that batch at the next start; the
        # insert-if-absent MERGE keeps the replay from landing rows twice.
        for q in self.queries:
            try:
                q.stop()
            except (PySparkException, Py4JError) as e:
                log.warning("stopping %s: %s", q.name, e)
        try:
            self.spark.stop()
        except (PySparkException, Py4JError) as e:
            log.warning("stopping Spark: %s", e)
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spark.job", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="spark.toml (settings also come from FEDGATE_SPARK_* variables)")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)  # one INFO line per callback otherwise
    try:
        settings = SparkSettings.load(args.config)
        settings.require_topics()
    except SparkSettingsError as e:
        print(f"spark job: settings: {e}", file=sys.stderr)
        return 2
    job = TelemetryJob(settings)
    signal.signal(signal.SIGTERM, lambda *_: job.request_stop())
    signal.signal(signal.SIGINT, lambda *_: job.request_stop())
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
