"""The Spark job's typed settings, from a TOML file and FEDGATE_SPARK_* variables.

The same settings drive the local job (rendered by `fedgate up` into
state/nodes/spark/spark.toml) and a job submitted to a cluster: point
`master` at the cluster and `warehouse`/`checkpoints` at shared storage.

    # spark.toml
    kafka_bootstrap = "127.0.0.1:17010"
    master = "local[2]"
    warehouse = "/data/fedgate/warehouse"
    topics = "energy.power,energy.total,fedgate.deadletter,fedgate.unmatched,telemetry.events,..."

The job reads exactly the Kafka topics the router's mapping rules produce,
plus its catch-all and dead-letter topics: `router.topics.kafka_topics` says
which, and whoever deploys the job writes them into `topics` (the local
driver from the same [router] table the routers get).  Spark never imports
the router, so it has no default list of its own.
"""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from backend import contract as c
from backend.errors import FedgateError
from backend.kafka_security import KafkaSecurity, KafkaSecurityError
from backend.settings_layers import coerce, read_layers

PROJECT_ROOT = Path(__file__).resolve().parent.parent

#: Spark's Kafka source, Iceberg's Spark runtime and the SQLite JDBC driver: what pyspark does not ship;
#: `make setup` puts them here (infra/setup/spark-pom.xml).
SPARK_JARS = "jars/spark-4.0.0"


def default_jars_dir() -> str:
    cache = Path(os.environ.get("FEDGATE_CACHE_DIR", PROJECT_ROOT / ".cache"))
    return str(cache / SPARK_JARS)


class SparkSettingsError(FedgateError, ValueError):
    pass


_KAFKA_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")


