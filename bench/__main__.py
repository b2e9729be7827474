"""`make bench`: every benchmark in turn, on one federation (bench/suite.py).

    python -m bench                 # all of them
    BENCH=spark QUICK=1 python -m bench

Each writes bench/results/<name>-<timestamp>.json and .md and prints the table.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from bench.suite import choose, run_suite
from infra.local.processes import sigterm_as_interrupt


def main() -> int:
    # SIGTERM gets Ctrl-C's clean-up: the suite stops its federation (whose nodes run in sessions
    # of their own, out of reach of a signal to this process group) and the army its workers
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    quick = os.environ.get("QUICK") not in (None, "", "0")
    names = os.environ.get("BENCH") or None  # `make bench` passes BENCH= when none is chosen
    try:
        chosen = choose(names.split(",") if names else None)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    run_suite(chosen, quick=quick)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
