"""The Spark driver's class archive: mapped when it is good, harmless when it is not.

Each check starts a driver in a child process: a Python process has one JVM, whose options
are fixed by its first session (the package's, in this process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spark.class_archive import archive_path, driver_options
from spark.settings import SparkSettings

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[3]

#: A driver that opens the tables and counts a table's rows, with the settings it is given.
CHILD = """
import json, sys
from spark.settings import SparkSettings
from spark.session import build_session
from spark.tables import use_tables
s = SparkSettings(**json.loads(sys.argv[1]))
spark = build_session(s, "fedgate-class-archive-test", kafka=False)
use_tables(spark, s)
print("rows:", spark.sql("SELECT count(*) FROM telemetry_raw").collect()[0][0])
spark.stop()
"""


def start_driver(settings: SparkSettings) -> subprocess.CompletedProcess[str]:
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.init}
    return subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(fields, default=str)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def settings_with(spark_settings: SparkSettings, tmp_path: Path, **changes: Any) -> SparkSettings:
    return dataclasses.replace(
        spark_settings, warehouse=str(tmp_path / "warehouse"), master="local[1]", **changes
    )


def test_the_archive_setup_wrote_is_one_this_jvm_maps(spark_settings, tmp_path):
    """Tried: a driver told to map the archive or fail (`-Xshare:on`).  It answers: the
    archive `make setup` wrote matches this Java and these jars, so drivers do start faster."""
    settings = settings_with(spark_settings, tmp_path)
    if not archive_path(settings).is_file():
        if os.environ.get("FEDGATE_REQUIRE_RUNTIME"):
            pytest.fail(f"make setup wrote no class archive at {archive_path(settings)}")
        pytest.skip(f"no class archive at {archive_path(settings)}: `make setup` writes it")
    assert str(archive_path(settings)) in driver_options(settings)
    done = start_driver(dataclasses.replace(settings, java_options=f"{settings.java_options} -Xshare:on"))
    assert done.returncode == 0 and "rows: 0" in done.stdout, done.stderr[-2000:]


def test_a_stale_archive_costs_nothing_but_the_speed(spark_settings, tmp_path):
    """Tried: the archive replaced by bytes no JVM wrote (as after a Java upgrade, a file
    from elsewhere).  The driver starts and answers as without one, and says nothing about
    it: a stale archive is not an error."""
    jars = tmp_path / "cache" / "jars" / Path(spark_settings.jars_dir).name
    jars.mkdir(parents=True)
    for jar in Path(spark_settings.jars_dir).glob("*.jar"):
        (jars / jar.name).symlink_to(jar)
    settings = settings_with(spark_settings, tmp_path, jars_dir=str(jars))
    stale = archive_path(settings)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"not a class archive" * 1000)
    assert f"-XX:SharedArchiveFile={stale}" in driver_options(settings)
    done = start_driver(settings)
    assert done.returncode == 0 and "rows: 0" in done.stdout, done.stderr[-2000:]
    assert "SharedArchiveFile" not in done.stdout + done.stderr and "[cds]" not in done.stdout


def test_without_an_archive_a_driver_gets_no_option_for_one(spark_settings, tmp_path):
    settings = settings_with(spark_settings, tmp_path, jars_dir=str(tmp_path / "jars" / "spark-x"))
    assert driver_options(settings) == ""


def test_a_driver_that_cannot_start_leaves_no_archive_and_says_why(spark_settings, tmp_path):
    """Tried: `make setup`'s step with jars missing (the driver refuses to start).  No archive,
    not even a partial one a later driver would map; the reason is printed, and setup goes on."""
    from spark.class_archive import make

    settings = settings_with(spark_settings, tmp_path, jars_dir=str(tmp_path / "cache" / "jars" / "spark-x"))
    said: list[str] = []
    assert make(settings, progress=said.append) is None
    assert not list((tmp_path / "cache" / "cds").glob("*")), "nothing left behind"
    assert "no class archive" in said[-1] and "make setup" in said[-1], said
