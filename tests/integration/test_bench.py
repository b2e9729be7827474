"""`make bench QUICK=1` runs end to end, so the benchmarks cannot rot.

One test, as `make bench QUICK=1` runs them: the benchmarks in turn on
one federation, each finding it as the one before left it.  All but the
last: the HA benchmark's quick run measures the tests' HA federation
rather than boot one of its own (tests/ha/test_ha_bench.py).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench import army_bench, cost_bench, router_bench, scale_bench, spark_bench
from bench.suite import run_suite
from tests.conftest import TEST_JVM_OPTIONS

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(1100)
def test_quick_benchmarks_produce_their_figures_and_lose_nothing(monkeypatch):
    # its block clear of `make up` (17000), `make bench` (19000, 21000) and the federations of
    # the lanes beside it (tests/conftest.py LANES): the HA benchmark's (25000), the session's
    # (27000), test_lifecycle's (28000), the HA profile's (29000); below the ephemeral ports
    monkeypatch.setenv("FEDGATE_BENCH_PORT_BASE", "23000")
    monkeypatch.setenv("FEDGATE_BENCH_JVM_OPTIONS", TEST_JVM_OPTIONS)  # its checks count, not time
    results = run_suite(["spark", "router", "cost", "army", "scale"], quick=True)
    assert list(results) == ["spark", "router", "cost", "army", "scale"]
    for name, r in results.items():
        files = [Path(f) for f in r["files"]]
        assert json.loads(files[0].read_text())["quick"] is True, name
        assert files[1].read_text().startswith("#"), f"{name}: the Markdown table"

    # spark: raises if a reading or a burst record is missing or doubled
    r = results["spark"]
    s = r["steady"]
    assert s["rows"] == s["sent"] > 0, "every reading sent at the steady rate is a row, once"
    assert 0 < s["freshness_p50_ms"] <= s["freshness_p95_ms"] <= s["freshness_max_ms"]
    assert s["device_to_kafka_p50_ms"] < s["freshness_p50_ms"], "a row is queryable only after Kafka had it"
    idle = r["idle"]  # the job watched with nothing to land, after the steady readings
    assert idle["seconds"] > 0 and 0 < idle["job_cpu_cores"] < r["machine"]["cpus"], idle
    first = r["first_minutes"]
    assert first["rows"] == first["sent"] > 0, "the job's first minutes are measured on every reading too"
    assert 0 < first["freshness_p50_ms"] <= first["freshness_p95_ms"]
    step = r["army_step"]  # a faster rate after the steady one, its rows dated the same way
    assert step["rows"] == step["sent"] > 0 and step["rate_per_s"] > s["rate_per_s"]
    assert 0 < step["freshness_p50_ms"] <= step["freshness_p95_ms"]
    ingest = r["ingest"]
    assert ingest["raw_rows_per_s"] > 0 and ingest["all_tables_rows_per_s"] > 0
    assert r["spark_batch_per_s"] > 0 and r["python_consume_per_s"] > 0
    assert r["job_vs_spark_batch"] > 0
    assert ingest["all_tables_s"] >= ingest["raw_s"], "the aggregates count a row after it landed"
    # each the median of its runs (one each in the quick run), the backlog one of them whole
    assert ingest["all_tables_rows_per_s"] in r["ingest_runs"]
    assert r["spark_batch_per_s"] == round(statistics.median(r["spark_batch_warm_runs"]))
    burst = r["burst"]  # the same count produced into the running job
    assert 0 < burst["raw_s"] <= burst["all_tables_s"] and r["burst_vs_spark_batch"] > 0
    assert "row queryable" in spark_bench.to_markdown(r)

    # router: measured alone, after the Spark benchmark had the federation's routers running
    r = results["router"]
    for key in ("kafka_produce_raw_per_s", "amqp_consume_raw_per_s", "router_bridged_per_s"):
        assert r[key] > 0, key
    assert r["router_vs_slowest_reference"] > 0
    batched = r["router_batched"]  # the same readings in the gateways' batches
    assert batched["per_s"] > 0 and batched["readings_per_batch"] > 1
    d = r["downlink"]
    assert d["router"]["received"] == d["router"]["sent"], "every command reached the device"
    assert d["direct"]["received"] == d["direct"]["sent"]
    assert r["router_profile_top"], "the profiled run says where the time goes"
    md = router_bench.to_markdown(r)
    assert "fedgate router" in md and "| direct |" in md and "gateways' batches" in md

    # cost: each part's cores at one step, fedgate and the baseline, and the idle federation's
    r = results["cost"]
    for name, parts in {
        "fedgate": ("gateway", "backend", "routers", "kafka"),
        "baseline": ("mosquitto", "bridge"),
    }.items():
        (step,) = r[name]["steps"]
        assert step["lost"] == 0 and step["acked"] > 0, f"{name} lost acknowledged readings"
        assert all(step["cpu_cores"][p] > 0 for p in parts), f"{name}: every part's CPU measured"
        assert step["system_us_per_reading"] > 0
        assert set(r[name]["idle_cores"]) >= set(parts), f"{name}: the idle cost, part by part"
    assert r["goals"] == [], "the quick run's 200/s is no goal's rate"
    assert "| idle |" in cost_bench.to_markdown(r)

    # army: the routers are back for it
    r = results["army"]
    for name in ("fedgate", "baseline"):
        steps = r[name]["steps"]
        assert [s["offered"] for s in steps] == [200, 400]
        for s in steps:
            assert s["workers_failed"] == {} and s["acked"] > 0
            assert set(s["backlog_peak"]) >= {"devices"}, "where readings waited"
            assert s["lost"] == 0, f"{name} lost acknowledged readings at {s['offered']}/s"
            assert s["latency_ms"]["p50"] <= s["latency_ms"]["p99"]
        d = r[name]["downlink"]
        assert d["sent"] > 0 and d["lost"] == 0, f"{name}: every confirmed command reached its device"
        conn = r[name]["connections"]
        assert conn["connected"] == conn["devices"] == 300
        # memory per device: idle, QoS 0 and QoS 1 command subscriptions, each on a fresh broker
        assert list(r[name]["memory"]) == ["idle", "qos0", "qos1"]
        for mode, m in r[name]["memory"].items():
            assert m["devices"] == 300 and m["connected"] >= 300, f"{name} {mode}"
            assert m["subscribed"] == (0 if m["command_qos"] is None else 300), f"{name} {mode}: SUBACKs"
            assert m["rss_mb_before"] > 0 and isinstance(m["kb_per_device"], float)
            assert f"memory_per_device_{mode}_fedgate_vs_baseline" in r["ratios"]
    for mode, m in r["fedgate"]["memory"].items():
        assert m["breakdown_kb_per_device"]["total_rss"] is not None, f"{mode}: RabbitMQ's memory breakdown"
    assert r["fedgate"]["memory"]["qos1"]["kb_per_device"] > 0, "a classic queue process per device"
    assert r["fedgate"]["broker"].startswith("RabbitMQ 4.")
    assert r["baseline"]["broker"].startswith("Mosquitto 2."), "Debian 13's Mosquitto, its version known"
    hops = set(r["fedgate"]["steps"][0]["backlog_peak"])
    assert hops == {"devices", "gateway_federation", "backend_shards"}
    cores = r["fedgate"]["steps"][0]["cpu_cores"]
    assert cores["gateway"] > 0 and cores["army"] > 0, "the CPU each part used during the step"
    cores = r["baseline"]["steps"][0]["cpu_cores"]
    assert cores["mosquitto"] > 0 and cores["bridge"] > 0, "the baseline's parts measured as fedgate's"
    for name in ("fedgate", "baseline"):
        s = r[name]["steps"][0]
        assert s["sent_per_s"] > 0 and s["per_core"] > 0 and s["us_per_reading"], name
        # the quick run stops at its last step: a ceiling is named only when a step above the
        # sustained rate was not carried (a lower step the suite's load spoiled is not a ceiling)
        best = army_bench.sustained(r[name]["steps"]) or 0
        failed_above = [
            s["offered"] for s in r[name]["steps"] if s["offered"] > best and not army_bench.carried(s)
        ]
        assert (r[name]["ceiling"] == "not reached") == (not failed_above), (name, best, failed_above)
    # the cost lines are fitted over the steps carried (p99 under 2 s...): beside the suite's
    # other lanes the quick run's 400/s step may not be, and the model then says why
    carried = [s for s in r["fedgate"]["steps"] if army_bench.carried(s)]
    costs = r["sizing"]["costs"]
    if len(carried) >= 2:
        assert set(costs) == {"gateway", "backend", "routers", "kafka"}, "each hop's cost fitted"
        assert r["sizing"]["fleets"][0]["per_region"]["nodes"] >= 3, "a fleet sized from them"
    else:
        assert costs == {} and r["sizing"]["fleets"] == []
        assert f"{len(carried)} step(s) carried" in r["sizing"]["why_not"]
    assert r["kafka_produce_raw_per_s"] > 0 and r["rabbitmq_mqtt_raw"]["acked_per_s"] > 0
    assert len(r["plots"]) == 3 and all(Path(p).stat().st_size > 0 for p in r["plots"])
    cdf = r["fedgate"]["steps"][0]["latency_cdf_ms"]
    assert len(cdf) == 100 and cdf == sorted(cdf), "the CDF the plot draws"
    md = army_bench.to_markdown(r)
    assert "| offered/s | fedgate acked/s" in md and "Mosquitto" in md
    assert "| QoS 1 command subscription |" in md and "Where the gateway's memory goes" in md

    # scale: one region's gateway cluster (two nodes in the quick run) holds the devices while
    # each sends, every reading looked up in Kafka, and the backend commands a sample of them
    r = results["scale"]
    h = r["held"]
    assert r["cluster"]["nodes"] == r["cluster"]["nodes_running"] == 2
    assert sorted(r["devices_per_node"].values()) == [500, 500], "the devices spread over the nodes"
    assert h["held"] == h["devices"] == 1000 and h["subscribed"] == 1000, "every device held"
    assert h["uplink"]["acked"] > 0 and h["uplink"]["lost"] == 0, "nothing acknowledged was lost"
    d = h["downlink"]
    assert d["sent"] > 0 and d["lost"] == 0 and d["received"] >= d["sent"], "every command delivered"
    assert h["rss_mb_before"] > 0 and h["breakdown_kb_per_device"]["total_rss"] is not None
    assert r["cpu_cores"]["gateways"] > 0
    assert "devices dialling each node" in scale_bench.to_markdown(r)
