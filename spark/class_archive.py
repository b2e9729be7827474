"""A Spark driver's classes, parsed once and mapped from a file at every start after.

A SparkSession's JVM spends most of its start loading and verifying the
classes of pyspark's jars: 10-11 CPU s for a session that opens the tables
and answers one query, on this project's 2-core machines.  The JVM's class
data sharing (a dynamic archive, JDK 13+) keeps those classes pre-parsed in a
file that the next JVM maps instead: the same session then starts in 6-7 CPU s
(2026-11-30, docs/operations.md).  Every driver gains: the job's (re)starts,
`fedgate query` and `recompute` without the job's Spark Connect, the tests'
sessions.

`make setup` makes the archive (`python -m spark.class_archive`): one session
run to its end with `-XX:ArchiveClassesAtExit`, written beside the cached jars
under a temporary name and renamed once the JVM exited cleanly, so a driver
never maps a half-written file.  A driver uses it when it is there.  The
archive is named by the pyspark release and the Java build it is good for;
one that does not match all the same (a file from elsewhere) is no error:
the JVM says nothing (the options silence it) and loads its classes as
before.  Only the classes of the driver's class path go in (pyspark's jars); the jars Spark adds at run
time (`spark.jars`: Iceberg, the Kafka source) load as before.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyspark

from spark.settings import SparkSettings

#: Silence the JVM's notes about the archive: a stale one is not an error, only slower.
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def java_build() -> str:
    """The build of the Java that pyspark starts ($JAVA_HOME's, else `java`'s on the PATH), as
    its `release` file names it: an archive is only good for the build that wrote it."""
    home = os.environ.get("JAVA_HOME")
    if not home:
        java = shutil.which("java")
        home = str(Path(java).resolve().parent.parent) if java else ""
    try:
        text = (Path(home) / "release").read_text()
    except OSError:
        return "unknown"
    found = re.search(r'^JAVA_RUNTIME_VERSION="([^"]+)"', text, re.M)
    return re.sub(r"[^A-Za-z0-9.+-]", "_", found.group(1)) if found else "unknown"


def archive_path(settings: SparkSettings) -> Path:
    """Beside the cached jars (`<cache>/jars/spark-<v>` -> `<cache>/cds/`), per pyspark release
    and Java build: after an upgrade of either `make setup` writes a new one."""
    name = f"spark-{pyspark.__version__}-java-{java_build()}-driver.jsa"
    return Path(settings.jars_dir).resolve().parent.parent / "cds" / name


def driver_options(settings: SparkSettings) -> str:
    """The driver's JVM options that map the archive, or none when there is none."""
    path = archive_path(settings)
    return f"-XX:SharedArchiveFile={path} {_QUIET}" if path.is_file() else ""


def _exercise(warehouse: str, java_options: str, jars_dir: str) -> None:
    """In a child process: a session that opens the tables and queries them, so that the
    classes every driver loads are loaded, then a clean stop (the JVM writes the archive as
    it exits)."""
    from spark.session import build_session
    from spark.tables import use_tables

    settings = SparkSettings(
        kafka_bootstrap="-",
        warehouse=warehouse,
        master="local[1]",
        shuffle_partitions=1,
        java_options=java_options,
        jars_dir=jars_dir,
    )
    spark = build_session(settings, "fedgate-class-archive", kafka=False, class_archive=False)
    use_tables(spark, settings)
    spark.sql("SELECT device, count(*) FROM telemetry_raw GROUP BY device").collect()
    spark.stop()


def make(settings: SparkSettings, *, progress=print) -> Path | None:  # type: ignore[no-untyped-def]
    """Write the archive if it is missing; its path, or None when the JVM could not write one."""
    path = archive_path(settings)
    if path.is_file():
        progress(f"the Spark driver's class archive is there ({path})")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"writing the Spark driver's class archive {path} (a session started and stopped)")
    with tempfile.TemporaryDirectory(prefix="fedgate-cds-") as tmp:
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        options = f"-XX:ArchiveClassesAtExit={partial} {_QUIET}"
        code = (
            "import sys; from spark.class_archive import _exercise; "
            "_exercise(sys.argv[1], sys.argv[2], sys.argv[3])"
        )
        try:
            done = subprocess.run(
                [sys.executable, "-c", code, tmp, options, settings.jars_dir],
                cwd=Path(__file__).resolve().parent.parent,
                capture_output=True,
                text=True,
                timeout=600,
            )
            why = "" if done.returncode == 0 else done.stderr.strip()[-500:]
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
    if why or not partial.is_file():
        partial.unlink(missing_ok=True)
        progress(f"no class archive, drivers start as before: {why or 'the JVM wrote none'}")
        return None
    partial.replace(path)
    for old in path.parent.glob("spark-*-driver.jsa"):  # an earlier release's or Java's
        if old != path:
            old.unlink(missing_ok=True)
    return path


if __name__ == "__main__":
    make(
        SparkSettings(kafka_bootstrap="-", warehouse="-"),
        progress=lambda m: print(f"[setup] {m}", flush=True),
    )
