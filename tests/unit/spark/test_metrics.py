"""The Spark job's Prometheus series (spark/metrics.py), as a scrape reads them."""

from __future__ import annotations

import json

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spark.metrics import JobMetrics, records_behind


def _samples(m: JobMetrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in s.labels.items())
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_a_landed_batch_counts_its_records_time_and_freshness():
    m = JobMetrics()
    m.landed(raw=980, rejects=3, took_s=0.8, oldest_kafka_s=1_000.0, now=1_004.5)
    m.landed(raw=0, rejects=0, took_s=0.1, oldest_kafka_s=None, now=1_010.0)  # an empty batch
    got = _samples(m)
    assert got["fedgate_spark_batches_total"] == 2
    assert got["fedgate_spark_records_total{table=telemetry_raw}"] == 980
    assert got["fedgate_spark_records_total{table=rejects}"] == 3
    assert got["fedgate_spark_freshness_seconds_count"] == 1
    assert got["fedgate_spark_freshness_seconds_sum"] == 4.5
    assert got["fedgate_spark_freshness_seconds_bucket{le=4.0}"] == 0
    assert got["fedgate_spark_freshness_seconds_bucket{le=5.0}"] == 1
    # the last batch that landed rows, not the empty one after it
    assert got["fedgate_spark_last_commit_timestamp_seconds"] == 1_004.5


def test_records_behind_sums_the_kafka_sources_lag_over_its_partitions():
    progress = {
        "sources": [
            {
                "endOffset": json.dumps(
                    {"telemetry.telemetry": {"0": 10, "1": 12}, "fedgate.deadletter": {"0": 1}}
                ),
                "metrics": {"avgOffsetsBehindLatest": "40.0", "maxOffsetsBehindLatest": "100"},
            }
        ]
    }
    assert records_behind(progress) == 120.0
    assert records_behind({}) is None
    m = JobMetrics()
    m.progressed(progress)
    assert _samples(m)["fedgate_spark_records_behind"] == 120.0


def test_the_freshness_objective_is_twice_the_target_and_never_under_ten_seconds():
    m = JobMetrics()
    m.hold_to(4.0)
    assert _samples(m)["fedgate_spark_freshness_objective_seconds"] == 10.0
    m.hold_to(8.0)
    assert _samples(m)["fedgate_spark_freshness_objective_seconds"] == 16.0
