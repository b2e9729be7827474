"""Spark benchmark: rows/s the streaming job ingests, and freshness (device send -> row queryable).

Measured side by side in one run, on the benchmarks' federation (bench/suite.py:
one gateway, two routers, Kafka and the Spark job with the product's default
settings):

freshness, at a steady input rate
  MQTT devices publish QoS 1 readings at a fixed rate through the whole path
  (gateway -> federation -> router -> Kafka -> job).  A row is queryable when
  the Iceberg snapshot that added its data file is committed (spark/tables.py);
  freshness = that snapshot's commit time - the device's send time in the
  payload.  The split device -> Kafka is the row's own `latency_ms`.
  The job's CPU and memory over the window are taken from /proc.
  The same rate first runs for WARMUP_S, reported apart as the job's first
  minutes: a new JVM's JIT compiles Spark's code for ten minutes (measured here,
  the job's threads' CPU at 300 readings/s: 0.216 cores in its minutes 3-6, of
  which the compiler threads 0.084; 0.156 in minutes 9-12, of which 0.046), and
  a fleet's job runs for days.

ingest rate on a backlog
  N bridge records wait in Kafka for the warm job: its processes are stopped
  (SIGSTOP, as a stalled job is) while they are produced, and the clock runs
  from their SIGCONT until the last of the N rows is committed to
  telemetry_raw, and until the aggregates' commit of the same batch (rows/s);
  three such backlogs in a full run, the median the figure.  Before them,
  N more are produced into the running job as fast as Kafka takes them
  (~80k/s here), the clock from the first record: the job reads them as
  they come, beside the bench's producer.
  References on the same N records, waiting in a topic the job does not
  read, same run:
    - "python consume": one confluent-kafka consumer reading them: the rate
      Kafka hands records to one Python process here
    - "spark batch": one Spark batch query doing the job's work (decode,
      parse, write telemetry_raw, device_minute and region_minute as Parquet)
      without exactly-once MERGEs into Iceberg; run cold once, then three
      times warm (like the running job), the median of these the reference

Every message is counted: the bench fails if a row is missing or doubled.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from statistics import median
from typing import Any

from confluent_kafka import Producer

from backend import contract as c
from backend import kafka_read
from backend.kafka_read import topic_end
from backend.polling import wait_until
from bench.ha_bench import roles_pids
from bench.router_bench import cpu_seconds, progress
from fedgate.devices import SimDevice
from fedgate.stats import percentile
from infra.local import processes
from infra.local.driver import LocalFederation
from infra.local.layout import ROLE_SPARK, SPARK_NODE
from infra.local.services import SparkNode
from router.kafka import ensure_topics
from spark.phases import median_phases

#: Where the references read the same records: the job's topic pattern does not match it.
REFERENCE_TOPIC = "bench.spark-reference"
FRESH_PREFIX = "fresh-"
WARMUP_PREFIX = "warmup-"
#: the readings of the step at the army's rate (ARMY_STEP: rate/s, seconds, devices; full, quick)
STEP_PREFIX = "step-"
ARMY_STEP = {"full": (2000.0, 60.0, 100), "quick": (300.0, 3.0, 10)}
#: How long the job runs at the measured rate before the steady figures (a full run).
WARMUP_S = 480.0
BURST_PREFIX = "burst-"
#: how long the job is watched with nothing to land (full, quick)
IDLE_S = {"full": 60.0, "quick": 5.0}
#: a backlog's size (full, quick), and the rows after which the job counts it without waiting
#: for its minute (the federation's spark_aggregate_after_rows): a sixth of the backlog either
#: way, so that the quick run's backlog is counted by rows as the full run's is, not after the
#: 60 s clock (which was two thirds of the quick run)
BACKLOG = {"full": 300_000, "quick": 10_000}
AGGREGATE_AFTER_ROWS = {"full": 50_000, "quick": 1_700}
#: what the job may cost idle (the tables' cost at a trickle: a fifth of a core busy, this idle)
IDLE_GOAL_CORES = 0.05
STEADY_PREFIX = "steady-"
BACKLOG_PREFIX = "backlog-"
#: warm runs of the Spark batch reference, and backlogs into the job (full, quick), each
#: figure the median of its runs: the reference alone moved by an eighth between two runs
#: of the same code (41,118 and 36,167 rows/s), the job's backlog by a twentieth
REPEATS = {"full": 3, "quick": 1}


def rss_mb(pids: list[int]) -> float:
    return round(processes.rss_bytes(pids) / 2**20, 1)


class SnapshotLog:
    """A table's Iceberg snapshots (telemetry_raw's by default), read with pyiceberg as they
    are committed: snapshot id -> (committed_ms, rows it added, sequence number).  A row is
    queryable from the commit of the snapshot that added it.  A compaction's snapshots
    (Iceberg's "replace") are left out: the rows they add are rows already there."""

    def __init__(self, settings: Any, table: str = "telemetry_raw"):
        self.settings = settings
        self.table = table
        self.batches: dict[int, tuple[int, int, int]] = {}
        self._compactions: set[int] = set()

    def poll(self) -> None:
        from spark.reading import open_catalog

        table = open_catalog(self.settings).load_table(f"{self.settings.namespace}.{self.table}")
        for snap in table.snapshots():
            if snap.snapshot_id in self.batches or snap.snapshot_id in self._compactions:
                continue
            summary = snap.summary
            if summary is not None and summary.operation.value == "replace":
                self._compactions.add(snap.snapshot_id)
                continue
            added = (summary or {}).get("added-records", 0)
            self.batches[snap.snapshot_id] = (snap.timestamp_ms, int(added), snap.sequence_number or 0)

    def commits_by_batch(self, spark: Any, raw: str) -> dict[int, int]:
        """telemetry_raw's micro-batches (ingest_batch) -> when the snapshot that added their
        rows was committed (ms).  A compaction moves rows into new files, which the table's
        entries then name its own snapshot for; a row keeps its batch.  Each batch that
        landed rows made one snapshot adding exactly those, in batch order: paired from the
        newest (the table holds batches from before this log's first poll too), each pair's
        counts checked."""
        self.poll()
        per_batch = spark.sql(
            f"SELECT ingest_batch, count(1) AS n FROM {raw} GROUP BY ingest_batch ORDER BY ingest_batch"
        ).collect()
        appends = sorted((seq, at, rows) for at, rows, seq in self.batches.values() if rows)
        commits = {}
        for batch, (_, at, added) in zip(reversed(per_batch), reversed(appends), strict=False):
            if batch["n"] != added:
                raise AssertionError(
                    f"batch {batch['ingest_batch']} holds {batch['n']} rows; the snapshot paired "
                    f"with it added {added}"
                )
            commits[batch["ingest_batch"]] = at
        return commits

    def rows_since(self, since_ms: int) -> int:
        return sum(rows for at, rows, _ in self.batches.values() if at >= since_ms)

    def wait_for_rows(self, since_ms: int, n: int, timeout_s: float, what: str) -> None:
        """Until n rows were committed since `since_ms`; TimeoutError after `timeout_s`."""

        def sleep_then_poll(seconds: float) -> None:  # between two looks: the new snapshots
            time.sleep(seconds)
            self.poll()

        if not wait_until(lambda: self.rows_since(since_ms) >= n, timeout_s, 0.2, sleep=sleep_then_poll):
            raise TimeoutError(
                f"{what}: {self.rows_since(since_ms)} of {n} rows committed after {timeout_s:g} s"
            )

    def last_commit_ms(self) -> int:
        """When the latest snapshot that added rows was committed (0: none)."""
        return max((at for at, rows, _ in self.batches.values() if rows), default=0)


def spark_job_pids(fed: LocalFederation) -> list[int]:
    """The Spark job's processes (its Python and its JVM)."""
    return processes.marked_pids(processes.marker(fed.state_dir, SPARK_NODE))


# --- idle -----------------------------------------------------------------------------


def idle_cost(fed: LocalFederation, seconds: float) -> dict[str, Any]:
    """The job's CPU while no reading arrives for `seconds`: its micro-batch triggers finding
    nothing, its JVM's own threads.  The batches landed before are counted first (count-now),
    so the window holds no count of earlier readings."""
    counted = fed.count_aggregates_now(timeout=120) is not None
    job_pids = spark_job_pids(fed)
    progress(f"idle: the job watched for {seconds:g} s with no reading")
    cpu0, t0 = cpu_seconds(job_pids), time.perf_counter()
    time.sleep(seconds)
    cores = (cpu_seconds(job_pids) - cpu0) / (time.perf_counter() - t0)
    # counted_first False: the job did not answer the count in time, which may fall in the window
    return {
        "seconds": seconds,
        "job_cpu_cores": round(cores, 3),
        "goal_cores": IDLE_GOAL_CORES,
        "counted_first": counted,
    }


# --- freshness at a steady rate ------------------------------------------------------


def steady_publish(
    fed: LocalFederation,
    log: SnapshotLog,
    rate: float,
    seconds: float,
    devices: int,
    prefix: str = FRESH_PREFIX,
) -> dict[str, Any]:
    """Publish readings at `rate`/s for `seconds` from MQTT devices; wait until all landed."""
    ep = fed.endpoints()
    gw = ep["gateways"]["local-eu"]
    secrets = fed.add_devices([f"{prefix}{i}" for i in range(devices)], rotate=True)
    fleet = [SimDevice(d, gw["address"], gw["mqtt"], d, secret).connect() for d, secret in secrets.items()]
    job_pids = spark_job_pids(fed)
    log.poll()
    since_ms = int(time.time() * 1000)
    # every process's share of the machine: the job's freshness is what the others leave it
    roles = {**roles_pids(fed), "devices (the bench's MQTT clients)": [os.getpid()]}
    roles_cpu0 = {role: cpu_seconds(pids) for role, pids in roles.items()}
    t0 = time.perf_counter()
    rss_peak = 0.0
    infos = []
    n = int(rate * seconds)
    try:
        for i in range(n):
            d = fleet[i % devices]
            body = json.dumps({"ts": int(time.time() * 1000), "seq": i, "temp_c": 20 + i % 10}).encode()
            infos.append(d.publish_async(c.device_telemetry_topic(d.device_id), body))
            if i % int(rate) == 0:
                log.poll()
                rss_peak = max(rss_peak, rss_mb(job_pids))
                progress(f"freshness: {i}/{n} sent, {log.rows_since(since_ms)} rows committed")
            delay = t0 + (i + 1) / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        for info in infos:
            info.wait_for_publish(30)
        unacked = sum(1 for info in infos if not info.is_published())
        if unacked:
            raise RuntimeError(f"freshness: {unacked} of {n} readings got no PUBACK from the gateway")
        publish_s = time.perf_counter() - t0
        by_role = {
            role: round((cpu_seconds(pids) - roles_cpu0[role]) / publish_s, 2) for role, pids in roles.items()
        }
        log.wait_for_rows(since_ms, n, 180, "freshness")
    finally:
        for d in fleet:
            d.close()
    phases = batch_phases(fed, since_ms / 1000, since_ms / 1000 + publish_s)
    return {
        "sent": n,
        "rate_per_s": rate,
        "devices": devices,
        "publish_s": round(publish_s, 1),
        "job_cpu_cores": by_role[ROLE_SPARK],
        "cpu_cores_by_role": by_role,
        "job_rss_mb_peak": rss_peak,
        "batch_phases": phases,
    }


def batch_phases(fed: LocalFederation, start: float, end: float) -> dict[str, Any]:
    """The job's batches that began between `start` and `end` (epoch s), from its progress
    file's recent_batches: how many, their records, and per phase the median wall and CPU ms
    (spark/phases.py)."""
    job = fed.node(SPARK_NODE)
    assert isinstance(job, SparkNode)
    queries = job.progress().get("queries") or {}
    batches = [
        b for q in queries.values() for b in q.get("recent_batches") or [] if start <= b.get("at", 0) <= end
    ]
    return {
        "batches": len(batches),
        "records_median": median([b["records"] for b in batches]) if batches else None,
        "phases": median_phases(batches),
    }


def freshness_figures(
    spark: Any, raw: str, commits: dict[int, int], sent: int, prefix: str = FRESH_PREFIX
) -> dict[str, Any]:
    """Per row of the devices `prefix`*: the commit time of the snapshot that added its rows
    (`commits`, from SnapshotLog.commits_by_batch) - its device send time."""
    rows = spark.sql(
        f"""SELECT message_id, unix_millis(device_ts) AS ts_ms, latency_ms, ingest_batch
            FROM {raw} WHERE device LIKE '{prefix}%'"""
    ).collect()
    ids = {r["message_id"] for r in rows}
    if len(rows) != sent or len(ids) != sent:
        raise AssertionError(f"freshness: {sent} readings sent, {len(rows)} rows ({len(ids)} distinct)")
    missing = {r["ingest_batch"] for r in rows} - set(commits)
    if missing:
        raise AssertionError(f"freshness: batches {sorted(missing)} not seen committed")
    fresh = [commits[r["ingest_batch"]] - r["ts_ms"] for r in rows]
    to_kafka = [float(r["latency_ms"]) for r in rows if r["latency_ms"] is not None]
    return {
        "rows": len(rows),
        "freshness_p50_ms": percentile(fresh, 0.50),
        "freshness_p95_ms": percentile(fresh, 0.95),
        "freshness_max_ms": percentile(fresh, 1.0),
        "device_to_kafka_p50_ms": percentile(to_kafka, 0.50),
        "device_to_kafka_p95_ms": percentile(to_kafka, 0.95),
    }


# --- ingest rate on a backlog --------------------------------------------------------


def produce_records(
    bootstrap: str, topic: str, n: int, devices: int = 1000, prefix: str = BACKLOG_PREFIX
) -> None:
    """n records as the bridge writes them (headers and message id) from devices `prefix`*,
    device time now."""
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    received_at = str(int(time.time() * 1000)).encode()
    for i in range(n):
        dev = f"{prefix}{i % devices}"
        mqtt_topic = c.device_telemetry_topic(dev)
        payload = json.dumps({"ts": int(time.time() * 1000), "seq": i, "temp_c": 20 + i % 10}).encode()
        headers = [
            (c.KAFKA_REGION_HEADER, b"local-eu"),
            (c.KAFKA_MQTT_TOPIC_HEADER, mqtt_topic.encode()),
            (c.KAFKA_DEVICE_HEADER, dev.encode()),
            (c.KAFKA_RECEIVED_AT_HEADER, received_at),
            (c.KAFKA_MESSAGE_ID_HEADER, c.message_id(mqtt_topic, payload).encode()),
        ]
        while True:
            try:
                p.produce(topic, payload, dev.encode(), headers=headers)
                break
            except BufferError:
                p.poll(0.05)
        if i % 1000 == 0:
            p.poll(0)
    if p.flush(60) != 0:
        raise RuntimeError("backlog: Kafka did not confirm every record")


def topic_partitions(bootstrap: str, topic: str) -> int:
    consumer = kafka_read.throwaway_consumer(bootstrap, "bench-offsets")
    try:
        return len(kafka_read.partitions(consumer, topic))
    finally:
        consumer.close()


def python_consume(bootstrap: str, topic: str, total: int) -> float:
    """Records/s one confluent-kafka consumer reads the topic's `total` records at."""
    # assigned, not subscribed: a group join would only add seconds before the first record
    consumer = kafka_read.throwaway_consumer(bootstrap, "bench")
    kafka_read.assign_from_start(consumer, topic)
    got = 0
    t0 = time.perf_counter()
    deadline = time.monotonic() + 300
    try:
        while got < total:
            if time.monotonic() > deadline:
                raise TimeoutError(f"python consume: {got} of {total} records in 300 s")
            got += sum(1 for m in consumer.consume(1000, 1.0) if m.error() is None)
        return got / (time.perf_counter() - t0)
    finally:
        consumer.close()


def spark_batch(spark: Any, settings: Any, topic: str, out: Path) -> float:
    """Records/s of one Spark batch query doing the job's work on the same topic: its three
    tables from one read, as Parquet files."""
    from spark import transforms as tr
    from spark.tables import AGGREGATES

    t0 = time.perf_counter()
    records = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", settings.kafka_bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("includeHeaders", "true")
        .load()
    )
    decoded = tr.decode_kafka(
        records, c.KAFKA_UNMATCHED_TOPIC, c.KAFKA_DEADLETTER_TOPIC, settings.max_payload_bytes
    )
    raw = tr.raw_rows(decoded).persist()
    raw.write.mode("overwrite").partitionBy("date", "region").parquet(str(out / "telemetry_raw"))
    for aggregate in AGGREGATES:
        target = str(out / aggregate.table.name)
        aggregate.transform(raw).write.mode("overwrite").partitionBy("date").parquet(target)
    raw.unpersist()
    elapsed = time.perf_counter() - t0
    n = spark.read.parquet(str(out / "telemetry_raw")).count()
    return n / elapsed


