"""`fedgate army` against the test federation: small armies, every count checked against Kafka.

Tried: 60 devices in two worker processes over both regions, publishing
300 readings/s for 6 s while the backend sends 20 commands/s through the
router; then the same army with a reconnect storm in the middle.  The army
counts what the gateways acknowledged against what a Kafka consumer reads
back and what the devices received; the test checks those counts and
that the report adds up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fedgate import army

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.slow]


def test_an_army_publishes_and_receives_and_nothing_acknowledged_is_lost(federation, uid):
    plan = army.ArmyPlan(
        devices=60, rate=300, duration_s=6, processes=2, commands_per_s=20, prefix=f"army-{uid}"
    )
    r = army.run_army(federation, plan, progress=print)
    up, down, conn = r["uplink"], r["downlink"], r["connections"]
    assert r["workers_failed"] == {}
    assert conn["connects"] == 60 and conn["refused"] == 0, "every device logged in with its own secret"
    assert r["regions"] == ["local-eu", "local-us"]
    # about the offered rate: 300/s for 6 s
    assert 0.5 * 300 * 6 <= up["acked"] <= up["sent"] <= 300 * 6 * 1.1
    assert up["lost"] == 0 and up["in_kafka"] >= up["acked"], "every acknowledged reading is in Kafka"
    assert up["latency_ms"]["p50"] is not None and up["latency_ms"]["p50"] <= up["latency_ms"]["max"]
    assert down["sent"] > 0 and down["lost"] == 0 and down["received"] >= down["sent"]
    assert army.ok(r)


def test_an_army_survives_a_reconnect_storm_without_losing_an_acknowledged_reading(federation, uid):
    plan = army.ArmyPlan(
        devices=40, rate=200, duration_s=8, processes=2, storm_at_s=3, prefix=f"storm-army-{uid}"
    )
    r = army.run_army(federation, plan, progress=print)
    conn, up = r["connections"], r["uplink"]
    assert conn["storm_dropped"] == 40, "the storm dropped every connection"
    assert conn["connects"] >= 80, "and every device came back"
    assert up["lost"] == 0 and up["in_kafka"] >= up["acked"] > 0


def test_the_cli_reports_json_and_exits_0(federation, uid):
    out = subprocess.run(
        [sys.executable, "-m", "fedgate.cli", "army", "--devices", "10", "--rate", "50", "--duration", "3"]
        + ["--processes", "1", "--prefix", f"cli-army-{uid}", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "FEDGATE_STATE_DIR": str(federation.state_dir)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["uplink"]["lost"] == 0 and report["uplink"]["acked"] > 0
    assert "connected 10/10" in out.stderr, "the progress line"