@dataclass(frozen=True)
class SparkSettings:
    kafka_bootstrap: str = field(metadata={"doc": "Kafka bootstrap servers."})
    warehouse: str = field(
        metadata={
            "doc": "Folder (or s3a://bucket/path, hdfs://) holding the Iceberg tables' data and metadata."
        }
    )
    # how the job's Kafka client authenticates (backend/kafka_security.py)
    kafka_security_protocol: str = field(
        default="PLAINTEXT", metadata={"doc": "PLAINTEXT, SSL or SASL_SSL (MSK: SASL_SSL)."}
    )
    kafka_sasl_mechanism: str = field(
        default="SCRAM-SHA-512", metadata={"doc": "SCRAM-SHA-512 or SCRAM-SHA-256."}
    )
    kafka_sasl_username: str = field(default="", metadata={"doc": "SCRAM user."})
    kafka_sasl_password: str = field(default="", metadata={"doc": "SCRAM password."})
    kafka_ca_file: str = field(
        default="", metadata={"doc": "PEM CA of the brokers (empty: the JVM's trust store)."}
    )
    catalog_uri: str = field(
        default="",
        metadata={
            "doc": "JDBC URL of the Iceberg catalog that names the tables; default a SQLite file "
            "<warehouse>/catalog.db (a local warehouse only: elsewhere, a shared database: "
            "jdbc:postgresql://host:5432/db, e.g. on RDS)."
        },
    )
    catalog_user: str = field(default="", metadata={"doc": "The catalog database's user (PostgreSQL)."})
    catalog_password: str = field(
        default="", metadata={"doc": "The catalog database's password (FEDGATE_SPARK_CATALOG_PASSWORD)."}
    )
    catalog: str = field(default="fedgate", metadata={"doc": "The Iceberg catalog's name in Spark SQL."})
    namespace: str = field(default="telemetry", metadata={"doc": "The catalog namespace of the tables."})
    checkpoints: str = field(
        default="",
        metadata={"doc": "Streaming checkpoints; default <warehouse>/_checkpoints. Keep with the tables."},
    )
    s3_endpoint: str = field(
        default="",
        metadata={
            "doc": "S3 endpoint URL for s3a:// warehouses and checkpoints when not AWS's own (MinIO, "
            "moto: http://host:port, path-style).  Credentials come from AWS's usual chain "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, an instance profile), never from this file."
        },
    )
    s3_region: str = field(
        default="", metadata={"doc": "The S3 bucket's region (empty: the AWS SDK's default chain)."}
    )
    master: str = field(default="local[2]", metadata={"doc": "Spark master URL."})
    jars_dir: str = field(
        default_factory=default_jars_dir, metadata={"doc": "Folder of the Kafka source and Iceberg jars."}
    )
    topics: tuple[str, ...] = field(
        default=(),
        metadata={
            "doc": "Kafka topics the job reads (comma-separated): exactly those the router's rules produce, "
            "with the catch-all and dead-letter topics (router.topics.kafka_topics). The job needs them."
        },
    )
    unmatched_topic: str = field(
        default=c.KAFKA_UNMATCHED_TOPIC,
        metadata={"doc": "The router's catch-all topic: its records become rejects (no mapping rule)."},
    )
    deadletter_topic: str = field(
        default=c.KAFKA_DEADLETTER_TOPIC,
        metadata={"doc": "The router's dead-letter topic: its records become rejects with the reason."},
    )
    starting_offsets: str = field(
        default="earliest", metadata={"doc": "Where a job without checkpoint starts: earliest or latest."}
    )
    trigger_s: float = field(
        default=2.0,
        metadata={
            "doc": "How often the job looks for new records; with freshness_target_s, the shortest "
            "time between two micro-batches."
        },
    )
    freshness_target_s: float = field(
        default=4.0,
        metadata={
            "doc": "How long a record may wait, at a steady rate, before it is a row of every table: "
            "the job spaces its micro-batches as far apart as this allows, each batch's own time "
            "taken off, since a batch costs about the same whatever its size (0: a batch every "
            "trigger_s).  A backlog's batches follow each other at once."
        },
    )
    aggregate_interval_s: float = field(
        default=60.0,
        metadata={
            "doc": "How often the rows the micro-batches landed since the last time are counted in "
            "device_minute and region_minute, beside the batches (0: as often as the job's 2 s "
            "round allows).  The batches themselves land only telemetry_raw and rejects.  A "
            "count has fixed costs (a MERGE per aggregate) that a batch every 2 s would pay 30 "
            "times a minute: once a minute keeps a minute's aggregates a minute behind at most "
            "and leaves the cores to the batches."
        },
    )
    aggregate_after_rows: int = field(
        default=50_000,
        metadata={
            "doc": "Count sooner than aggregate_interval_s once this many rows wait to be counted "
            "(a backlog's aggregates follow its batches instead of the clock; 0: only by time)."
        },
    )
    compact_interval_s: float = field(
        default=120.0,
        metadata={
            "doc": "How often the job rewrites the small files of the dates it wrote into large ones "
            "and expires old snapshots (0: never; then run it yourself).  Each batch's MERGE "
            "plans over the files and manifests the batches since added: at 300 readings/s, "
            "every 2 minutes kept the job at ~0.4 cores where every 10 cost ~0.6 (a sawtooth up "
            "to 0.85 before each compaction), for 4-7 s of compaction each time."
        },
    )
    snapshots_kept_hours: float = field(
        default=1.0,
        metadata={
            "doc": "How far back a query can time-travel: older snapshots are expired at a "
            "compaction, at most every sixth of this time (10 minutes for an hour), so a table "
            "holds up to that much more (the latest 5 are always kept; a table holds a snapshot "
            "per micro-batch, each commit rewrites their list)."
        },
    )
    dedupe_lookback_days: int = field(
        default=2,
        metadata={
            "doc": "How many days before its own Kafka time a reading without a device time (payload "
            "ts) looks for an earlier copy of itself.  Readings with one find their copies by it, "
            "whatever their delay."
        },
    )
    max_offsets_per_trigger: int = field(
        default=200_000, metadata={"doc": "Records read per micro-batch at most (backlog catch-up)."}
    )
    max_payload_bytes: int = field(
        default=256 * 1024, metadata={"doc": "Records over this size go to rejects."}
    )
    shuffle_partitions: int = field(default=2, metadata={"doc": "spark.sql.shuffle.partitions."})
    local_spare_slots: int = field(
        default=1,
        metadata={
            "doc": "Task slots a local master (local[N]) runs beyond its N cores, the batches still "
            "read in N tasks: the aggregates' count then runs beside a backlog batch's long tasks "
            "instead of waiting for one of them to end before each of its small jobs (0: none)."
        },
    )
    driver_memory: str = field(default="1g", metadata={"doc": "spark.driver.memory."})
    java_options: str = field(
        default="",
        metadata={
            "doc": "Extra JVM options of the driver and the executors (e.g. -XX:TieredStopAtLevel=1 "
            "-XX:ReservedCodeCacheSize=240m: a third less CPU for short jobs; the tests' setting. "
            "C1 alone shrinks the code cache to 48 MB, which the job fills: give it its size). "
            "The driver runs G1 marking from 70 % of its heap (spark.session.DRIVER_GC) "
            "unless these name a collector."
        },
    )
    executor_memory: str = field(
        default="1g", metadata={"doc": "spark.executor.memory (on a cluster; local mode runs in the driver)."}
    )
    cores_max: int = field(
        default=0, metadata={"doc": "spark.cores.max: cores the job takes of a cluster (0: Spark's default)."}
    )
    bind_host: str = field(default="127.0.0.1", metadata={"doc": "Address the Spark driver binds."})
    driver_port: int = field(default=0, metadata={"doc": "spark.driver.port (0: any free port)."})
    block_manager_port: int = field(default=0, metadata={"doc": "spark.blockManager.port (0: any)."})
    ui_port: int = field(default=0, metadata={"doc": "Spark UI port (0: UI off)."})
    connect_port: int = field(
        default=0,
        metadata={
            "doc": "Port (on bind_host) where the job serves its Spark session over Spark Connect, so "
            "that `fedgate query` answers without starting Spark (0: not served).  Unauthenticated: "
            "bind it where only analysts reach."
        },
    )
    metrics_port: int = field(
        default=0,
        metadata={"doc": "Port (on bind_host) of the job's Prometheus metrics, /metrics (0: not served)."},
    )
    progress_file: str = field(
        default="", metadata={"doc": "Where the job writes its queries' progress (JSON); empty: nowhere."}
    )

    def __post_init__(self) -> None:
        for topic in self.topics:
            if not _KAFKA_TOPIC.fullmatch(topic):
                raise SparkSettingsError(f"topics: {topic!r} is not a Kafka topic name")
        if not self.kafka_bootstrap:
            raise SparkSettingsError("kafka_bootstrap: required")
        try:
            self.kafka_security.validate()
        except KafkaSecurityError as e:
            raise SparkSettingsError(str(e)) from e
        if not self.warehouse:
            raise SparkSettingsError("warehouse: required")
        if self.starting_offsets not in ("earliest", "latest"):
            raise SparkSettingsError("starting_offsets: 'earliest' or 'latest'")
        if self.trigger_s <= 0:
            raise SparkSettingsError("trigger_s: must be > 0")
        for name in (
            "aggregate_interval_s",
            "compact_interval_s",
            "snapshots_kept_hours",
            "freshness_target_s",
        ):
            if getattr(self, name) < 0:
                raise SparkSettingsError(f"{name}: must be >= 0")
        for name in ("aggregate_after_rows", "local_spare_slots"):
            if getattr(self, name) < 0:
                raise SparkSettingsError(f"{name}: must be >= 0")
        if self.dedupe_lookback_days < 0:
            raise SparkSettingsError("dedupe_lookback_days: must be >= 0")
        for name in ("catalog", "namespace"):
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", getattr(self, name)):
                raise SparkSettingsError(
                    f"{name}: lower-case letters, digits and _, not {getattr(self, name)!r}"
                )
        for name in ("warehouse", "checkpoints"):
            if re.match(r"s3n?://", getattr(self, name)):
                raise SparkSettingsError(
                    f"{name}: write s3a://{getattr(self, name).split('://', 1)[1]} "
                    "(Hadoop's S3 file system, which the job's jars bring, is s3a)"
                )
        if not self.catalog_uri and "://" in self.warehouse and not self.warehouse.startswith("file:"):
            raise SparkSettingsError(
                "catalog_uri: required when the warehouse is not a local folder "
                "(a JDBC URL of a database every job and query reaches, its driver jar in jars_dir)"
            )

    def require_topics(self) -> tuple[str, ...]:
        """The topics to stream from; SparkSettingsError if none are set (the job cannot guess them)."""
        if not self.topics:
            raise SparkSettingsError(
                "topics: required by the job: the Kafka topics the router's mapping rules produce, "
                "with its catch-all and dead-letter topics (router.topics.kafka_topics)"
            )
        return self.topics

    @property
    def kafka_security(self) -> KafkaSecurity:
        return KafkaSecurity.of(self)

    def kafka_options(self) -> dict[str, str]:
        """The Kafka source's client options: where Kafka is, how to log in."""
        client = {"bootstrap.servers": self.kafka_bootstrap, **self.kafka_security.java()}
        return {f"kafka.{k}": v for k, v in client.items()}

    @property
    def catalog_jdbc_uri(self) -> str:
        if self.catalog_uri:
            return self.catalog_uri
        return f"jdbc:sqlite:{self.warehouse.removeprefix('file:').rstrip('/')}/catalog.db"

    @property
    def on_s3(self) -> bool:
        return any(p.startswith("s3a://") for p in (self.warehouse, self.checkpoints))

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoints or f"{self.warehouse.rstrip('/')}/_checkpoints"

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> SparkSettings:
        """Settings from a TOML file, then FEDGATE_SPARK_<FIELD> variables, then `overrides`."""
        known = {f.name: str(f.type) for f in fields(cls)}
        values = read_layers(
            known, path=path, env=os.environ, env_prefix="FEDGATE_SPARK_", error=SparkSettingsError
        )
        unknown = set(overrides) - set(known)
        if unknown:
            raise SparkSettingsError(f"unknown settings: {', '.join(sorted(unknown))}")
        values.update(overrides)
        values = {name: coerce(name, known[name], raw, SparkSettingsError) for name, raw in values.items()}
        for f in fields(cls):
            if f.default is MISSING and f.default_factory is MISSING and f.name not in values:
                raise SparkSettingsError(
                    f"{f.name}: required (config file or FEDGATE_SPARK_{f.name.upper()})"
                )
        return cls(**values)


def describe() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) of every setting, for `fedgate settings`."""
    out = []
    for f in fields(SparkSettings):
        if f.default is not MISSING:
            default = str(f.default)
        elif f.default_factory is not MISSING:
            default = "<cache>/" + SPARK_JARS
        else:
            default = "(required)"
        out.append(("FEDGATE_SPARK_" + f.name.upper(), default, f.metadata.get("doc", "")))
    return out
