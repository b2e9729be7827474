"""One local SparkSession (no Kafka) for the Spark unit tests; marked `spark`, they need Java."""

from __future__ import annotations

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
    )


@pytest.fixture(scope="session")
def spark(spark_settings) -> Iterator[SparkSession]:
    from spark.session import build_session

    session = build_session(spark_settings, "fedgate-unit", kafka=False)
    yield session
    session.stop()
