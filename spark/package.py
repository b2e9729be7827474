"""The job packaged for spark-submit: one zip of its Python code and a main file.

    python -m spark.package [--out build/spark]      (make spark-package)

writes
    <out>/fedgate-spark.zip   the `spark` and `backend` packages (what the job imports), with
                              the job's log4j2 and scheduler pool files
    <out>/fedgate_job.py      the main file: runs spark.job with the arguments it is given

and prints the command that submits the job to a cluster:

    spark-submit --master spark://host:7077 --jars <the jars of jars_dir, comma-separated> \\
        --py-files <out>/fedgate-spark.zip <out>/fedgate_job.py --config spark.toml

The job's transforms are Spark SQL expressions only (no Python UDF), so executors run no
fedgate code: the zip is for the driver, which spark-submit runs where it is started (client
mode: a Python application cannot run its driver on a standalone cluster).  The jars (Kafka
source, Iceberg, the catalog's JDBC driver) are the job's `jars_dir` on the submitting
machine (set `jars_dir`: packaged, the job has no project folder to find them in): Spark
ships them to the executors.  The settings file names the cluster
(`master`, `executor_memory`, `cores_max`) and a warehouse every executor reaches.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

from spark.session import spark_jars
from spark.settings import PROJECT_ROOT, SparkSettings

#: the packages the job imports (spark.settings and spark.transforms import backend's)
PACKAGES = ("spark", "backend")
RESOURCES = ("log4j2.properties", "fairscheduler.xml")
ZIP_NAME = "fedgate-spark.zip"
MAIN_NAME = "fedgate_job.py"

MAIN = '''"""fedgate's Spark job, as spark-submit runs it (built by python -m spark.package)."""

import sys

from spark.job import main

sys.exit(main())
'''


def build(out: Path) -> tuple[Path, Path]:
    """Write the zip and the main file into `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    archive = out / ZIP_NAME
    tmp = archive.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for package in PACKAGES:
            root = PROJECT_ROOT / package
            for path in sorted(root.rglob("*")):
                if path.suffix == ".py" or (package == "spark" and path.name in RESOURCES):
                    z.write(path, path.relative_to(PROJECT_ROOT).as_posix())
    tmp.replace(archive)
    main = out / MAIN_NAME
    main.write_text(MAIN)
    return archive, main


def submit_command(archive: Path, main: Path, master: str, config: str, jars: list[str]) -> list[str]:
    """spark-submit's arguments.  The jars go on the command line: on the driver's class path
    only there (set later, from the session's builder, they would reach the executors only)."""
    return [
        "spark-submit",
        "--master",
        master,
        "--jars",
        ",".join(jars),
        "--py-files",
        str(archive),
        str(main),
        "--config",
        config,
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spark.package", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(PROJECT_ROOT / "build" / "spark"), help="folder to write into")
    args = ap.parse_args(argv)
    archive, main_file = build(Path(args.out))
    print(f"wrote {archive} ({archive.stat().st_size // 1024} KB) and {main_file}")
    jars = spark_jars(SparkSettings.load(kafka_bootstrap="-", warehouse="-"))
    command = submit_command(archive, main_file, "spark://HOST:7077", "spark.toml", jars)
    print("submit it with (jars_dir in spark.toml naming the same jars):\n  " + " ".join(command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