def last_ingest_batch(settings: Any, device_prefix: str) -> int:
    """The micro-batch that landed the last of these devices' rows in telemetry_raw."""
    from spark.reading import open_catalog

    table = open_catalog(settings).load_table(f"{settings.namespace}.telemetry_raw")
    scan = table.scan(row_filter=f"device LIKE '{device_prefix}%'", selected_fields=("ingest_batch",))
    return max(scan.to_arrow().column("ingest_batch").to_pylist())


def burst(
    fed: LocalFederation,
    spark: Any,
    log: SnapshotLog,
    aggregates: SnapshotLog,
    n: int,
    *,
    prefix: str = BURST_PREFIX,
    job_paused: bool = False,
) -> dict[str, Any]:
    """Produce n records into the running job's topic at once; time until it has landed them
    all in telemetry_raw, and until the aggregates' refresh that counts the last of them.

    `job_paused`: the job's processes are stopped (SIGSTOP) while the records are produced
    and the clock starts when they go on (SIGCONT) -- a backlog waiting in Kafka, like the
    references' records, read by a warm job that had stalled.  A few readings land first,
    so that the job stalls after a small batch, as one at a steady rate does (it plans a
    batch like the one before: spark.job.interpreted_for).  Otherwise the clock starts
    with the first record produced, and the job reads them as they come (and shares the
    cores with the bench's producer)."""
    from spark.tables import Catalog

    bootstrap = fed.endpoints()["kafka"]["bootstrap"]
    settings = fed.spark_settings()
    job_pids = roles_pids(fed)[ROLE_SPARK]
    log.poll()
    if job_paused:
        _land_a_few(bootstrap, log)
    t0 = time.time()
    if job_paused:
        for pid in job_pids:
            os.kill(pid, signal.SIGSTOP)
    try:
        produce_records(bootstrap, c.KAFKA_TELEMETRY_TOPIC, n, prefix=prefix)
        produced_s = time.time() - t0
    finally:
        if job_paused:
            t0 = time.time()
            for pid in job_pids:
                os.kill(pid, signal.SIGCONT)
    since_ms = int(t0 * 1000)
    landed, last_batch = 0, None

    def counted() -> bool:
        nonlocal landed, last_batch
        log.poll()
        landed = log.rows_since(since_ms)
        if landed < n:
            return False
        # a refresh counts the batches since the one before, beside the next batches
        last_batch = last_batch if last_batch is not None else last_ingest_batch(settings, prefix)
        return Catalog(spark, settings).refreshed_through() >= last_batch

    def report_then_sleep(seconds: float) -> None:
        progress(f"ingest: {landed}/{n} rows in telemetry_raw")
        time.sleep(seconds)

    if not wait_until(counted, 900, 0.5, sleep=report_then_sleep):
        raise TimeoutError(
            f"ingest: {landed} of {n} rows landed, batch {last_batch} not counted, after 900 s"
        )
    aggregates.poll()  # its latest snapshot: that refresh's last commit
    raw_s = log.last_commit_ms() / 1000 - t0
    all_s = aggregates.last_commit_ms() / 1000 - t0
    return {
        "records": n,
        "produced_s": round(produced_s, 1),
        "raw_rows_per_s": round(n / raw_s),
        "raw_s": round(raw_s, 1),
        "all_tables_rows_per_s": round(n / all_s),
        "all_tables_s": round(all_s, 1),
    }


