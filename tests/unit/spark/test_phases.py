"""A batch's phases: wall and CPU time per phase, and their medians for the benchmark."""

from __future__ import annotations

import os
import time

from spark.phases import PhaseClock, engine_ms, median_phases, process_cpu_s


def test_a_phase_counts_the_cpu_spent_in_it_and_not_the_waiting():
    clock = PhaseClock(jvm_pid=os.getpid())  # this process stands in for the JVM: counted twice
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    clock.lap("busy")
    time.sleep(0.2)
    clock.lap("idle")
    busy_wall, busy_cpu = clock.phases["busy"]
    idle_wall, idle_cpu = clock.phases["idle"]
    assert busy_wall >= 190 and busy_cpu >= 300  # this process's CPU, and again as the "JVM"'s
    assert idle_wall >= 190 and idle_cpu < 50


def test_without_a_local_jvm_the_cpu_is_this_process_s():
    clock = PhaseClock(jvm_pid=None)
    clock.lap("nothing")
    assert clock.phases["nothing"][1] < 50
    assert process_cpu_s(2**22 + 1) is None  # beyond pid_max: no such process


def test_engine_phases_come_from_the_batch_s_progress():
    progress = {"durationMs": {"latestOffset": 12, "queryPlanning": 30, "addBatch": 900, "walCommit": 8}}
    assert engine_ms(progress) == {"latestOffset": 12, "queryPlanning": 30, "walCommit": 8}
    assert engine_ms({}) == {}


def test_medians_per_phase_over_the_batches_that_had_it():
    batches = [
        {"phases": {"summary": [100, 150], "telemetry_raw": [400, 500]}, "engine_ms": {"walCommit": 10}},
        {"phases": {"summary": [200, 250], "telemetry_raw": [600, 700], "rejects": [50, 60]}},
        {"phases": {"summary": [300, 350], "telemetry_raw": [500, 600]}, "engine_ms": {"walCommit": 30}},
    ]
    m = median_phases(batches)
    assert m["summary"] == {"wall_ms": 200.0, "cpu_ms": 250.0, "batches": 3}
    assert m["telemetry_raw"]["cpu_ms"] == 600.0
    assert m["rejects"] == {"wall_ms": 50.0, "cpu_ms": 60.0, "batches": 1}
    assert m["engine: walCommit"] == {"wall_ms": 20.0, "batches": 2}
