"""`make bench QUICK=1` runs end to end, so the benchmark cannot rot."""

from __future__ import annotations

import pytest

from bench.router_bench import run, to_markdown

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_quick_router_benchmark_produces_figures_and_ratios(monkeypatch):
    monkeypatch.setenv("FEDGATE_BENCH_PORT_BASE", "29500")  # clear of the test federation and `make bench`
    r = run(quick=True)
    for key in ("kafka_produce_raw_per_s", "amqp_consume_raw_per_s", "router_bridged_per_s"):
        assert r[key] > 0, key
    assert r["router_vs_slowest_reference"] > 0
    d = r["downlink"]
    assert d["router"]["received"] == d["router"]["sent"], "every command reached the device"
    assert d["direct"]["received"] == d["direct"]["sent"]
    assert r["router_profile_top"], "the profiled run says where the time goes"
    md = to_markdown(r)
    assert "fedgate router" in md and "| direct |" in md