def _land_a_few(bootstrap: str, log: SnapshotLog, n: int = 600) -> None:
    """n readings (a steady batch's worth at 300/s) into the job, until they are landed."""
    since_ms = int(time.time() * 1000)
    produce_records(bootstrap, c.KAFKA_TELEMETRY_TOPIC, n, devices=30, prefix=STEADY_PREFIX)
    log.wait_for_rows(since_ms, n, 60, "ingest, before the stall")


def check_backlog_rows(spark: Any, raw: str, n: int, prefix: str) -> None:
    counts = (
        spark.table(raw)
        .where(f"device LIKE '{prefix}%'")
        .selectExpr("count(*) AS rows", "count(DISTINCT message_id) AS ids")
        .collect()[0]
    )
    if counts["rows"] != n or counts["ids"] != n:
        raise AssertionError(
            f"ingest: {n} records produced, {counts['rows']} rows ({counts['ids']} distinct)"
        )


# --- the run ---------------------------------------------------------------------------


def steady_seconds(settings: Any) -> float:
    """The full run's steady window: two of the job's compaction cycles (at least a minute).
    A batch's MERGE slows as small files gather between two compactions and is quick again
    after one: a window shorter than a cycle reports wherever in the sawtooth it fell."""
    return max(60.0, 2 * float(settings.compact_interval_s))


