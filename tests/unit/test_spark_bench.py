"""The Spark benchmark's figures from several runs (bench/spark_bench.py): the quick run in
make test times one backlog, so what picks the median of three is checked here."""

from __future__ import annotations

from bench.spark_bench import median_backlog


def test_the_median_backlog_is_reported_whole():
    runs = [
        {"all_tables_rows_per_s": 34_855, "raw_s": 7.4, "all_tables_s": 8.6},
        {"all_tables_rows_per_s": 33_172, "raw_s": 7.9, "all_tables_s": 9.0},
        {"all_tables_rows_per_s": 33_678, "raw_s": 7.7, "all_tables_s": 8.9},
    ]
    assert median_backlog(runs) is runs[2], "the middle rate, with its own raw and all-tables times"
    assert median_backlog(runs[:1]) is runs[0]
