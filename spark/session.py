"""One place that builds a SparkSession for the job, the batch recompute and queries."""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.resources
import os
import re
import shutil
import sqlite3
import tempfile
from pathlib import Path

from pyspark.sql import SparkSession

from backend.errors import FedgateError
from spark.class_archive import driver_options
from spark.settings import SparkSettings

_RESOURCES: dict[str, Path] = {}


def resource(name: str) -> Path:
    """A file of this package (log4j2.properties, fairscheduler.xml) as a path the JVM can read:
    the file itself, or a copy out of the zip that spark-submit was given (spark/package.py)."""
    if name not in _RESOURCES:
        here = Path(__file__).resolve().parent / name
        if here.is_file():
            _RESOURCES[name] = here
        else:
            folder = tempfile.mkdtemp(prefix="fedgate-spark-")
            atexit.register(shutil.rmtree, folder, True)
            copy = Path(folder) / name
            copy.write_bytes(importlib.resources.files("spark").joinpath(name).read_bytes())
            _RESOURCES[name] = copy
    return _RESOURCES[name]


class SparkSetupError(FedgateError):
    pass


def spark_jars(settings: SparkSettings, *, kafka: bool = True) -> list[str]:
    """The jars `make setup` fetched: Iceberg (every session reads the tables), and the
    Kafka source (required when `kafka`; loaded whenever present, since one Python
    process has one JVM and jars join it only with its first session)."""
    jars = sorted(glob.glob(os.path.join(settings.jars_dir, "*.jar")))
    needed = ["iceberg-spark-runtime", "sqlite-jdbc", "postgresql"] + (["spark-sql-kafka"] if kafka else [])
    missing = [n for n in needed if not any(os.path.basename(j).startswith(n) for j in jars)]
    if missing:
        raise SparkSetupError(
            f"{', '.join(missing)} not in {settings.jars_dir}: run `make setup` (it fetches the jars)"
        )
    return jars


#: Iceberg's JDBC catalog tables (its schema V1, as JdbcCatalog creates them).
_SQLITE_CATALOG_DDL = (
    "CREATE TABLE IF NOT EXISTS iceberg_tables(catalog_name VARCHAR(255) NOT NULL,"
    "table_namespace VARCHAR(255) NOT NULL,table_name VARCHAR(255) NOT NULL,"
    "metadata_location VARCHAR(1000),previous_metadata_location VARCHAR(1000),iceberg_type VARCHAR(5),"
    "PRIMARY KEY (catalog_name, table_namespace, table_name))",
    "CREATE TABLE IF NOT EXISTS iceberg_namespace_properties(catalog_name VARCHAR(255) NOT NULL,"
    "namespace VARCHAR(255) NOT NULL,property_key VARCHAR(255),property_value VARCHAR(1000),"
    "PRIMARY KEY (catalog_name, namespace, property_key))",
)