SERVICES = {"routers": True, "spark": True}


def run(fed: LocalFederation, workdir: Path, quick: bool = False) -> dict[str, Any]:
    settings = fed.spark_settings()
    rate, seconds, devices = (100.0, 8.0, 10) if quick else (300.0, steady_seconds(settings), 30)
    warmup_s = 3.0 if quick else WARMUP_S
    n_backlog = BACKLOG["quick" if quick else "full"]
    repeats = REPEATS["quick" if quick else "full"]
    results: dict[str, Any] = {"quick": quick, "machine": {"cpus": os.cpu_count()}}
    log = SnapshotLog(settings)
    # a refresh commits region_minute last (spark.tables.AGGREGATES)
    last_table = SnapshotLog(settings, "region_minute")
    bootstrap = fed.endpoints()["kafka"]["bootstrap"]

    progress(f"freshness: {rate:g} readings/s for {seconds:g} s from {devices} MQTT devices")
    # the job's first minutes compile its plans and warm the JVM: reported apart, as its cold start
    results["first_minutes"] = steady_publish(fed, log, rate, warmup_s, devices, prefix=WARMUP_PREFIX)
    results["steady"] = steady_publish(fed, log, rate, seconds, devices)
    # the rate the army bench's goals are held at: the tables' freshness there too
    step_rate, step_s, step_devices = ARMY_STEP["quick" if quick else "full"]
    progress(f"freshness: {step_rate:g} readings/s for {step_s:g} s from {step_devices} MQTT devices")
    results["army_step"] = steady_publish(fed, log, step_rate, step_s, step_devices, prefix=STEP_PREFIX)
    results["idle"] = idle_cost(fed, IDLE_S["quick" if quick else "full"])

    progress(f"reference: {n_backlog} bridge records into {REFERENCE_TOPIC}")
    # as many partitions as the bridge's topics, so that Spark reads both with the same parallelism
    partitions = topic_partitions(bootstrap, c.KAFKA_TELEMETRY_TOPIC)
    ensure_topics(bootstrap, [REFERENCE_TOPIC], partitions, 1)
    topic_end(bootstrap, REFERENCE_TOPIC)  # returns once every partition has its leader
    produce_records(bootstrap, REFERENCE_TOPIC, n_backlog)
    progress("reference: one Python consumer reading them")
    results["python_consume_per_s"] = round(python_consume(bootstrap, REFERENCE_TOPIC, n_backlog))

    from spark.session import build_session
    from spark.tables import RAW, Catalog

    spark = build_session(settings, "fedgate-bench")
    raw = Catalog(spark, settings).name(RAW)
    try:
        progress(f"reference: one Spark batch query doing the job's work (cold, then {repeats} warm)")
        runs = [
            round(spark_batch(spark, settings, REFERENCE_TOPIC, workdir / "spark-batch-ref"))
            for _ in range(1 + repeats)
        ]
        results["spark_batch_cold_per_s"] = runs[0]
        results["spark_batch_warm_runs"] = runs[1:]
        results["spark_batch_per_s"] = round(median(runs[1:]))
        progress(f"ingest: a burst of {n_backlog} records into the running job")
        results["burst"] = burst(fed, spark, log, last_table, n_backlog)
        check_backlog_rows(spark, raw, n_backlog, BURST_PREFIX)
        backlogs = []
        for i in range(repeats):
            progress(
                f"ingest: {n_backlog} records waiting in Kafka while the job is stopped (SIGSTOP), "
                f"{i + 1} of {repeats}"
            )
            prefix = f"{BACKLOG_PREFIX}{i}-"
            backlogs.append(burst(fed, spark, log, last_table, n_backlog, prefix=prefix, job_paused=True))
            check_backlog_rows(spark, raw, n_backlog, prefix)
        results["ingest_runs"] = [b["all_tables_rows_per_s"] for b in backlogs]
        results["ingest"] = median_backlog(backlogs)
        commits = log.commits_by_batch(spark, raw)  # one scan of the table serves all three
        results["steady"].update(freshness_figures(spark, raw, commits, results["steady"]["sent"]))
        first = results["first_minutes"]
        first.update(freshness_figures(spark, raw, commits, first["sent"], prefix=WARMUP_PREFIX))
        step = results["army_step"]
        step.update(freshness_figures(spark, raw, commits, step["sent"], prefix=STEP_PREFIX))
    finally:
        spark.stop()
    ing = results["ingest"]
    results["job_vs_spark_batch"] = round(ing["all_tables_rows_per_s"] / results["spark_batch_per_s"], 3)
    results["burst_vs_spark_batch"] = round(
        results["burst"]["all_tables_rows_per_s"] / results["spark_batch_per_s"], 3
    )
    results["raw_vs_python_consume"] = round(ing["raw_rows_per_s"] / results["python_consume_per_s"], 3)
    return results


