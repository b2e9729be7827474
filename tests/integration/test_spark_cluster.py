"""The Spark job on a cluster: packaged by `make spark-package`, submitted with spark-submit
to a standalone master and a worker that this module starts (pyspark's own Spark), against
the session federation's Kafka.

What a user checks: the job runs as an application of the cluster (its executor on the
worker, not in the driver), every record becomes a row once and is counted in the
aggregates, and SIGTERM ends it cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.spark_bench import BACKLOG_PREFIX, produce_records
from infra.local.toml_out import toml_lines
from router.kafka import ensure_topics
from spark import package
from spark.reading import duckdb_with_tables
from spark.session import spark_jars
from spark.settings import SparkSettings
from tests.conftest import TEST_PORT_BASE

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.slow]

SPARK_BIN = Path(__import__("pyspark").__file__).resolve().parent / "bin"
#: the cluster's ports: after the federation's own (infra/local/layout.py), before its gateways'
PORTS = TEST_PORT_BASE + 90
RECORDS = 2000


@dataclass
class Cluster:
    url: str
    ui: str
    logs: Path

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=5) as r:
            return dict(json.load(r))


def _spark_env(logs: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(logs),
        "SPARK_NO_DAEMONIZE": "1",
    }


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM its process group, SIGKILL what is left after 20 s: nothing is left behind."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("spark-cluster")
    env = _spark_env(logs)
    spark_class = str(SPARK_BIN / "spark-class")
    url, ui = f"spark://127.0.0.1:{PORTS}", f"http://127.0.0.1:{PORTS + 1}"
    master = _start(
        [spark_class, "org.apache.spark.deploy.master.Master"]
        + ["--host", "127.0.0.1", "--port", str(PORTS), "--webui-port", str(PORTS + 1)],
        logs / "master.log",
        env,
    )
    worker = _start(
        [spark_class, "org.apache.spark.deploy.worker.Worker", url]
        + ["--host", "127.0.0.1", "--port", str(PORTS + 2), "--webui-port", str(PORTS + 3)]
        + ["--cores", "1", "--memory", "1g", "--work-dir", str(logs / "work")],
        logs / "worker.log",
        env,
    )
    c = Cluster(url, ui, logs)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if c.state().get("aliveworkers") == 1:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or master.poll() is not None or worker.poll() is not None:
                raise RuntimeError(f"the standalone cluster did not come up: see {logs}")
            time.sleep(1)
        yield c
    finally:
        _end(worker)
        _end(master)


def _driver_pid(submit: subprocess.Popen) -> int | None:
    """The Python driver spark-submit started (its JVM's child running fedgate_job.py)."""
    # the JVM starts it from one of its threads: each thread (task) lists its own children
    children = (
        c for t in Path(f"/proc/{submit.pid}/task").iterdir() for c in (t / "children").read_text().split()
    )
    for pid in children:
        if "fedgate_job.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return int(pid)
    return None


def test_the_packaged_job_runs_on_a_standalone_cluster(federation, endpoints, cluster, tmp_path, uid):
    """Tried: 2,000 bridge records into a topic of the job's own, the job submitted to the
    cluster with its package; then SIGTERM to its driver."""
    bootstrap = endpoints["kafka"]["bootstrap"]
    topic = f"cluster.telemetry-{uid}"
    ensure_topics(bootstrap, [topic], 2, 1)
    archive, main = package.build(tmp_path / "package")
    config = {
        "kafka_bootstrap": bootstrap,
        "warehouse": str(tmp_path / "warehouse"),
        "topics": [topic],
        "master": cluster.url,
        "executor_memory": "512m",
        "cores_max": 1,
        "driver_memory": "512m",
        "aggregate_interval_s": 5,
        "progress_file": str(tmp_path / "progress.json"),
        # packaged, the job has no project folder to find them in: where make setup put them
        "jars_dir": SparkSettings.load(kafka_bootstrap="-", warehouse="-").jars_dir,
    }
    toml = tmp_path / "spark.toml"
    toml.write_text("\n".join(toml_lines(config)) + "\n")
    settings = SparkSettings.load(toml)
    env = {
        **_spark_env(cluster.logs),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    command = package.submit_command(archive, main, cluster.url, str(toml), spark_jars(settings))
    command[0] = str(SPARK_BIN / "spark-submit")
    submit = _start(command, tmp_path / "submit.log", env)
    try:
        produce_records(bootstrap, topic, RECORDS)
        rows = counted = 0
        apps: list = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and submit.poll() is None:
            apps = apps or [a for a in cluster.state().get("activeapps", []) if a["name"] == "fedgate-tables"]
            try:
                con = duckdb_with_tables(settings)
                rows = con.execute(
                    f"SELECT count(*) FROM telemetry_raw WHERE device LIKE '{BACKLOG_PREFIX}%'"
                ).fetchall()[0][0]
                counted = con.execute(
                    "SELECT coalesce(sum(count), 0) FROM device_minute WHERE field = '*'"
                ).fetchall()[0][0]
            except Exception:  # noqa: BLE001 -- the tables appear with the job's first commit
                pass
            if rows >= RECORDS and counted >= RECORDS:
                break
            time.sleep(3)
        print(f"cluster job: {rows} rows, {counted} counted in device_minute; app {apps[:1]}")
        assert submit.poll() is None, (
            f"spark-submit ended early: {(tmp_path / 'submit.log').read_text()[-3000:]}"
        )
        assert apps and apps[0]["cores"] >= 1, (
            "the job ran as an application of the cluster, with executor cores"
        )
        assert (rows, counted) == (RECORDS, RECORDS), "every record a row, counted once"

        driver = _driver_pid(submit)
        assert driver is not None, "spark-submit runs the Python driver as its child"
        os.kill(driver, signal.SIGTERM)
        assert submit.wait(90) == 0, "SIGTERM ends the job cleanly (exit 0)"
        finished = [a for a in cluster.state().get("completedapps", []) if a["name"] == "fedgate-tables"]
        assert finished, "the cluster lists the job as finished"
    finally:
        _end(submit)
