"""The README's `make demo` scene, run against the test federation so the README cannot rot."""

from __future__ import annotations

import re

import pytest

from fedgate.demo import run_demo

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("spark_job")]


def test_demo_scene_passes_every_check_and_says_how_to_stop(federation, capsys):
    assert run_demo(federation) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert out.count("PASS") == 13
    assert "steps are on record in Kafka (routed at" in out and "routed at local-" in out
    assert "spark: 20/20 readings in telemetry_raw, each once" in out
    assert "from local-eu    10 messages" in out and "from local-us    10 messages" in out
    assert "make down" in out
    # each region's devices asked the DNS server from their own network and got their region's gateway
    for n, region in ((1, "local-eu"), (2, "local-us")):
        assert re.search(
            rf"{region}\s+from 127\.\d+\.10{n}\.0/24\s+answered 127\.\d+\.{n}\.1 \({region}\)", out
        ), out
    assert "answered the sender's question" in out and "'firmware': '2.1.0'" in out