def to_markdown(r: dict[str, Any]) -> str:
    s, ing, b, w = r["steady"], r["ingest"], r["burst"], r["first_minutes"]
    a = r["army_step"]
    return "\n".join(
        [
            f"# Spark benchmark ({'quick' if r['quick'] else 'full'}, {r['machine']['cpus']} cores)",
            "",
            f"Freshness at a steady {s['rate_per_s']:g} readings/s from {s['devices']} MQTT devices "
            f"({s['sent']} readings, every one landed once):",
            "",
            "| device send -> | p50 ms | p95 ms | max ms |",
            "|---|---:|---:|---:|",
            f"| Kafka (the row's latency_ms) | {s['device_to_kafka_p50_ms']} | "
            f"{s['device_to_kafka_p95_ms']} | |",
            f"| **row queryable** (batch committed) | **{s['freshness_p50_ms']}** | "
            f"**{s['freshness_p95_ms']}** | {s['freshness_max_ms']} |",
            f"| row queryable in the job's first {w['publish_s']:g} s (a new JVM, same rate) | "
            f"{w['freshness_p50_ms']} | {w['freshness_p95_ms']} | {w['freshness_max_ms']} |",
            f"| row queryable at {a['rate_per_s']:g} readings/s for {a['publish_s']:g} s from "
            f"{a['devices']} devices (the job {a['job_cpu_cores']} cores) | {a['freshness_p50_ms']} | "
            f"{a['freshness_p95_ms']} | {a['freshness_max_ms']} |",
            "",
            f"The job meanwhile: {s['job_cpu_cores']} cores (in its first minutes: "
            f"{w['job_cpu_cores']}), peak RSS {s['job_rss_mb_peak']} MB. "
            f"CPU cores of every kind of process while the readings were sent (of {r['machine']['cpus']}): "
            + ", ".join(f"{role} {cores}" for role, cores in s["cpu_cores_by_role"].items())
            + f" (sum {sum(s['cpu_cores_by_role'].values()):.2f}).",
            "",
            *phase_lines(s.get("batch_phases") or {}),
            f"Idle, no reading for {r['idle']['seconds']:g} s after the steady rate ("
            + (
                "its batches counted first"
                if r["idle"]["counted_first"]
                else "the count asked first unanswered"
            )
            + f"): the job {r['idle']['job_cpu_cores']} cores "
            f"(goal <= {r['idle']['goal_cores']:g}).",
            "",
            f"Ingest of {ing['records']:,} records waiting in Kafka (produced in {ing['produced_s']} s "
            "while the job was stopped with SIGSTOP; the clock runs from its SIGCONT):",
            "",
            "| | records/s | job / this |",
            "|---|---:|---:|",
            "| reference: one Python consumer (confluent-kafka), read only | "
            f"{r['python_consume_per_s']:,} | {r['raw_vs_python_consume']} |",
            "| reference: one Spark batch query, the job's work as Parquet (warm, the median of "
            f"{_runs(r['spark_batch_warm_runs'])}; cold: {r['spark_batch_cold_per_s']:,}) | "
            f"{r['spark_batch_per_s']:,} | {r['job_vs_spark_batch']} |",
            f"| **job: rows landed in all tables** (Iceberg, exactly once; the median backlog of "
            f"{_runs(r['ingest_runs'])}) | **{ing['all_tables_rows_per_s']:,}** | 1 |",
            f"| job, the same count produced into it as it runs (the clock from the first record; "
            f"produced in {b['produced_s']} s) | {b['all_tables_rows_per_s']:,} | "
            f"{r['burst_vs_spark_batch']} of the Spark batch |",
            "",
            f"The last row was queryable in telemetry_raw {ing['raw_s']} s after the job went on "
            f"({ing['raw_rows_per_s']:,} rows/s), in the aggregates {ing['all_tables_s']} s after; "
            f"produced into the running job: {b['raw_s']} s and {b['all_tables_s']} s "
            "after the first record.",
            "",
        ]
    )


def median_backlog(backlogs: list[dict[str, Any]]) -> dict[str, Any]:
    """The backlog of the median all-tables rate, whole: its raw and all-tables times belong
    together (of an even count, the faster of the middle two)."""
    return sorted(backlogs, key=lambda b: b["all_tables_rows_per_s"])[len(backlogs) // 2]


def _runs(values: list[int]) -> str:
    return ", ".join(f"{v:,}" for v in values)


def phase_lines(p: dict[str, Any]) -> list[str]:
    """The steady batches' phases as a table (spark/phases.py), or nothing before any."""
    if not p.get("batches"):
        return []
    lines = [
        f"A steady batch, by phase (medians of the {p['batches']} batches that began while the "
        f"readings were sent, {p['records_median']:g} records each; CPU: the job's JVM and driver, "
        "whatever ran beside the phase included):",
        "",
        "| phase | wall ms | CPU ms | batches |",
        "|---|---:|---:|---:|",
    ]
    for name, v in p["phases"].items():
        lines.append(f"| {name} | {v['wall_ms']:g} | {v.get('cpu_ms', '')} | {v['batches']} |")
    return [*lines, ""]
