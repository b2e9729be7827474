"""Where the suite's CPU goes: `pytest --cpu-usage=FILE` appends one JSON line per test.

The suite's time on two cores is bound by CPU, not by waits (six lanes keep the cores
94% busy), so cutting it means knowing which tests burn CPU.  Each line holds:

- ``tree_cpu_s``: CPU seconds spent by this worker and every process below it (the nodes it
  started, live or reaped) while the test ran, its fixtures' setup and teardown included;
  what a command-line `fedgate up` leaves behind (reparented to init) is not counted;
- ``machine_cpu_s``: CPU seconds the whole machine was busy meanwhile (other lanes included);
- ``wall_s``, ``lane`` and ``nodeid``.

A test's tree misses what runs outside it (a federation `fedgate up` left to init, the other
lanes' engines), so the controller also samples every process on the machine every 2 s and,
at the session's end, appends one line ``{"kinds": {kind: CPU s}, ...}``: each process's own
CPU from its first sample on, by what it is (a RabbitMQ node by name, a Kafka broker, a
Spark JVM, Terraform's AWS provider, a router...).  A process that lives under 2 s is missed.
Each process is also put down to the test that started it (pytest's PYTEST_CURRENT_TEST,
which every child inherits; a session fixture's engines go to the test they started with):
the line's ``by_file`` sums the CPU by that test's file and kind, engines included.

`python -m tests.cpu_usage FILE` sums them per file and per kind, most CPU first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third (state) on, or None if the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return raw[raw.rindex(")") + 2 :].split()


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and its reaped children), or None if gone."""
    if (fields := _stat_fields(pid)) is None:
        return None
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


#: Kinds a process may leave by exec: spark-submit's bash script becomes the driver's JVM,
#: rabbitmq-server's sh script the node's Erlang VM (same pid): asked again at each sample.
LAUNCHERS = {"bash", "sh", "dash", "env"}


def running_tests(out: str) -> Path:
    """The folder where each pytest process writes the file of the test it runs (named by
    its pid): /proc/PID/environ shows a process's environment at its start only, so a
    worker's own PYTEST_CURRENT_TEST cannot be read from outside."""
    return Path(f"{out}.running")


def started_by(pid: int) -> str:
    """The file of the test during which the process started, from the PYTEST_CURRENT_TEST
    it inherited; "" if its environment has none (the sampler then asks its parent)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    for e in env:
        if e.startswith(b"PYTEST_CURRENT_TEST="):
            return e.split(b"=", 1)[1].decode(errors="replace").split("::", 1)[0]
    return ""


def process_kind(pid: int, cmdline: str) -> str:
    """What a process is, in words an operator knows (its pid and digits left out)."""
    exe = cmdline.split(" ", 1)[0]
    if "beam.smp" in exe:  # RabbitMQ 4 starts distribution late: its name is in the environment
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        names = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RABBITMQ_NODENAME=")]
        return f"RabbitMQ {re.sub(r'[0-9]+', 'N', names[0].split('@')[0])}" if names else "Erlang VM"
    if exe.endswith("java"):
        if " kafka.Kafka " in cmdline:
            return "Kafka broker"
        if "spark" in cmdline.lower():
            return "Spark JVM"
        return "other JVM"
    if "terraform-provider-" in exe:
        return "Terraform provider " + exe.rsplit("terraform-provider-", 1)[1].split("_", 1)[0]
    if "python" in exe:
        # the module first: a router's or a CLI's arguments may name a pytest tmp_path
        if (m := re.search(r" -m (\S+)", cmdline)) and m.group(1) not in ("pytest", "xdist"):
            return f"python -m {m.group(1)}"
        script = Path(cmdline.split(" ")[1]).name if " " in cmdline else ""
        if "xdist" in cmdline or " -u -c " in cmdline or " -m pytest" in cmdline or script == "pytest":
            return "pytest"
        return f"python {script}" if script else "python"
    return Path(exe).name or "?"


class ProcessSampler:
    """Every process's own CPU (user + system), sampled every `every` s, summed by kind."""

    def __init__(self, running: Path, every: float = 2.0):
        self.every = every
        self.running = running
        #: (pid, start time) -> [CPU ticks at the first sample, at the last, kind, test file]
        self.seen: dict[tuple[int, str], list[Any]] = {}
        #: pid -> the test file its process was put down to (a reused pid: the newest)
        self.test_of: dict[int, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cpu-usage-sampler", daemon=True)
        self.t0, self.machine0 = time.monotonic(), machine_cpu()

    def _sample(self, first: bool) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if (fields := _stat_fields(pid)) is None:
                continue
            try:
                key, ticks = (pid, fields[19]), int(fields[11]) + int(fields[12])
                if key in self.seen and self.seen[key][2] not in LAUNCHERS:
                    self.seen[key][1] = ticks
                    continue
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                cmdline = argv.decode(errors="replace").strip()
                kind = process_kind(pid, cmdline) if cmdline else "kernel"
            except (OSError, ValueError):
                continue  # gone meanwhile
            if key in self.seen:  # a launcher, maybe exec'd into what it launched meanwhile
                self.seen[key][1:3] = [ticks, kind]
                continue
            # one running before the session counts from now; a new one from its start.  An
            # engine started with an environment of its own is its parent's (a node under
            # the supervisor, a JVM under spark-submit's shell), when the parent was seen
            test_file = (
                started_by(pid) or self.test_of.get(int(fields[1]), "") or self._running(int(fields[1]))
            )
            self.test_of[pid] = test_file
            self.seen[key] = [ticks if first else 0, ticks, kind, test_file]

    def _running(self, pid: int) -> str:
        """The test the pytest process `pid` runs now, "" if it is none of them."""
        try:
            return (self.running / str(pid)).read_text()
        except OSError:
            return ""

    def _run(self) -> None:
        self._sample(first=True)
        while not self.stop.wait(self.every):
            self._sample(first=False)

    def start(self) -> ProcessSampler:
        self.thread.start()
        return self

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        self.thread.join(10)
        self._sample(first=False)
        kinds: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        by_file: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for first, last, kind, test_file in self.seen.values():
            kinds[kind] += (last - first) / TICK
            counts[kind] += 1
            by_file[test_file or "(no test)"][kind] += (last - first) / TICK
        return {
            "kinds": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v >= 0.5},
            "processes": {k: counts[k] for k in kinds if kinds[k] >= 0.5},
            "by_file": {
                f: {k: round(v, 1) for k, v in sorted(ks.items(), key=lambda kv: -kv[1]) if v >= 0.5}
                for f, ks in sorted(by_file.items(), key=lambda kv: -sum(kv[1].values()))
            },
            "wall_s": round(time.monotonic() - self.t0, 1),
            "machine_cpu_s": round(machine_cpu() - self.machine0, 1),
        }


