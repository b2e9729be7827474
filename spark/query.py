"""Analysts' entry points: Spark SQL over the tables, named queries, the batch recompute.

fedgate query "SELECT region, sum(messages) FROM region_minute GROUP BY region"
fedgate query top-talkers
fedgate recompute --since 2026-11-20 --until 2026-11-21
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

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
def session(settings: SparkSettings) -> Iterator[SparkSession]:
    """A session in the tables' namespace (each query reads their latest commits); stopped on leaving."""
    spark = build_session(settings, "fedgate-query", kafka=False)
    try:
        use_tables(spark, settings)
        yield spark
    finally:
        spark.stop()


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
        df = aggregate.transform(raw).persist()
        counts[aggregate.table.name] = df.count()
        catalog.replace_dates(aggregate.table, df, dates)
        df.unpersist()
    return counts


def describe_named() -> str:
    return "\n".join(f"  {name:18} {doc}" for name, (doc, _) in NAMED_QUERIES.items())
