"""The local routers' supervisor (infra/local/supervisor.py): a service that exits failed is
started again, a failed first start is reported at once, a stop is passed on, and the service
dies with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from backend.polling import wait_until

#: A service that counts its starts in a file, then runs `seconds` and exits with `code`
#: (for ever when seconds is negative), leaving its pid behind.
SERVICE = """
import os, sys, time
starts, seconds, code = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
with open(starts, "a") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(seconds if seconds >= 0 else 3600)
sys.exit(code)
"""


def _supervise(tmp_path: Path, seconds: float, code: int, grace: float) -> tuple[subprocess.Popen, Path]:
    starts = tmp_path / "starts"
    with (tmp_path / "out").open("wb") as out:
        return _popen(out, starts, seconds, code, grace), starts


def _popen(out, starts: Path, seconds: float, code: int, grace: float) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.local.supervisor",
            "--first-start-grace",
            str(grace),
            "--",
            sys.executable,
            "-c",
            SERVICE,
            str(starts),
            str(seconds),
            str(code),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2],
    )


def _pids(starts: Path) -> list[int]:
    return [int(x) for x in starts.read_text().split()] if starts.exists() else []


def _wait(cond, timeout: float = 10.0) -> bool:
    return bool(wait_until(cond, timeout, 0.05))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_service_that_exits_failed_is_started_again_and_a_stop_is_passed_on(tmp_path):
    proc, starts = _supervise(tmp_path, seconds=0.3, code=1, grace=0.1)
    try:
        assert _wait(lambda: len(_pids(starts)) >= 2, 10), "started again after it failed"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) in (0, 1, 128 + signal.SIGTERM)
    finally:
        proc.kill()
    out = (tmp_path / "out").read_text()
    assert "the service exited (1)" in out and "starting it again in 1 s" in out
    assert not any(_alive(p) for p in _pids(starts)), "no service left behind"


def test_a_failed_first_start_is_reported_with_its_code_not_retried(tmp_path):
    proc, starts = _supervise(tmp_path, seconds=0, code=3, grace=5)
    assert proc.wait(10) == 3
    assert len(_pids(starts)) == 1
    assert "failed at its first start (exit 3)" in (tmp_path / "out").read_text()


def test_sigterm_reaches_the_service_and_its_clean_exit_is_the_supervisors(tmp_path):
    proc, starts = _supervise(tmp_path, seconds=-1, code=0, grace=5)
    try:
        assert _wait(lambda: len(_pids(starts)) == 1)
        (service,) = _pids(starts)
        proc.send_signal(signal.SIGTERM)
        # the service has Python's default SIGTERM: it dies of it, and the supervisor says so
        assert proc.wait(10) == 128 + signal.SIGTERM
        assert _wait(lambda: not _alive(service), 5)
        assert len(_pids(starts)) == 1, "a stop is not a failure: not started again"
    finally:
        proc.kill()


def test_a_sigkill_of_the_supervisor_takes_the_service_with_it(tmp_path):
    """The chaos tests SIGKILL a router's pid, the supervisor's: the router must die as well,
    or its shards would never move to the other router."""
    proc, starts = _supervise(tmp_path, seconds=-1, code=0, grace=5)
    try:
        assert _wait(lambda: len(_pids(starts)) == 1)
        (service,) = _pids(starts)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert _wait(lambda: not _alive(service), 5), "the service died with its supervisor"
    finally:
        proc.kill()