_sampler: ProcessSampler | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _sampler
    # the controller only (an xdist worker has workerinput): one sampler for the machine
    if session.config.getoption("--cpu-usage") and not hasattr(session.config, "workerinput"):
        _sampler = ProcessSampler(running_tests(session.config.getoption("--cpu-usage"))).start()


@pytest.hookimpl(trylast=True)  # after the session's fixtures were torn down (their nodes stopped)
def pytest_sessionfinish(session: pytest.Session) -> None:
    global _sampler
    if _sampler is None:
        return
    summary, _sampler = _sampler.finish(), None
    shutil.rmtree(running_tests(session.config.getoption("--cpu-usage")), ignore_errors=True)
    with open(session.config.getoption("--cpu-usage"), "a") as f:
        f.write(json.dumps(summary) + "\n")


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
    # what the sampler reads for a process this one starts with an environment of its own
    running = running_tests(out)
    running.mkdir(exist_ok=True)
    (running / str(me)).write_text(item.nodeid.split("::", 1)[0])
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
    kinds: list[dict[str, Any]] = []
    for raw in path.read_text().splitlines():
        row = json.loads(raw)
        if "kinds" in row:
            kinds.append(row)
            continue
        for key in ("wall_s", "tree_cpu_s"):
            per_file[row["nodeid"].split("::", 1)[0]][key] += row[key]
            per_lane[row["lane"]][key] += row[key]
    lines = ["| file | CPU s | wall s |", "|---|---:|---:|"]
    for name, v in sorted(per_file.items(), key=lambda kv: -kv[1]["tree_cpu_s"]):
        lines.append(f"| `{name}` | {v['tree_cpu_s']:.0f} | {v['wall_s']:.0f} |")
    lines += ["", "| lane | CPU s | wall s |", "|---|---:|---:|"]
    for name, v in sorted(per_lane.items()):
        lines.append(f"| {name} | {v['tree_cpu_s']:.0f} | {v['wall_s']:.0f} |")
    for run in kinds:
        lines += [
            "",
            f"Every process on the machine, by kind ({run['wall_s']:.0f} s; the machine busy "
            f"{run['machine_cpu_s']:.0f} CPU s, {sum(run['kinds'].values()):.0f} of them sampled):",
            "",
            "| kind | processes | CPU s |",
            "|---|---:|---:|",
        ]
        for name, cpu in run["kinds"].items():
            lines.append(f"| {name} | {run['processes'][name]} | {cpu:.0f} |")
        lines += [
            "",
            "By the file whose test started them:",
            "",
            "| file | CPU s | most of it |",
            "|---|---:|---|",
        ]
        for name, ks in run.get("by_file", {}).items():
            if (total := sum(ks.values())) >= 1:
                top = ", ".join(f"{k} {v:.0f}" for k, v in list(ks.items())[:3])
                lines.append(f"| `{name}` | {total:.0f} | {top} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1])))
