"""One local SparkSession (no Kafka) for the Spark unit tests; marked `spark`, they need Java."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark_settings(tmp_path_factory: pytest.TempPathFactory):
    from spark.settings import SparkSettings

    return SparkSettings(
        kafka_bootstrap="-",
        warehouse=str(tmp_path_factory.mktemp("wh")),
        master="local[1]",
        shuffle_partitions=1,
        java_options=os.environ["FEDGATE_SPARK_JAVA_OPTIONS"],  # tests/conftest.py TEST_JVM_OPTIONS
    )


@pytest.fixture(scope="package")
def spark(spark_settings) -> Iterator[SparkSession]:
    """Stopped after this package's last test: a SparkSession left running would be the one
    the next build_session in the process gets back (getOrCreate), with this package's
    catalog -- the benchmarks' quick run, later in the same lane, found no tables in it."""
    from spark.session import build_session

    session = build_session(spark_settings, "fedgate-unit", kafka=False)
    yield session
    session.stop()
