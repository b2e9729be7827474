"""The Spark job's Prometheus metrics, served by its driver on `metrics_port` (/metrics).

What an operator watches the tables by: how many batches and rows landed, how long a batch
took, how fresh the tables are (the time from a batch's oldest record reaching Kafka to its
rows being queryable, and when telemetry_raw last committed), and how far the query is
behind Kafka.  Counted once per micro-batch, beside the progress file (progress.json).
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

#: Upper bounds (s) of a batch's duration and of its freshness: seconds at a steady rate, minutes
#: for a backlog.
BATCH_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
#: the least freshness objective (s): a target of 0 (no pacing) or 2 s still leaves room for
#: a batch that plans slowly
MIN_OBJECTIVE_S = 10.0
FRESHNESS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class JobMetrics:
    """The job's series, on a registry of their own (with the driver process's)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.batches = Counter(
            "fedgate_spark_batches",
            "Micro-batches landed in the tables (one commit per table each).",
            registry=r,
        )
        self.rows = Counter(
            "fedgate_spark_records",
            "Kafka records a batch landed, per table: telemetry_raw (copies of a stored message "
            "included: the MERGE keeps one) and rejects.",
            ["table"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            "fedgate_spark_batch_seconds",
            "A micro-batch from its start to its last table's commit (the pause after it not counted).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.freshness = Histogram(
            "fedgate_spark_freshness_seconds",
            "Per micro-batch, from its oldest record reaching Kafka to its rows being queryable in "
            "telemetry_raw: what the tables' freshness objective is made of.",
            buckets=FRESHNESS_BUCKETS,
            registry=r,
        )
        self.objective = Gauge(
            "fedgate_spark_freshness_objective_seconds",
            "The freshness the tables are held to: twice the job's freshness_target_s, at least 10 s "
            "(FedgateTablesFreshnessHigh fires when the p95 of fedgate_spark_freshness_seconds is over it).",
            registry=r,
        )
        self.last_commit = Gauge(
            "fedgate_spark_last_commit_timestamp_seconds",
            "When telemetry_raw last committed a micro-batch's rows (Unix time).",
            registry=r,
        )
        self.behind = Gauge(
            "fedgate_spark_records_behind",
            "Kafka records the query had not read when its last batch began, over every topic partition.",
            registry=r,
        )
        # the driver process's CPU and memory (the JVM's are its child's)
        ProcessCollector(registry=r)

    def hold_to(self, freshness_target_s: float) -> None:
        """The job's pacing target gives the objective its alert reads."""
        self.objective.set(max(2 * freshness_target_s, MIN_OBJECTIVE_S))

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on `host`:`port` (a daemon thread of prometheus_client's)."""
        # the job's process serves only these: no `_created` series beside each counter
        disable_created_metrics()
        start_http_server(port, addr=host, registry=self.registry)

    def landed(self, raw: int, rejects: int, took_s: float, oldest_kafka_s: float | None, now: float) -> None:
        """A micro-batch landed (its telemetry_raw commit at `now`, Unix time)."""
        self.batches.inc()
        self.rows.labels(table="telemetry_raw").inc(raw)
        self.rows.labels(table="rejects").inc(rejects)
        self.batch_seconds.observe(took_s)
        if oldest_kafka_s is not None:
            self.freshness.observe(max(0.0, now - oldest_kafka_s))
        if raw:
            self.last_commit.set(now)

    def progressed(self, progress: dict[str, Any]) -> None:
        """The query's last progress (Spark's StreamingQueryProgress as JSON)."""
        behind = records_behind(progress)
        if behind is not None:
            self.behind.set(behind)


def records_behind(progress: dict[str, Any]) -> float | None:
    """The records not read yet when the batch began, from the Kafka source's own metrics:
    the mean per partition (avgOffsetsBehindLatest) times the partitions its end offsets name."""
    total = None
    for source in progress.get("sources") or []:
        metrics = source.get("metrics") or {}
        if "avgOffsetsBehindLatest" not in metrics:
            continue
        end = source.get("endOffset")
        if isinstance(end, str):
            end = json.loads(end) if end.startswith("{") else {}
        partitions = sum(len(p) for p in (end or {}).values())
        total = (total or 0.0) + float(metrics["avgOffsetsBehindLatest"]) * partitions
    return total
