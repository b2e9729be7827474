"""Where a micro-batch's time and CPU go, phase by phase: the job's log line of each batch,
its progress file's `recent_batches`, and `make bench BENCH=spark`'s table of a steady batch.

A batch's phases, in order (spark/job.py, TelemetryJob.land_batch):

  summary        the batch read from Kafka, parsed and summarized (one Spark job: reading
                 and parsing are lazy, so they run here)
  rejects        the MERGE into rejects (only when the batch holds one)
  telemetry_raw  the MERGE into telemetry_raw: Iceberg's scan planning, the lookup of
                 earlier copies, the write and the commit
  keep           the batch kept in memory for the aggregates' count (a backlog's only)
  pause          the wait that spaces the batches (freshness_target_s): its CPU is what
                 ran beside it (a count, a compaction, GC), not the batch's

and, from the streaming engine's own progress of the batch (`engine_ms`, wall time only):
the offsets asked of Kafka (latestOffset), the plan (queryPlanning), the offsets written
before the batch (walCommit) and the commit written after it (commitOffsets).

CPU is the job's JVM's (every thread: the batch's tasks, and whatever runs beside them -- a
count of the aggregates, GC, the JIT) plus this Python process's, read from /proc: a phase's
CPU is exact when nothing runs beside the batch.  With executors elsewhere (a cluster), the
CPU is the driver's only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from statistics import median

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")

#: The streaming engine's phases of a batch, from its progress's durationMs.
ENGINE_PHASES = ("latestOffset", "queryPlanning", "walCommit", "commitOffsets")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (None: not readable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S


class PhaseClock:
    """Wall and CPU milliseconds of one batch's consecutive phases: lap(name) ends a phase."""

    def __init__(self, jvm_pid: int | None):
        self._jvm_pid = jvm_pid
        self.phases: dict[str, list[int]] = {}
        self._wall, self._cpu = time.monotonic(), self._cpu_s()

    def _cpu_s(self) -> float:
        jvm = process_cpu_s(self._jvm_pid) if self._jvm_pid is not None else None
        return time.process_time() + (jvm or 0.0)

    def lap(self, name: str) -> None:
        wall, cpu = time.monotonic(), self._cpu_s()
        self.phases[name] = [round((wall - self._wall) * 1000), round((cpu - self._cpu) * 1000)]
        self._wall, self._cpu = wall, cpu


def engine_ms(progress: dict) -> dict[str, int]:
    """The streaming engine's own phases of a batch (ENGINE_PHASES) from its progress."""
    durations = progress.get("durationMs") or {}
    return {name: int(durations[name]) for name in ENGINE_PHASES if name in durations}


def median_phases(batches: list[dict]) -> dict[str, dict[str, float]]:
    """Per phase, the median wall and CPU ms over `batches` (recent_batches entries), the
    engine's phases (wall only) included; a phase counts only the batches that had it."""
    walls: dict[str, list[int]] = {}
    cpus: dict[str, list[int]] = {}
    for b in batches:
        for name, (wall, cpu) in (b.get("phases") or {}).items():
            walls.setdefault(name, []).append(wall)
            cpus.setdefault(name, []).append(cpu)
        for name, wall in (b.get("engine_ms") or {}).items():
            walls.setdefault(f"engine: {name}", []).append(wall)
    out = {}
    for name, values in walls.items():
        out[name] = {"wall_ms": float(median(values)), "batches": len(values)}
        if name in cpus:
            out[name]["cpu_ms"] = float(median(cpus[name]))
    return out
