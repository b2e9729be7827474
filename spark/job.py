"""The streaming job: Kafka -> telemetry_raw, rejects, device_minute, region_minute.

One Structured Streaming query reads the bridge's topics with Spark's Kafka
source, and each micro-batch (every `trigger_s`) lands in the Iceberg tables
(spark/tables.py):

  rejects        the records that cannot be rows, with the reason
  telemetry_raw  every other record, inserted if its message id is not there
                 yet, however late: from here a reading is queryable

Beside the batches, every `aggregate_interval_s` (run(), its own scheduler
pool; sooner once `aggregate_after_rows` wait, and then at once until a backlog's
last rows are counted), the rows the batches since the last time added are counted
(a backlog's batches, `aggregate_after_rows` or more, from their rows kept in memory):

  device_minute  those rows' counts per minute (per device / per region),
  region_minute  added to the stored minutes' counts: a late reading is
                 counted in its minute, never dropped (Catalog.refresh)

The topics are exactly those the router's mapping rules produce, plus its
catch-all and dead-letter topics (settings `topics`, from
router.topics.kafka_topics).  Every `compact_interval_s`, also beside the
batches, the job rewrites the small files of the dates it wrote into large ones
and expires old snapshots.

SIGUSR1 asks for a count now: the batches landed so far are counted in the
aggregates at the run loop's next round (within 2 s), whatever the clock says,
as after a backfill an analyst wants its minutes at once
(locally `fedgate count-now`; under systemd `systemctl kill --kill-whom=main -s
USR1 fedgate-spark`: the main process only, since a JVM dies of a SIGUSR1).

Each table's commit adds a key only once (Catalog.land): stop the job anywhere
(SIGTERM, SIGKILL, a crash, between two tables' commits) and the next start
resumes from the checkpoint, replays the batch it had not recorded, counts in
the aggregates every batch they did not count yet (each aggregate's rows say
which batches they count: Catalog.refreshed_through), and the tables end up
complete and free of duplicates.  The driver also serves its session over Spark Connect
(`connect_port`) for `fedgate query`.

    python -m spark.job --config state/nodes/spark/spark.toml
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from spark import transforms as tr
from spark.metrics import JobMetrics
from spark.phases import PhaseClock, engine_ms
from spark.session import build_session
from spark.settings import SparkSettings, SparkSettingsError
from spark.tables import RAW, REJECTS, BatchSummary, Catalog, Table, TimeSpan, summarize_batch

log = logging.getLogger("fedgate.spark")

#: The job's one streaming query (its checkpoint folder, its name in progress.json).
QUERY = "tables"

#: A micro-batch of fewer records than this is planned without Spark's generated code
#: (interpreted_for): at a steady 300 readings/s a batch holds ~600, and the plans' literals
#: (the batch id, the MERGE's time window) differ in every batch, so each batch compiled
#: new classes that the JVM's JIT then compiled again.  Measured on the job alone, minutes
#: 3-4 of its JVM: 0.66 cores and 0.78 s a batch with generated code, 0.47 cores and 0.56 s
#: without.  A backlog's batches (up to max_offsets_per_trigger) keep generated code.
INTERPRETED_BELOW_RECORDS = 20_000

#: How often a compaction rewrites every file below the tables' target size, not only the
#: micro-batches' own (spark.tables.SMALL_FILE_BYTES): each row is rewritten ~3 times on its
#: way to a file of the target size instead of at every compaction until then.
FULL_COMPACTION_EVERY_S = 900.0

#: At most this many backlog batches wait in memory to be counted (TelemetryJob._in_memory;
#: up to max_offsets_per_trigger records each); more are read back from telemetry_raw.
MAX_BATCHES_IN_MEMORY = 2

#: Spark SQL settings of a batch planned with and without generated code.  factoryMode is
#: Spark's internal switch between generated and interpreted projections and predicates;
#: without it an operator outside whole-stage code still compiles its own.
_GENERATED_CODE = {"spark.sql.codegen.wholeStage": "true", "spark.sql.codegen.factoryMode": "FALLBACK"}
_INTERPRETED = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}


def kafka_source(spark: SparkSession, s: SparkSettings) -> DataFrame:
    return (
        spark.readStream.format("kafka")
        .options(**s.kafka_options())
        .option("subscribe", ",".join(s.require_topics()))
        .option("startingOffsets", s.starting_offsets)
        .option("includeHeaders", "true")
        .option("maxOffsetsPerTrigger", s.max_offsets_per_trigger)
        # a listed topic created after the job started (and new partitions) is found within this time
        .option("kafka.metadata.max.age.ms", "30000")
        .load()
    )


def parsed_stream(spark: SparkSession, s: SparkSettings) -> DataFrame:
    """The Kafka records decoded and parsed (transforms.parse) on the stream: the expressions
    are built once, and a micro-batch arrives with every column its tables take."""
    return tr.parse(
        tr.decode_kafka(kafka_source(spark, s), s.unmatched_topic, s.deadletter_topic, s.max_payload_bytes)
    )


def last_progress(query: StreamingQuery) -> dict[str, Any]:
    """The query's last progress (Spark's StreamingQueryProgress as JSON), {} before its first
    batch.  Read as JSON in one call: PySpark's `lastProgress` builds the object field by
    field through py4j and walks each Java list until an exception ends it: at the run loop's
    two reads a round, measured ~1,200 lookups of py4j's own classes a minute in the JVM,
    besides the exceptions."""
    progress = query._jsq.lastProgress()
    return json.loads(progress.json()) if progress is not None else {}


#: How many of the last batches the progress file shows, phase by phase (spark/phases.py):
#: at a steady rate, two minutes of them.
RECENT_BATCHES = 40

#: The pacing (pause_after) expects the next batch to take as long as the slowest of this
#: many batches before it.
PACE_WINDOW = 10


def pause_after(took_s: float, recent_s: Sequence[float], target_s: float) -> float:
    """How long to wait after a micro-batch that took `took_s` (from its start to its last
    commit) before the next one starts, so that a record that arrived just after this batch
    started is a row within `target_s` at a steady rate: the next batch starts `target_s`
    less what it is expected to take (the slowest of `recent_s`) after this one did.

    Why wait at all: a batch costs about the same CPU whatever its size (Spark's planning,
    the MERGE's scan planning and commit: ~0.6 s of CPU for 980 records at 300/s), so the
    fewer batches a freshness target allows, the less the job costs.  0 when off (a target
    of 0) or when batches take the whole target (a backlog, a burst)."""
    if target_s <= 0:
        return 0.0
    expected = max(recent_s, default=took_s)
    return max(0.0, target_s - expected - took_s)


def interpreted_for(session: SparkSession, records: int) -> None:
    """Plan the next queries of `session` with Spark's generated code for a batch of
    `records`, or without it (INTERPRETED_BELOW_RECORDS)."""
    settings = _INTERPRETED if records < INTERPRETED_BELOW_RECORDS else _GENERATED_CODE
    for key, value in settings.items():
        session.conf.set(key, value)


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


@dataclass(frozen=True)
class InMemoryBatch:
    """A landed micro-batch's rows, still in memory, for the aggregates' count."""

    #: the batch as read, persisted: unpersisted once counted
    frame: DataFrame
    #: its telemetry_raw rows (from `frame`), exactly those telemetry_raw holds as the batch's
    rows: DataFrame
    #: their times
    span: TimeSpan


def _note_firsts(dates: dict[Table, dt.date], firsts: dict[Table, dt.date]) -> None:
    """Keep in `dates` each table's first date of both."""
    for table, first in firsts.items():
        dates[table] = min(first, dates.get(table, first))


class TelemetryJob:
    def __init__(self, settings: SparkSettings):
        self.settings = settings
        self.spark = build_session(settings, "fedgate-tables", serve=True)
        # Iceberg's vectorized Parquet reader takes a child of Arrow's root allocator for
        # every file it opens and never closes it (apache/iceberg#13937): 65,800 of them in
        # the heap of a job 20 minutes old at 300 readings/s, growing ~7,000 a minute (its
        # MERGEs and counts open a few files each, several times a minute), until G1 marks
        # without pause.  What the job reads back is small (a batch's copies, a minute's
        # new rows): read row by row.  Set on the job's own session (its streaming query's
        # clone inherits it), not the analysts' (Spark Connect's sessions start from the
        # context's settings), whose large scans keep vectorized reads.
        self.spark.conf.set("spark.sql.iceberg.vectorization.enabled", "false")
        self.catalog = Catalog(self.spark, settings)
        self.query: StreamingQuery | None = None
        self._stop = threading.Event()
        #: wakes run() before its next round: a stop, or enough rows waiting to be counted
        self._wake = threading.Event()
        #: a count asked for (SIGUSR1): the next round counts what is pending, clock or not
        self._count_asked = threading.Event()
        #: per table, the first date written since the last compaction began, and since the
        #: last one of every file below the target size (FULL_COMPACTION_EVERY_S) began:
        #: noted by the batches (and counts) while run() compacts, so under _dates_lock
        self._uncompacted: dict[Table, dt.date] = {}
        self._not_fully_compacted: dict[Table, dt.date] = {}
        self._dates_lock = threading.Lock()
        self._compacted_at = self._fully_compacted_at = time.monotonic()
        #: when snapshots were last expired (-inf: at the first compaction)
        self._expired_at = -math.inf
        self.last_compaction: dict[str, Any] = {}
        self.last_refresh: dict[str, Any] = {}
        #: the last count asked for (SIGUSR1): when it was answered, through which batch
        self.last_count_request: dict[str, Any] = {}
        #: the aggregates count the rows of batches up to this one; those after it are pending
        self._refreshed_through = -1
        #: per micro-batch landed and not counted yet, the rows it landed (a backlog's count
        #: starts before the clock says); written by the batches, trimmed by refreshes
        self._pending_rows: dict[int, int] = {}
        self._pending_lock = threading.Lock()
        self._refreshed_at = time.monotonic()
        #: per backlog batch landed and not counted yet, its rows kept in memory for the count
        self._in_memory: dict[int, InMemoryBatch] = {}
        #: the last count counted aggregate_after_rows rows or more: a backlog is being counted
        self._catching_up = False
        #: refreshes and compactions: never both at once (both rewrite the aggregates' files)
        self._refresh_lock = threading.Lock()
        #: what the last steady batches took, start to last commit (pause_after)
        self._batch_times: deque[float] = deque(maxlen=PACE_WINDOW)
        #: the pause after the last batch (s), in its log line and the progress
        self.last_pause_s = 0.0
        #: the last batches, phase by phase (spark/phases.py), for the progress file
        self.recent_batches: deque[dict[str, Any]] = deque(maxlen=RECENT_BATCHES)
        #: its Prometheus series (served on metrics_port from start())
        self.metrics = JobMetrics()
        # the JVM PySpark started (local mode: the executors' tasks run in it too)
        proc = getattr(self.spark.sparkContext._gateway, "proc", None)
        self._jvm_pid: int | None = proc.pid if proc is not None else None

    def start(self) -> None:
        s = self.settings
        self.catalog.create_tables(upgrade=True)
        if s.metrics_port:
            self.metrics.hold_to(s.freshness_target_s)
            self.metrics.serve(s.bind_host, s.metrics_port)
        # batches landed in telemetry_raw before a crash and not yet counted: the first
        # refresh covers them (batch ids go on from the checkpoint)
        self._refreshed_through = self.catalog.refreshed_through()
        # (Iceberg answers the max from its files' statistics, without reading them)
        landed = self.catalog.read(RAW).agg(F.max("ingest_batch")).first()[0]  # type: ignore[index]
        if landed is not None and landed > self._refreshed_through:
            self._pending_rows[landed] = 0  # how many is not known: the clock counts them
        self.query = (
            parsed_stream(self.spark, s)
            .writeStream.queryName(QUERY)
            .foreachBatch(self.land_batch)
            .option("checkpointLocation", f"{s.checkpoint_dir.rstrip('/')}/{QUERY}")
            .trigger(processingTime=f"{s.trigger_s} seconds")
            .start()
        )
        log.info(
            "streaming %s from %s into %s (checkpoint %s)",
            ",".join(s.topics),
            s.kafka_bootstrap,
            self.catalog.namespace,
            s.checkpoint_dir,
        )

    def land_batch(self, batch: DataFrame, batch_id: int) -> None:
        """foreachBatch function: the batch's rows land table by table (module docstring);
        a batch replayed after a crash adds nothing twice (Catalog.land).

        A micro-batch at a steady rate is small, and Spark's cost per batch is mostly per task
        (each builds its projections): the batch is read in as many tasks as the job has cores
        -- one per Kafka partition would be several per core -- and one aggregate
        (summarize_batch) tells both MERGEs where to look and whether the batch repeats a
        message, instead of an action per table and a shuffle for copies that are rare."""
        # as many tasks as cores: local[N]'s N, or the cores the cluster's executors have now
        cores = max(1, self.spark.sparkContext.defaultParallelism)
        self._note_engine_phases()
        t0 = time.monotonic()
        clock = PhaseClock(self._jvm_pid)
        batch = batch.coalesce(cores).persist()  # read from Kafka once, whatever the tables
        kept = False
        steady = True
        try:
            summary = summarize_batch(batch, self.settings.dedupe_lookback_days)
            clock.lap("summary")
            # On the streaming query's own session, where it stays: the next batch's read
            # and parse are planned like this one, before land_batch sees them (the engine
            # hands over planned rows), so a backlog's first batch is read interpreted
            # (200,000 records: 9.5 s against 6.5 with generated code, job alone).  Reading
            # every batch with generated code instead cost the steady job 0.36 -> 0.52
            # cores (minutes 3-4 at 300/s; the code is generated anew for each batch, even
            # where Spark's cache spares its compile).
            interpreted_for(batch.sparkSession, summary.raw_records)
            # a batch read with generated code is a backlog's: the next follows at once
            steady = summary.raw_records < INTERPRETED_BELOW_RECORDS
            if summary.rejects is not None:
                self._landed(REJECTS, tr.reject_rows(batch), summary.rejects)
                clock.lap("rejects")
            if summary.raw is not None:
                rows = tr.accepted_rows(batch)
                if summary.raw_copies:
                    # copies inside one batch are one row; copies across batches are kept out
                    # by the MERGE
                    rows = rows.dropDuplicates(["message_id"])
                rows = rows.withColumn("ingest_batch", F.lit(batch_id).cast("long"))
                self._landed(RAW, rows, summary.raw)
                clock.lap("telemetry_raw")
                kept = self._keep_for_counting(batch, rows, batch_id, summary)
                if kept:
                    clock.lap("keep")
                # counted in the aggregates by run(), beside the next batches
                with self._pending_lock:
                    self._pending_rows[batch_id] = summary.raw_records
                if self._counting_due_by_rows():
                    self._wake.set()  # counted as soon as run() is free, not at its next round
            took = time.monotonic() - t0
            self.metrics.landed(
                summary.raw_records, summary.rejected_records, took, summary.kafka_first_s, time.time()
            )
            pause = pause_after(took, self._batch_times, self.settings.freshness_target_s) if steady else 0.0
            if steady:
                self._batch_times.append(took)
            self.last_pause_s = round(pause, 2)
            # every batch, from here: the run loop's rounds see one batch of several
            log.info(
                "batch %s: %d records for telemetry_raw landed in %.1f s; phases (ms wall, cpu): %s; "
                "next in %.1f s",
                batch_id,
                summary.raw_records,
                took,
                clock.phases,
                pause,
            )
        finally:
            if not kept:  # else run() lets it go once counted
                batch.unpersist()
        # The engine starts the next batch when this function returns (its trigger's time
        # is past): waiting here spaces the batches; what arrives meanwhile waits in Kafka.
        # This batch is in every table already; a stop ends the wait.
        wait = t0 + took + self.last_pause_s - time.monotonic()
        if wait > 0:
            self._stop.wait(wait)
        clock.lap("pause")
        self.recent_batches.append(
            {
                "batch": batch_id,
                "at": round(time.time() - (time.monotonic() - t0), 3),
                "records": summary.raw_records,
                "phases": clock.phases,
            }
        )

    def _note_engine_phases(self) -> None:
        """The streaming engine's own phases of the previous batch (its progress is complete
        once this batch began), beside that batch's in recent_batches."""
        if self.query is None or not self.recent_batches:
            return
        try:
            progress = last_progress(self.query)
        except (Py4JError, PySparkException):  # a query stopping: no figure, no harm
            return
        previous = self.recent_batches[-1]
        if progress.get("batchId") == previous["batch"]:
            previous["engine_ms"] = engine_ms(progress)

    def _landed(self, table: Table, rows: DataFrame, span: TimeSpan) -> None:
        """Land `rows` (of `span`) in `table` (Catalog.land); note its dates for compaction."""
        self.catalog.land(table, rows, span=span)
        self._note_dates(table, span)

    def _note_dates(self, table: Table, span: TimeSpan | None) -> None:
        if span is None:
            return
        with self._dates_lock:
            for dates in (self._uncompacted, self._not_fully_compacted):
                _note_firsts(dates, {table: span.first.date()})

    def refresh_aggregates(self) -> None:
        """Count the pending batches' rows in the aggregates (Catalog.refresh: each
        aggregate's commit says which batches it counts, so a crash counts none twice)."""
        with self._refresh_lock:
            self._refresh_pending()

    def _refresh_pending(self) -> None:
        """refresh_aggregates, its lock held: the pending batches in order, those kept in
        memory from their rows there, the others read back from telemetry_raw."""
        self._refreshed_at = time.monotonic()
        through = self._pending_through()
        with self._pending_lock:  # the batches add to it meanwhile
            replays = [b for b in self._in_memory if b <= self._refreshed_through]
        for batch_id in replays:
            self._let_go(batch_id)  # a replay of a batch counted before
        if through <= self._refreshed_through:
            self._take_pending(through)
            return
        # a pool of its own: the scheduler shares the cores with the batches' jobs
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", "aggregates")
        with self._pending_lock:
            kept = sorted(b for b in self._in_memory if b <= through)
        for batch_id in kept:
            if self._pending_through(before=batch_id) > self._refreshed_through:
                self._count_read_back(batch_id - 1)
            # counted on the streaming query's session, planned as the batch was
            clock = PhaseClock(self._jvm_pid)
            with self._pending_lock:
                batch = self._in_memory[batch_id]
            try:
                spans = self.catalog.count_landed(batch.rows, batch_id, batch.span)
            finally:
                self._let_go(batch_id)  # counted, or read back from telemetry_raw at the next try
            for table, span in spans.items():
                self._note_dates(table, span)
            self._counted(batch_id, self._take_pending(batch_id), clock)
        if through > self._refreshed_through:
            self._count_read_back(through)

    def _count_read_back(self, through: int) -> None:
        """Count the pending batches up to `through` from their rows in telemetry_raw."""
        clock = self._plan_read_back(through)
        for table, span in self.catalog.refresh(through).items():
            self._note_dates(table, span)
        self._counted(through, self._take_pending(through), clock)

    def _plan_read_back(self, through: int) -> PhaseClock:
        """Plan the read-back count of the pending batches up to `through` for their rows,
        as a batch is (interpreted_for), and start its clock.

        A count read back from telemetry_raw runs on the job's own session, which planned
        every count with generated code: a minute's ~18,000 rows at 300/s, whose plans'
        literals (batches, minutes) differ at every count.  Planned like a batch of its size
        (with the spare task slot and both aggregates at once, docs/benchmarks.md) a minute's
        count took 1.2-1.6 s instead of 2.7-3.2, and the job at 300/s 0.13 cores instead of
        0.18.  (A backlog batch's count from memory runs on the streaming query's session,
        planned as that batch was: _refresh_pending leaves it so.)"""
        with self._pending_lock:
            rows = [n for b, n in self._pending_rows.items() if b <= through]
        # 0: rows landed before a restart, how many not known -- a backlog's, perhaps
        interpreted_for(self.spark, sum(rows) if rows and all(rows) else INTERPRETED_BELOW_RECORDS)
        return PhaseClock(self._jvm_pid)

    def _let_go(self, batch_id: int) -> None:
        with self._pending_lock:
            batch = self._in_memory.pop(batch_id)
        batch.frame.unpersist()

    def _keep_for_counting(
        self, frame: DataFrame, rows: DataFrame, batch_id: int, summary: BatchSummary
    ) -> bool:
        """Keep a backlog's batch in memory (`frame`, persisted) for run() to count its
        `rows` from there (Catalog.count_landed) instead of reading them back from
        telemetry_raw; False if it is read back: a steady batch (few rows: the read is
        cheap and its memory better let go), a batch with copies (which of them the MERGE
        kept is not known here), or one whose rows telemetry_raw does not hold exactly as
        the batch's (a replay after a crash, messages landed before)."""
        assert summary.raw is not None
        if not self._a_backlog(summary.raw_records) or summary.raw_copies:
            return False
        if batch_id <= self._refreshed_through or len(self._in_memory) >= MAX_BATCHES_IN_MEMORY:
            return False  # a replay counted before; run() behind: their memory comes first
        if self.catalog.landed_rows(batch_id) != summary.raw_records:
            return False
        with self._pending_lock:
            self._in_memory[batch_id] = InMemoryBatch(frame, rows, summary.raw)
        return True

    def _take_pending(self, through: int) -> int:
        """Forget the pending batches up to `through` (now counted); return their rows."""
        with self._pending_lock:
            return sum(self._pending_rows.pop(b) for b in [b for b in self._pending_rows if b <= through])

    def _counted(self, through: int, rows: int, clock: PhaseClock) -> None:
        """The aggregates now count every batch up to `through`, the last `rows` rows since
        `clock` started."""
        clock.lap("count")
        wall_ms, cpu_ms = clock.phases["count"]
        self._refreshed_through = through
        with self._pending_lock:
            # a backlog's count goes on until nothing waits: the rows of its last batches,
            # fewer than aggregate_after_rows, waited for the clock (a minute in make bench);
            # the first count of fewer ends it
            self._catching_up = self._a_backlog(rows)
        self.last_refresh = {
            "through_batch": through,
            "rows": rows,
            "took_ms": wall_ms,
            "cpu_ms": cpu_ms,
            "at_ms": int(time.time() * 1000),
        }
        log.info(
            "aggregates count the batches through %s: %d rows in %.1f s (the job's CPU meanwhile %.1f s)",
            through,
            rows,
            wall_ms / 1000,
            cpu_ms / 1000,
        )

    def compact(self) -> None:
        """Compact every table's dates written since the last time -- the batches' own files,
        or every file below the target size since the last such compaction
        (FULL_COMPACTION_EVERY_S) -- and expire old snapshots when that is due.

        run() calls it beside the batches, which land meanwhile: their MERGEs only insert
        (an Iceberg append), which commits beside a rewrite (each retries on the other's
        commit), and the dates they note go to the next compaction; the aggregates, which
        a count rewrites, are held by _refresh_lock."""
        t0 = time.monotonic()
        kept = dt.timedelta(hours=self.settings.snapshots_kept_hours)
        # Expiring costs ~0.2-0.9 s a table whether it finds anything or not (it reads every
        # manifest list): done a sixth of the time-travel window apart, not at every compaction
        # (10 minutes with an hour kept), a table holds at most that much more history.
        # each at most as often as the compactions themselves
        every = self.settings.compact_interval_s
        expire = t0 - self._expired_at >= max(every, kept.total_seconds() / 6)
        older_than = dt.datetime.now(dt.UTC) - kept if expire else None
        full = t0 - self._fully_compacted_at >= max(every, FULL_COMPACTION_EVERY_S)
        # the count's pool: the scheduler shares the cores with the batches' jobs
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", "aggregates")
        # with generated code, whatever the count before it was planned for (_plan_read_back):
        # a compaction rewrites minutes of rows at once
        interpreted_for(self.spark, INTERPRETED_BELOW_RECORDS)
        with self._dates_lock:  # what the batches note from here on is the next one's
            uncompacted, self._uncompacted = self._uncompacted, {}
            not_fully = self._not_fully_compacted
            if full:
                self._not_fully_compacted = {}
        done = {}
        try:
            with self._refresh_lock:
                for table, since in sorted(
                    (not_fully if full else uncompacted).items(), key=lambda kv: kv[0].name
                ):
                    done[table.name] = self.catalog.compact(
                        table, since, older_than, small_files_only=not full
                    )
        except BaseException:
            with self._dates_lock:  # not compacted: the next compaction's
                _note_firsts(self._uncompacted, uncompacted)
                if full:
                    _note_firsts(self._not_fully_compacted, not_fully)
            raise
        if expire:
            self._expired_at = t0
        if full:
            self._fully_compacted_at = t0
        self._compacted_at = time.monotonic()
        took = round(self._compacted_at - t0, 1)
        self.last_compaction = {
            "at_ms": int(time.time() * 1000),
            "took_s": took,
            "every_file": full,
            "expired": expire,
            "tables": done,
        }
        log.info(
            "compacted in %.1f s%s: %s", took, " (every file below the target size)" if full else "", done
        )

    # --- running ------------------------------------------------------------------------

    def progress(self, p: dict[str, Any] | None = None) -> dict[str, Any]:
        """The query's state for progress.json, from its last progress `p` (read if None)."""
        q = self.query
        if q is None:
            return {}
        if p is None:
            p = last_progress(q)
        last = self.recent_batches[-1]["phases"] if self.recent_batches else {}
        return {
            q.name: {
                "active": q.isActive,
                "batch": p.get("batchId"),
                "input_rows": p.get("numInputRows"),
                "input_rows_per_s": p.get("inputRowsPerSecond"),
                "processed_rows_per_s": p.get("processedRowsPerSecond"),
                "batch_ms": (p.get("durationMs") or {}).get("triggerExecution"),
                # where a batch's time went: Kafka offsets, planning, addBatch (the tables'
                # commits), the checkpoint's writes
                "durations_ms": p.get("durationMs") or {},
                # what each table's MERGE of the last batch took (its phases' wall time)
                "commit_ms": {t.name: last[t.name][0] for t in (REJECTS, RAW) if t.name in last},
                # of batch_ms, the wait after the commits that spaced it from the next batch
                "pause_ms": round(self.last_pause_s * 1000),
                # the last batches phase by phase (spark/phases.py)
                "recent_batches": [dict(b) for b in list(self.recent_batches)],
                "offsets_read": offsets_read(p),
                "status": q.status.get("message"),
            }
        }

    def write_progress(self, state: str, p: dict[str, Any] | None = None) -> None:
        if not self.settings.progress_file:
            return
        path = Path(self.settings.progress_file)
        tmp = path.with_suffix(".tmp")
        report = {
            "state": state,
            "updated_ms": int(time.time() * 1000),
            "queries": self.progress(p),
            "aggregates": self.last_refresh,
            "count_request": self.last_count_request,
            "compaction": self.last_compaction,
        }
        tmp.write_text(json.dumps(report))
        os.replace(tmp, path)

    def run(self) -> int:
        s = self.settings
        self.start()
        assert self.query is not None
        q = self.query
        self.write_progress("running")
        while True:
            self._wake.wait(2.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            if not q.isActive:
                log.error("query %s stopped: %s", q.name, q.exception())
                self.stop()
                self.write_progress("failed")
                return 1
            p = last_progress(q)
            self.metrics.progressed(p)
            asked = self._count_asked.is_set()
            self._count_asked.clear()
            due = (
                asked
                or time.monotonic() - self._refreshed_at >= s.aggregate_interval_s
                or self._counting_due_by_rows()
            )
            if asked:
                log.info("a count was asked for (SIGUSR1): batches through %s", self._pending_through())
            if due and self._pending_through() > self._refreshed_through:
                # here, not in the batches: the next batches land telemetry_raw meanwhile
                try:
                    self.refresh_aggregates()
                except (PySparkException, Py4JError) as e:
                    log.error("counting batches in the aggregates: %s (tried again in the next round)", e)
                    if asked:  # not answered: the next round tries again
                        self._count_asked.set()
                        asked = False
            if self._compaction_due():
                # here too, not in the batches, which land meanwhile (compact())
                try:
                    self.compact()
                except (PySparkException, Py4JError) as e:
                    log.error("compaction: %s (tried again in compact_interval_s)", e)
                    self._compacted_at = time.monotonic()
            if asked:
                # answered even with nothing pending: the asker learns the count is current
                self.last_count_request = {
                    "answered_ms": int(time.time() * 1000),
                    "through_batch": self._refreshed_through,
                }
            self.write_progress("running", p)
        self.stop()
        self.write_progress("stopped")
        return 0

    def _compaction_due(self) -> bool:
        with self._dates_lock:
            written = bool(self._uncompacted)
        return written and time.monotonic() - self._compacted_at >= self.settings.compact_interval_s > 0

    def _pending_through(self, before: int | None = None) -> int:
        """The last micro-batch landed (before `before`; the aggregates count those up to
        _refreshed_through)."""
        with self._pending_lock:
            landed = [b for b in self._pending_rows if before is None or b < before]
        return max(landed, default=self._refreshed_through)

    def _counting_due_by_rows(self) -> bool:
        """Whether aggregate_after_rows rows wait to be counted, or any after a count of
        that many (the end of a backlog)."""
        with self._pending_lock:
            pending = sum(self._pending_rows.values())
            catching_up = self._catching_up  # set with the rows it counted (refresh_aggregates)
        if catching_up:
            return pending > 0
        return self._a_backlog(pending)

    def _a_backlog(self, rows: int) -> bool:
        """Whether `rows` to count are a backlog's (aggregate_after_rows or more; 0: never)."""
        return 0 < self.settings.aggregate_after_rows <= rows

    def request_count(self) -> None:
        """Count the pending batches in the aggregates at the next round (SIGUSR1)."""
        self._count_asked.set()
        self._wake.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        # A query stopped mid-batch replays that batch at the next start; the
        # insert-if-absent MERGE keeps the replay from landing rows twice.
        if self.query is not None:
            try:
                self.query.stop()
                self.refresh_aggregates()  # what the last batches landed, counted before leaving
            except (PySparkException, Py4JError) as e:
                log.warning("stopping %s: %s", self.query.name, e)
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
    signal.signal(signal.SIGUSR1, lambda *_: job.request_count())
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
