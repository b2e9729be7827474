"""Analysts' entry points: Spark SQL over the tables, named queries, the batch recompute.

fedgate query "SELECT region, sum(messages) FROM region_minute GROUP BY region"
fedgate query top-talkers
fedgate recompute --since 2026-11-20 --until 2026-11-21
"""

from __future__ import annotations

import datetime as dt
import json
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from backend.errors import FedgateError
from spark.session import build_session
from spark.settings import SparkSettings
from spark.tables import AGGREGATES, RAW, Catalog, use_tables

#: name -> (what it answers, SQL)
NAMED_QUERIES: dict[str, tuple[str, str]] = {
    "top-talkers": (
        "devices that sent the most messages in the last hour",
        """SELECT device, region, count(*) AS messages, max(event_time) AS last_seen
           FROM telemetry_raw
           WHERE event_time >= current_timestamp() - INTERVAL 1 HOUR
           GROUP BY device, region ORDER BY messages DESC, device LIMIT 10""",
    ),
    "silent-devices": (
        "devices seen in the last day but silent for the last 5 minutes",
        """SELECT device, max_by(region, event_time) AS region, max(event_time) AS last_seen
           FROM telemetry_raw
           WHERE event_time >= current_timestamp() - INTERVAL 1 DAY
           GROUP BY device
           HAVING max(event_time) < current_timestamp() - INTERVAL 5 MINUTES
           ORDER BY last_seen""",
    ),
    "latency-by-region": (
        "device -> Kafka latency per region over the last hour (p50/p95/p99 of the minutes)",
        """SELECT region, sum(messages) AS messages, max(devices) AS peak_devices,
                  round(percentile(latency_p50_ms, 0.5), 1) AS p50_ms,
                  round(max(latency_p95_ms), 1) AS worst_p95_ms,
                  round(max(latency_p99_ms), 1) AS worst_p99_ms
           FROM region_minute
           WHERE minute >= current_timestamp() - INTERVAL 1 HOUR
           GROUP BY region ORDER BY region""",
    ),
    "rejects": (
        "records that did not become rows, by reason",
        """SELECT reason, count(*) AS records, max(kafka_ts) AS latest
           FROM rejects GROUP BY reason ORDER BY records DESC""",
    ),
}


@contextmanager
def session(settings: SparkSettings, *, remote: bool | None = None) -> Iterator[SparkSession]:
    """A session in the tables' namespace (each query reads their latest commits); stopped on
    leaving.  The running job's own, over Spark Connect, when it serves one (settings
    `connect_port`): an answer in about a second instead of a Spark start of ten; else a
    Spark of this process.  `remote` True: the job's or an error; False: this process's."""
    spark = job_session(settings) if remote is not False else None
    if remote and spark is None:
        raise QueryError(f"the Spark job serves no session at {settings.bind_host}:{settings.connect_port}")
    if spark is None:
        spark = build_session(settings, "fedgate-query", kafka=False)
        use_tables(spark, settings)
    else:
        spark.sql(f"USE {settings.catalog}.{settings.namespace}")  # the job created the tables
    try:
        yield spark
    finally:
        spark.stop()  # for the job's session: this client's only


def is_remote(spark: SparkSession) -> bool:
    """True for a Spark Connect session (the job's), False for a Spark of this process."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


class QueryError(FedgateError):
    pass


def job_session(settings: SparkSettings) -> SparkSession | None:
    """A Spark Connect session of the running job, or None when its port does not answer."""
    if not settings.connect_port:
        return None
    host = "127.0.0.1" if settings.bind_host in ("0.0.0.0", "") else settings.bind_host
    try:
        socket.create_connection((host, settings.connect_port), timeout=1).close()
    except OSError:
        return None
    # Spark Connect's own builder: pyspark's generic one marks the whole process as a Spark
    # Connect one (SPARK_CONNECT_MODE_ENABLED), and every later local session fails
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    remote = ConnectSession.builder.remote(f"sc://{host}:{settings.connect_port}").create()
    return cast(SparkSession, remote)


def run_sql(spark: SparkSession, sql: str, limit: int = 100) -> tuple[list[str], list[tuple[Any, ...]]]:
    name = sql.strip()
    if name in NAMED_QUERIES:
        sql = NAMED_QUERIES[name][1]
    df = spark.sql(sql)
    rows = [tuple(r) for r in df.limit(limit).collect()]
    return df.columns, rows


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "NULL"
        if isinstance(v, float):
            return f"{v:.3f}".rstrip("0").rstrip(".") if v == v else "NaN"
        if isinstance(v, dt.datetime):
            return v.strftime("%Y-%m-%d %H:%M:%S")
        return str(v)

    text = [[cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in text]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in text:
        out.append(
            "  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(r, widths, strict=True))
        )
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def _numeric(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def to_json(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    return json.dumps([dict(zip(columns, r, strict=True)) for r in rows], default=str, indent=2)


def recompute(spark: SparkSession, settings: SparkSettings, since: dt.date, until: dt.date) -> dict[str, int]:
    """Rebuild device_minute and region_minute for [since, until] from telemetry_raw.

    After a fix to a transform: the streaming job computes a minute again only when a
    reading of that minute lands.  Running it for today while the job runs can race
    with the job's next commit to the aggregates: stop the job or leave today out.
    """
    catalog = Catalog(spark, settings)
    raw = catalog.read(RAW).where(F.col("date").between(F.lit(since), F.lit(until)))
    dates = [since + dt.timedelta(days=i) for i in range((until - since).days + 1)]
    counts = {}
    for aggregate in AGGREGATES:
        # only the batches the aggregate counts already: those after its mark are the job's
        # to add (its refresh), and counting them here would move the mark past their rows
        # of other dates
        counted = F.col("ingest_batch") <= catalog.counted_through(aggregate.table)
        df = aggregate.transform(raw.where(F.col("ingest_batch").isNull() | counted)).persist()
        counts[aggregate.table.name] = df.count()
        catalog.replace_dates(aggregate.table, df, dates)
        df.unpersist()
    return counts


def describe_named() -> str:
    return "\n".join(f"  {name:18} {doc}" for name, (doc, _) in NAMED_QUERIES.items())
