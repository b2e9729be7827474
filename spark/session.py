"""One place that builds a SparkSession for the job, the batch recompute and queries."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from pyspark.sql import SparkSession

from backend.errors import FedgateError
from spark.settings import SparkSettings

LOG4J_CONFIG = Path(__file__).resolve().parent / "log4j2.properties"


class SparkSetupError(FedgateError):
    pass


def kafka_jars(settings: SparkSettings) -> list[str]:
    jars = sorted(glob.glob(os.path.join(settings.jars_dir, "*.jar")))
    if not any("spark-sql-kafka" in j for j in jars):
        raise SparkSetupError(
            f"Spark's Kafka source is not in {settings.jars_dir}: run `make setup` (it fetches the jars)"
        )
    return jars


def build_session(settings: SparkSettings, app: str, *, kafka: bool = True) -> SparkSession:
    """A session configured for fedgate's tables.

    ANSI mode is off on purpose: device payloads are untrusted, and under ANSI
    a single bad cast would fail the whole micro-batch and stop the job; the
    transforms turn bad values into NULL plus a parse_error instead.
    """
    # the driver binds where it is told, not to whatever the host name resolves to
    os.environ.setdefault("SPARK_LOCAL_IP", settings.bind_host)
    builder = (
        SparkSession.builder.appName(app)
        .master(settings.master)
        .config("spark.driver.memory", settings.driver_memory)
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG}")
        .config("spark.driver.host", settings.bind_host)
        .config("spark.driver.bindAddress", settings.bind_host)
        .config("spark.driver.port", str(settings.driver_port))
        .config("spark.blockManager.port", str(settings.block_manager_port))
        .config("spark.ui.enabled", "true" if settings.ui_port else "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.ansi.enabled", "false")
        # a device's JSON or headers may repeat a key: the last wins instead of failing the batch
        .config("spark.sql.mapKeyDedupPolicy", "LAST_WIN")
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
        # dedupe state can hold millions of message ids: RocksDB keeps them off the heap
        .config(
            "spark.sql.streaming.stateStore.providerClass",
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        )
        # a commit writes the batch's changes, not a snapshot of the store (snapshots are made in
        # the background); works on checkpoints written without it
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        .config("spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.parquet.compression.codec", "zstd")
    )
    if settings.ui_port:
        builder = builder.config("spark.ui.port", str(settings.ui_port))
    if kafka:
        builder = builder.config("spark.jars", ",".join(kafka_jars(settings)))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
