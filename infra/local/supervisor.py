"""Keep a local service running, as systemd's `Restart=always` does for the cloud's routers.

    python -m infra.local.supervisor -- python -m router --config router.toml

A router that finds itself unable to go on (a fatal or stalled Kafka producer,
router/kafka.py) fails /health and exits 1: its shards go to the other routers
at once, and this starts it again, after 1 s, then 2, 4 ... 30 s while it
keeps failing (back to 1 s once it ran a minute).  What it does not restart:

- a first start that fails within `--first-start-grace` seconds (a wrong
  setting, a backend that is not there): the driver waiting for the service
  to boot sees the failure at once, with the service's own exit code;
- a service that exits 0: it was asked to stop (SIGTERM, SIGINT).

SIGTERM, SIGINT and SIGHUP go on to the service, and this exits with its exit
code once it has.  The service dies with this process (PR_SET_PDEATHSIG): a
SIGKILL of the supervisor's pid, as the chaos tests send, kills the service
as it would a service run without one.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from infra.local.processes import die_with_parent

#: The first restart's delay, doubled on each quick failure up to MAX_DELAY_S.
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
#: A service up this long before it failed is restarted after FIRST_DELAY_S again.
STEADY_AFTER_S = 60.0


def supervise(command: Sequence[str], first_start_grace: float, say=print) -> int:
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: object) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    delay, first = FIRST_DELAY_S, True
    while True:
        started = time.monotonic()
        child = subprocess.Popen(list(command), preexec_fn=die_with_parent)
        if stopping.is_set():  # a stop that came while it was being started
            child.send_signal(signal.SIGTERM)
        code = child.wait()
        up = time.monotonic() - started
        if stopping.is_set() or code == 0:
            return code if code >= 0 else 128 - code
        if first and up < first_start_grace:
            say(f"supervisor: the service failed at its first start (exit {code}); not restarting it")
            return code if code >= 0 else 128 - code
        first = False
        if up >= STEADY_AFTER_S:
            delay = FIRST_DELAY_S
        say(f"supervisor: the service exited ({code}) after {up:.0f} s; starting it again in {delay:.0f} s")
        sys.stdout.flush()
        if stopping.wait(delay):
            return 0
        delay = min(delay * 2, MAX_DELAY_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.local.supervisor", description=__doc__.split("\n")[0])
    p.add_argument(
        "--first-start-grace",
        type=float,
        default=15.0,
        help="seconds within which a failed first start is reported, not restarted",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the service's command line")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to supervise (give it after --)")
    return supervise(command, args.first_start_grace, say=lambda m: print(m, flush=True))


if __name__ == "__main__":
    sys.exit(main())
