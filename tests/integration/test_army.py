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
from tests.helpers import record_counts

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


ROAM_REGION = "local-ak"


def test_an_army_finds_its_gateways_by_dns_and_follows_the_answers_when_it_roams_and_a_gateway_dies(
    federation, uid
):
    """Tried: 30 devices, half living in a region of their own's client network and half in
    local-eu's, each finding its gateway only by asking the federation's DNS server from its
    network.  At 3 s a fifth of them roam (they move to the other network and ask again); at
    7 s the own region's gateway is SIGKILLed: its devices keep dialling what they were
    answered until the TTL and the health check let DNS answer local-eu, and move there.  The
    gateway is started again when the publishing ends, so what it held reaches Kafka."""
    federation.add_region(ROAM_REGION)
    try:
        plan = army.ArmyPlan(
            devices=30,
            rate=150,
            duration_s=20,
            processes=2,
            regions=[ROAM_REGION, "local-eu"],
            commands_per_s=10,
            roam_at_s=3,
            roam_share=0.2,
            kill_gateway=(ROAM_REGION, 7),
            prefix=f"dns-army-{uid}",
        )
        r = army.run_army(federation, plan, progress=print)
    finally:
        federation.remove_region(ROAM_REGION)
    up, down, conn = r["uplink"], r["downlink"], r["connections"]
    print(army.to_text(r))
    assert r["workers_failed"] == {}
    assert conn["roamed"] == 6, "a fifth of each worker's 15 devices roamed"
    assert conn["dns_questions"] > 0 and conn["dns_errors"] == 0
    # one question per client network and worker per TTL, not one per device and connect
    assert conn["dns_questions"] < conn["connects"], conn
    assert conn["connected_at_end"] == {"local-eu": 30}, "the killed region's devices moved to the next"
    # seconds after the kill (at 7 s of a 20 s run, drained after), not a wall-clock time
    assert 0 < conn["all_back_after_kill_s"] < 60, conn
    record_counts(
        devices=30,
        dns_questions=conn["dns_questions"],
        roamed=conn["roamed"],
        all_back_after_kill_s=conn["all_back_after_kill_s"],
        acked=up["acked"],
        lost=up["lost"],
        commands_sent=down["sent"],
        commands_lost=down["lost"],
    )
    assert up["lost"] == 0 and up["in_kafka"] >= up["acked"] > 0, up
    assert down["sent"] > 0 and down["lost"] == 0, down