def create_sqlite_catalog(path: str) -> None:
    """The SQLite file of a local Iceberg catalog, its tables created, in WAL mode."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as db:
        db.execute("PRAGMA journal_mode=WAL")  # persistent: every later connection uses it
        for ddl in _SQLITE_CATALOG_DDL:
            db.execute(ddl)
        db.commit()


def iceberg_catalog_conf(settings: SparkSettings) -> dict[str, str]:
    """Spark settings naming the tables' Iceberg catalog (a JDBC catalog: SQLite here, a shared
    PostgreSQL database elsewhere)."""
    prefix = f"spark.sql.catalog.{settings.catalog}"
    uri = settings.catalog_jdbc_uri
    conf: dict[str, str] = {}
    if settings.catalog_user:
        conf[f"{prefix}.jdbc.user"] = settings.catalog_user
        conf[f"{prefix}.jdbc.password"] = settings.catalog_password
    if uri.startswith("jdbc:sqlite:"):
        create_sqlite_catalog(uri.removeprefix("jdbc:sqlite:"))
        # Iceberg 1.10's JdbcCatalog leaves the result set of its start-up check open: on
        # SQLite that keeps a read transaction open on a pooled connection for good, so the
        # session saw the table as it was when it started (a test's query never saw the rows
        # the job committed) and, in SQLite's default journal mode, the job's commits failed
        # with SQLITE_BUSY.  The catalog's tables are created above instead.
        conf[f"{prefix}.jdbc.init-catalog-tables"] = "false"
        # the job commits from its streaming thread while analysts read from other
        # processes: in WAL mode readers never block a commit (in SQLite's default mode a
        # reader's lock had a commit fail with SQLITE_BUSY after waiting), and a commit waits
        # for another instead of failing at once
        conf[f"{prefix}.jdbc.journal_mode"] = "WAL"
        conf[f"{prefix}.jdbc.busy_timeout"] = "30000"
    return conf | {
        "spark.sql.extensions": "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
        prefix: "org.apache.iceberg.spark.SparkCatalog",
        f"{prefix}.type": "jdbc",
        f"{prefix}.uri": uri,
        # V1 also keeps views; pyiceberg's SqlCatalog reads the same tables
        f"{prefix}.jdbc.schema-version": "V1",
        f"{prefix}.warehouse": settings.warehouse,
        # a query polling for rows the job commits every 2 s sees each commit (cached, a table
        # would stay at the snapshot first read for 30 s)
        f"{prefix}.cache-enabled": "false",
        "spark.sql.defaultCatalog": settings.catalog,
    }


def s3a_conf(settings: SparkSettings) -> dict[str, str]:
    """Hadoop's s3a file system for an s3a:// warehouse and checkpoints (hadoop-aws and the AWS
    SDK's S3 modules: infra/setup/spark-pom.xml).  Credentials: the SDK's own chain."""
    if not settings.on_s3:
        return {}
    # (s3a:// is bound to S3AFileSystem by Hadoop's own defaults.)  The tables' commits are the
    # catalog's (a row in a database), never a rename; the checkpoint's writes are renames,
    # which s3a does as copy + delete: safe with the one writer a streaming query has
    conf: dict[str, str] = {}
    if settings.s3_endpoint:
        conf |= {
            "spark.hadoop.fs.s3a.endpoint": settings.s3_endpoint,
            # stores other than AWS (MinIO, moto) serve buckets as paths, not as host names
            "spark.hadoop.fs.s3a.path.style.access": "true",
            "spark.hadoop.fs.s3a.connection.ssl.enabled": str(
                settings.s3_endpoint.startswith("https:")
            ).lower(),
        }
    if settings.s3_region:
        conf["spark.hadoop.fs.s3a.endpoint.region"] = settings.s3_region
    return conf


#: The driver's garbage collector, unless `java_options` picks one: G1, marking the old
#: generation only once it holds 70 % of the heap.  The job allocates ~110 MB/s at 300
#: readings/s (Spark's task serialization, columnar caches, Iceberg's manifests), nearly
#: all of it dead by the next young collection, over a live heap of ~200-300 MB.  G1's
#: adaptive threshold sat below that in the 1 GB heap: a concurrent marking cycle every
#: 6-7 s, a tenth of the warm job's CPU.  With the threshold fixed, one cycle in minutes 3-8
#: at 300 readings/s (job 0.35-0.38 cores -> 0.32); the throughput collector saved as much
#: there but slowed a backlog's big batches (full collections: 0.44 of the Spark batch
#: reference against 0.76), which G1 still collects a region at a time.
DRIVER_GC = "-XX:+UseG1GC -XX:InitiatingHeapOccupancyPercent=70 -XX:-G1UseAdaptiveIHOP"


def gc_option(java_options: str) -> str:
    """DRIVER_GC, or nothing where `java_options` selects a collector itself (two would
    stop the JVM at its start)."""
    return "" if re.search(r"-XX:\+Use\w*GC\b", java_options) else DRIVER_GC


def local_master(master: str, spare_slots: int) -> tuple[str, int | None]:
    """The master URL to start and the cores its batches are cut for (spark.default.parallelism):
    a local master's N cores get `spare_slots` more task slots (local[N] -> local[N+spare],
    N tasks a batch); any other master is its own (None: Spark's default parallelism).

    Why: Spark starts a task when a slot is free, and a backlog batch's tasks each read
    100,000 records for seconds; the aggregates' count beside it is a chain of small jobs,
    each waiting for one of those to end -- a count of 600 rows took 6.5-9 s beside a
    backlog's first batch, and the backlog's own counts queued behind it (3-4 s with a
    spare slot).  The OS shares the cores between the threads instead."""
    m = re.fullmatch(r"local\[(\d+|\*)\]", master.strip())
    if m is None or spare_slots <= 0:
        return master, None
    cores = (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1))
    return f"local[{cores + spare_slots}]", cores


def build_session(
    settings: SparkSettings, app: str, *, kafka: bool = True, serve: bool = False, class_archive: bool = True
) -> SparkSession:
    """A session configured for fedgate's tables; its driver maps the classes `make setup`
    archived (spark/class_archive.py) unless `class_archive` is False.

    ANSI mode is off on purpose: device payloads are untrusted, and under ANSI
    a single bad cast would fail the whole micro-batch and stop the job; the
    transforms turn bad values into NULL plus a parse_error instead.
    """
    master, cores = local_master(settings.master, settings.local_spare_slots)
    log4j = f"-Dlog4j2.configurationFile=file:{resource('log4j2.properties')}"
    # the driver binds where it is told, not to whatever the host name resolves to
    os.environ.setdefault("SPARK_LOCAL_IP", settings.bind_host)
    builder = (
        SparkSession.builder.appName(app)
        .master(master)
        .config("spark.driver.memory", settings.driver_memory)
        .config(
            "spark.driver.extraJavaOptions",
            " ".join(
                o
                for o in (
                    log4j,
                    driver_options(settings) if class_archive else "",
                    gc_option(settings.java_options),
                    settings.java_options,
                )
                if o
            ),
        )
        .config("spark.executor.memory", settings.executor_memory)
        .config("spark.driver.host", settings.bind_host)
        .config("spark.driver.bindAddress", settings.bind_host)
        .config("spark.driver.port", str(settings.driver_port))
        .config("spark.blockManager.port", str(settings.block_manager_port))
        .config("spark.ui.enabled", "true" if settings.ui_port else "false")
        .config("spark.sql.session.timeZone", "UTC")
        # the job counts the aggregates from one thread while its batches run in another:
        # fair shares between their pools instead of one's whole stage queue first
        .config("spark.scheduler.mode", "FAIR")
        .config("spark.scheduler.allocation.file", f"file:{resource('fairscheduler.xml')}")
        .config("spark.sql.ansi.enabled", "false")
        # a device's JSON or headers may repeat a key: the last wins instead of failing the batch
        .config("spark.sql.mapKeyDedupPolicy", "LAST_WIN")
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        # the classes Spark generates for a plan, kept for the next plan of the same code:
        # a refresh of the aggregates alone generates ~140, so Spark's default of 100 had
        # each refresh and the batches beside it evict and compile again what the next
        # would reuse (measured: 139 compiles in a refresh's window, 48 with 1000)
        .config("spark.sql.codegen.cache.maxEntries", "1000")
        # a broadcast (every stage's task binary is one) is cut into chunks allocated at this
        # size whatever its own: Spark's 4 MB made each a "humongous" G1 allocation in a 1 GB
        # heap, and the job's young GCs ran every 0.3 s.  Job alone at 300 readings/s, minutes
        # 3-4: 0.54 -> 0.45 cores, GC pauses 363 -> 167 in the run
        .config("spark.broadcast.blockSize", "512k")
        # An aggregate's MERGE rewrites the files of the minutes it counts (copy-on-write);
        # Spark first runs the MERGE's join once more to keep only the files holding a
        # matching key -- for the aggregates, nearly always all of them, as a minute's rows
        # are there since the last count -- computing the counted rows twice.  Without it,
        # 100,000 rows counted in 2.4-3.1 s instead of 4.2-4.5 (warm, local[2]).  The MERGE
        # into telemetry_raw only inserts: it rewrites no file either way.
        .config("spark.sql.optimizer.runtime.rowLevelOperationGroupFilter.enabled", "false")
        # What Spark keeps of finished jobs, stages, tasks and SQL executions for its UI
        # (kept whether the UI is on or not): 1,000 / 1,000 / 100,000 / 1,000 by default,
        # a quarter of the job's live heap at a batch every 2 s.  The last few minutes
        # suffice to look at a streaming job.
        .config("spark.ui.retainedJobs", "100")
        .config("spark.ui.retainedStages", "100")
        .config("spark.ui.retainedTasks", "2000")
        .config("spark.sql.ui.retainedExecutions", "100")
        .config("spark.ui.dagGraph.retainedRootRDDs", "100")
        # PySpark 4 records the Python call site of every DataFrame function for its error
        # messages: five calls into the JVM per function call, which the job's batches paid
        # every 2 s (measured: a batch's 371 calls into the JVM -> 191)
        .config("spark.python.sql.dataFrameDebugging.enabled", "false")
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
        .config("spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.parquet.compression.codec", "zstd")
    )
    if settings.java_options:
        builder = builder.config("spark.executor.extraJavaOptions", settings.java_options)
    if settings.ui_port:
        builder = builder.config("spark.ui.port", str(settings.ui_port))
    if settings.cores_max:
        builder = builder.config("spark.cores.max", str(settings.cores_max))
    if cores is not None:
        builder = builder.config("spark.default.parallelism", str(cores))
    if serve and settings.connect_port:
        # Spark Connect in the driver: clients get sessions of this application (spark/query.py)
        builder = (
            builder.config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
            .config("spark.connect.grpc.binding.address", settings.bind_host)
            .config("spark.connect.grpc.binding.port", str(settings.connect_port))
        )
    builder = builder.config("spark.jars", ",".join(spark_jars(settings, kafka=kafka)))
    catalog = iceberg_catalog_conf(settings)
    for key, value in (catalog | s3a_conf(settings)).items():
        builder = builder.config(key, value)
    refuse_another_catalogs_session(catalog)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def refuse_another_catalogs_session(catalog: dict[str, str]) -> None:
    """getOrCreate hands back the session this process already runs, whatever its catalog: a
    caller would read and write another warehouse's tables without a word (the benchmarks once
    found the unit tests' tables so).  Its catalog must be the one asked for."""
    # the session getOrCreate would return (private to PySpark, read as its builder reads it),
    # or this thread's active one
    existing = SparkSession.getActiveSession() or getattr(SparkSession, "_instantiatedSession", None)
    if existing is None or existing.sparkContext._jsc is None:  # none, or stopped
        return
    keys = [k for k in catalog if k.endswith((".uri", ".warehouse"))]
    have = {k: existing.conf.get(k, None) for k in keys}
    want = {k: catalog[k] for k in keys}
    if have != want:
        raise SparkSetupError(
            f"this process already runs a Spark session for another catalog ({have}); "
            f"stop it (session.stop()) before one for {want}"
        )
