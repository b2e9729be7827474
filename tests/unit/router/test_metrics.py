"""The router's /metrics as Prometheus reads it: every series declared with its HELP, named
by Prometheus's conventions, parsed back by prometheus_client's own parser."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import CATALOG, Metrics

ROUTER = Path(__file__).resolve().parents[3] / "router"


def _families(metrics: Metrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render())}


def test_every_metric_the_router_names_is_declared_with_its_help_and_labels():
    named = set()
    for source in ROUTER.glob("*.py"):
        named |= set(re.findall(r'"(fedgate_router_[a-z_]+)"', source.read_text()))
    assert named, "no metric name found in router/"
    assert named - CATALOG.keys() == set(), "named in router/ but not declared in CATALOG"
    for name, spec in CATALOG.items():
        assert spec.help.strip() and spec.help != name, name
        if spec.kind == "counter":
            assert name.endswith("_total"), f"{name}: a counter's name ends in _total"
        else:
            assert not name.endswith("_total"), f"{name}: only counters end in _total"
        if spec.kind == "histogram":
            assert name.endswith("_seconds") and spec.buckets == tuple(sorted(spec.buckets)), name


def test_counters_gauges_and_histograms_parse_back_with_their_type_help_and_labels():
    m = Metrics()
    m.inc("fedgate_router_routed_total", region="local-eu")
    m.inc("fedgate_router_routed_total", region="local-eu")
    m.inc("fedgate_router_gateway_refusals_total", call="users", region="local-us")
    m.observe("fedgate_router_kafka_delivery_seconds", 0.003)
    m.observe("fedgate_router_reading_latency_seconds", 0.04, region="local-eu")
    m.observe("fedgate_router_reading_latency_seconds", 700, region="local-eu")
    m.gauge("fedgate_router_inflight", lambda: {(): 7.0})
    m.gauge("fedgate_router_uplink_reconnects_total", lambda: {(): 2.0})
    families = _families(m)

    routed = families["fedgate_router_routed"]
    assert routed.type == "counter" and routed.documentation == CATALOG["fedgate_router_routed_total"].help
    assert [(s.name, s.labels, s.value) for s in routed.samples] == [
        ("fedgate_router_routed_total", {"region": "local-eu"}, 2.0)
    ]
    [refusal] = families["fedgate_router_gateway_refusals"].samples
    assert refusal.labels == {"region": "local-us", "call": "users"}
    # a counter kept elsewhere (the connection's reconnects) is still a counter
    assert families["fedgate_router_uplink_reconnects"].type == "counter"
    assert families["fedgate_router_inflight"].samples[0].value == 7.0

    latency = {
        (s.name, s.labels.get("le")): s.value
        for s in families["fedgate_router_reading_latency_seconds"].samples
    }
    assert latency[("fedgate_router_reading_latency_seconds_bucket", "0.025")] == 0
    assert latency[("fedgate_router_reading_latency_seconds_bucket", "0.05")] == 1
    assert latency[("fedgate_router_reading_latency_seconds_bucket", "300.0")] == 1
    assert latency[("fedgate_router_reading_latency_seconds_bucket", "+Inf")] == 2
    assert latency[("fedgate_router_reading_latency_seconds_count", None)] == 2
    assert latency[("fedgate_router_reading_latency_seconds_sum", None)] == 700.04
    delivery = families["fedgate_router_kafka_delivery_seconds"]
    assert delivery.type == "histogram" and delivery.samples[0].labels == {"le": "0.001"}


def test_the_process_and_the_build_are_there_as_prometheus_client_gives_them():
    families = _families(Metrics())
    [build] = families["fedgate_build_info"].samples
    assert build.value == 1 and set(build.labels) == {"version", "python"} and build.labels["version"]
    assert families["process_cpu_seconds"].samples[0].value > 0
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    for family in families.values():
        assert family.documentation, f"{family.name} has no HELP"


def test_two_routers_in_one_process_keep_their_own_numbers():
    a, b = Metrics(), Metrics()
    a.inc("fedgate_router_batches_total")
    assert "fedgate_router_batches" in _families(a)
    assert "fedgate_router_batches" not in _families(b)


def test_the_operators_guide_lists_every_series_with_its_meaning():
    guide = (ROUTER.parent / "docs" / "operations.md").read_text()
    section = guide[guide.index("## Observing the fleet") :]
    for name, spec in CATALOG.items():
        assert f"| `{name}` | {spec.kind} |" in section, f"{name} missing from docs/operations.md"
