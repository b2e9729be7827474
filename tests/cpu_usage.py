"""Where the suite's CPU goes: `pytest --cpu-usage=FILE` appends one JSON line per test.

The suite's time on two cores is bound by CPU, not by waits (four lanes keep the cores
85% busy), so cutting it means knowing which tests burn CPU.  Each line holds:

- ``tree_cpu_s``: CPU seconds spent by this worker and every process below it (the nodes it
  started, live or reaped) while the test ran, its fixtures' setup and teardown included;
  what a command-line `fedgate up` leaves behind (reparented to init) is not counted;
- ``machine_cpu_s``: CPU seconds the whole machine was busy meanwhile (other lanes included);
- ``wall_s``, ``lane`` and ``nodeid``.

`python -m tests.cpu_usage FILE` sums them per file, most CPU first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and its reaped children), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return ppid, utime + stime + cutime + cstime


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and every live descendant (each including its reaped children)."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = s
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total / TICK


def machine_cpu() -> float:
    """CPU seconds the machine has been busy since boot (all but idle and iowait)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-usage", metavar="FILE", help="append each test's CPU seconds to FILE (JSON lines)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    out = item.config.getoption("--cpu-usage")
    if not out:
        yield
        return
    me = os.getpid()
    t0, tree0, machine0 = time.monotonic(), tree_cpu(me), machine_cpu()
    yield
    from tests.conftest import lane_of

    line = {
        "nodeid": item.nodeid,
        "lane": lane_of(item.nodeid),
        "wall_s": round(time.monotonic() - t0, 2),
        "tree_cpu_s": round(tree_cpu(me) - tree0, 2),
        "machine_cpu_s": round(machine_cpu() - machine0, 2),
    }
    # one short write in append mode: the lanes' lines do not interleave
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")


def summarize(path: Path) -> str:
    per_file: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_lane: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for raw in path.read_text().splitlines():
        row = json.loads(raw)
        for key in ("wall_s", "tree_cpu_s"):
            per_file[row["nodeid"].split("::", 1)[0]][key] += row[key]
            per_lane[row["lane"]][key] += row[key]
    lines = ["| file | CPU s | wall s |", "|---|---:|---:|"]
    for name, v in sorted(per_file.items(), key=lambda kv: -kv[1]["tree_cpu_s"]):
        lines.append(f"| `{name}` | {v['tree_cpu_s']:.0f} | {v['wall_s']:.0f} |")
    lines += ["", "| lane | CPU s | wall s |", "|---|---:|---:|"]
    for name, v in sorted(per_lane.items()):
        lines.append(f"| {name} | {v['tree_cpu_s']:.0f} | {v['wall_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1])))
