"""A local region joins and leaves the running federation (`make gateway REGION=local-…`)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from backend import contract as c
from backend.amqp import Tap, send_command
from infra.local import processes
from tests.helpers import device, kafka_records, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def test_a_third_region_joins_carries_traffic_both_ways_and_leaves_no_trace(federation, uid):
    region = "local-ap"
    others = {n.name: n.pid() for n in federation.nodes()}
    federation.add_region(region)
    try:
        assert {n.name: n.pid() for n in federation.nodes() if n.name in others} == others, (
            "nothing restarted"
        )
        ep = federation.endpoints()
        dev_id = f"ap-{uid}"
        with Tap(ep["backend"]["url"], c.TELEMETRY_EXCHANGE, [f"devices.{dev_id}.#"]) as tap:
            d = device(ep, region, dev_id)
            try:
                d.subscribe(c.device_command_topic(dev_id, "#"))
                wait_present(ep, dev_id, region)
                send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "hello"), b"hi")
                assert [r.payload for r in d.wait_for(1)] == [b"hi"], (
                    "a routed command reached the new region"
                )
                d.publish(f"devices/{dev_id}/telemetry", {"seq": 1})
            finally:
                d.close()
            got = tap.drain(expect=1, timeout=15)
        assert [m.region for m in got] == [region], "telemetry reached the backend tagged with the new region"
        recs = kafka_records(
            ep, "telemetry.telemetry", lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id, 1
        )
        assert recs and recs[0][1][c.KAFKA_REGION_HEADER] == region, "and Kafka"
    finally:
        federation.remove_region(region)

    assert processes.marked_pids(processes.marker(federation.state_dir, f"gw-{region}")) == []
    assert f"gw-{region}" not in {n.name for n in federation.nodes()}
    backend = federation.backend().admin()
    assert c.gateway_upstream_name(region) not in {
        p["name"] for p in backend.get("parameters/federation-upstream")
    }
    assert c.downlink_exchange(region) not in {x["name"] for x in backend.get("exchanges")}
    assert not [q for q in backend.queues() if region in q["name"]]
    ep = federation.endpoints()
    with urllib.request.urlopen(ep["router"]["metrics"] + "/presence", timeout=5) as r:
        assert region not in json.load(r)["per_region"], "the router forgot the region"
    time.sleep(0.5)
    assert sorted(s for _, s in federation.link_states()["backend"]) == ["running"] * 4
