"""`make bench BENCH=ha QUICK=1` runs end to end on the HA federation of these tests.

The HA benchmark boots a federation of the HA profile of its own; here it
measures the one the node-loss scenarios used (tests/ha/conftest.py), after
them, so that the suite boots one HA federation, not two.  The single
profile's side is the benchmarks' own federation, booted by the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import ha_bench
from bench.army_bench import carried
from bench.goals import goals
from bench.suite import run_suite
from infra.local.driver import LocalFederation
from tests.conftest import TEST_JVM_OPTIONS

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_the_ha_benchmark_measures_both_profiles_and_loses_nothing(
    ha_federation: LocalFederation, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the single profile's block clear of `make up` (17000), `make bench` (19000, 21000), the
    # quick benchmarks' (23000) and the federations of the lanes beside it (tests/conftest.py
    # LANES): the sessions' (26000, 27000), test_lifecycle's (28000), this package's (29000)
    monkeypatch.setenv("FEDGATE_BENCH_PORT_BASE", "25000")
    monkeypatch.setenv("FEDGATE_BENCH_JVM_OPTIONS", TEST_JVM_OPTIONS)  # its checks count, not time
    results = run_suite(["ha"], quick=True, ha_federation=ha_federation)
    assert list(results) == ["ha"]
    r = results["ha"]
    files = [Path(f) for f in r["files"]]
    assert json.loads(files[0].read_text())["quick"] is True
    assert files[1].read_text().startswith("# The HA profile's cost"), "the Markdown table"

    for profile in ("single", "ha"):
        p = r[profile]
        assert [s["offered"] for s in p["steps"]] == [200, 400], profile
        assert all(s["lost"] == 0 and s["acked"] > 0 for s in p["steps"]), f"{profile} lost readings"
        d = p["downlink"]
        # at least once: a command may come twice (the received count has the copies)
        assert d["lost"] == 0 and d["received"] - d["duplicated"] == d["sent"] > 0, f"{profile}: {d}"
        assert p["rss_idle_mb"] > 0
        assert p["steps"][0]["cpu_cores"]["gateway"] > 0, f"{profile}: the CPU each kind of node used"
        # the commands went beside readings, every reading of that phase in Kafka too
        m = p["mixed"]
        assert (m["readings_per_s"], m["commands_per_s"]) == ha_bench.MIXED[True][:2], profile
        assert m["lost"] == 0 and m["acked"] > 0, f"{profile} lost readings beside the commands"
        assert d["latency_ms"]["p50"] is not None and d["latency_ms"]["p50"] <= d["latency_ms"]["p99"]
    # through a node of each engine SIGKILLed in turn (the HA profile only): none lost
    f = r["ha"]["faults"]
    assert "faults" not in r["single"]
    assert [k["kind"] for k in f["killed"]] == ["gateway", "kafka", "router", "backend"], f["killed"]
    assert f["lost"] == 0 and f["acked"] > 0, f"readings lost through the faults: {f}"
    d = f["commands"]
    # every confirmed command arrived; one whose confirm died with the backend node may arrive
    # too (not promised, and counted among the received): at least the confirmed ones
    assert d["lost"] == 0 and d["received"] - d["duplicated"] >= d["sent"] > 0, f"commands: {d}"
    assert r["ha"]["nodes"] > r["single"]["nodes"]
    assert r["ratios"]["rss_idle_ha_vs_single"] > 1, "three nodes of each engine hold more memory than one"
    # the CPU ratio is taken at the highest step both profiles carried (none: not measured)
    both = [
        x["offered"]
        for x in r["single"]["steps"]
        for y in r["ha"]["steps"]
        if x["offered"] == y["offered"] and carried(x) and carried(y)
    ]
    assert r["cpu"]["offered"] == (max(both) if both else None), r["cpu"]
    if both:
        assert r["cpu"]["ha_cores"] > 0 and r["cpu"]["single_cores"] > 0
    md = ha_bench.to_markdown(r)
    assert "| sustained QoS 1" in md and "was up before the benchmark" in md
    assert "readings/s): delivered of sent, sent twice" in md
    assert "through faults (" in md and "SIGKILLed and left down: gw-" in md
    # its four goals, each with its ratio or "not measured", in the run's goals file
    rows = [g for g in goals(results) if g["goal"].startswith("HA profile")]
    assert len(rows) == 4 and all(g["ratio"] is None or g["ratio"] >= 0 for g in rows), rows
