"""`make bench` stopped with SIGTERM leaves nothing behind: its federation's nodes run in
sessions of their own, out of reach of a signal to the command, so the suite must stop them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from backend.polling import wait_until
from infra.local import processes
from infra.local.settings import PROJECT_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_sigterm_in_the_middle_of_a_benchmark_stops_its_federation(tmp_path: Path) -> None:
    # the benchmark's federation in a temporary folder of its own: the quick benchmarks of
    # another lane boot theirs under /tmp/fedgate-bench-* meanwhile, and are not this one's
    own_tmp = Path(tempfile.mkdtemp(prefix="fedgate-stop-")).resolve()
    bench_nodes = str(own_tmp / "fedgate-bench-")
    log = tmp_path / "bench.log"
    env = {
        **os.environ,
        "BENCH": "router",
        "QUICK": "1",
        "FEDGATE_BENCH_PORT_BASE": "29700",
        "TMPDIR": str(own_tmp),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench"], cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def booted() -> bool:
            if "router benchmark (quick)" in log.read_text(errors="replace"):
                return True
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            return False

        assert wait_until(booted, 180, 0.5), "the federation did not boot"
        running = set(processes.marked_pids(bench_nodes))
        assert running, "the benchmark's federation runs: RabbitMQ nodes, Kafka, routers"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) != 0, "stopped, not finished"
    finally:
        if proc.poll() is None:
            proc.kill()
    left = set(processes.marked_pids(bench_nodes)) & running
    assert not left, f"processes of the benchmark's federation left running: {sorted(left)}"
    assert "federation down" in log.read_text(errors="replace")
    shutil.rmtree(own_tmp, ignore_errors=True)  # its logs, kept by the benchmark that failed
