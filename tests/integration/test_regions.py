"""A local region joins and leaves the running federation (`make gateway REGION=local-…`)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from backend import contract as c
from backend.amqp import Tap, send_command
from fedgate.devices import SimDevice
from fedgate.resolver import Endpoint, NearestHealthyResolver, tcp_connect_probe
from infra.local import processes
from infra.local.driver import gateway_node_name
from tests.helpers import device, kafka_records, leader_url, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def test_a_third_region_joins_carries_traffic_both_ways_and_leaves_no_trace(federation, endpoints, uid):
    region = "local-ap"
    others = {n.name: n.pid() for n in federation.nodes()}
    federation.add_region(region)
    try:
        assert {n.name: n.pid() for n in federation.nodes() if n.name in others} == others, (
            "nothing restarted"
        )
        ep = {**endpoints, **federation.endpoints()}  # now with the new region's gateway
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
            ep, c.KAFKA_TELEMETRY_TOPIC, lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id, 1
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
    with urllib.request.urlopen(leader_url(ep) + "/presence", timeout=5) as r:
        assert region not in json.load(r)["per_region"], "the router forgot the region"
    time.sleep(0.5)
    assert sorted(s for _, s in federation.link_states()["backend"]) == ["running"] * 4


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_tcp_probe_measures_a_listening_gateway_and_fails_a_closed_port(endpoints):
    probe = tcp_connect_probe(timeout=1.0)
    latency = probe(Endpoint("local-eu", endpoints["host"], endpoints["gateways"]["local-eu"]["mqtt"]))
    assert latency is not None and 0 < latency < 1.0
    assert probe(Endpoint("local-us", "127.0.0.1", _closed_port())) is None


def test_a_device_fails_over_to_the_next_gateway_when_its_gateway_dies_and_its_commands_follow(
    federation, uid
):
    region = "local-fo"
    federation.add_region(region)
    try:
        ep = federation.endpoints()
        near = Endpoint(region, ep["host"], ep["gateways"][region]["mqtt"])
        nxt = Endpoint("local-eu", ep["host"], ep["gateways"]["local-eu"]["mqtt"])
        real = tcp_connect_probe(timeout=0.5)

        def probe(e: Endpoint) -> float | None:
            # health is real (the gateway answers or not); the new region is made to look nearer
            lat = real(e)
            return None if lat is None else lat + (0.0 if e == near else 0.05)

        dev_id = f"fo-{uid}"
        dev = SimDevice.nearest(
            dev_id,
            NearestHealthyResolver([nxt, near], probe),
            dev_id,
            federation.add_devices([dev_id])[dev_id],
            keepalive=5,
        )
        with dev:
            assert dev.region == region
            wait_present(ep, dev_id, region)
            federation.node(gateway_node_name(region)).stop()  # the gateway dies
            deadline = time.monotonic() + 30
            while not (dev.connected and dev.region == "local-eu") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert dev.region == "local-eu" and dev.connected, "device did not fail over to local-eu"
            assert dev.failovers == [near]
            dev.subscribe(c.device_command_topic(dev_id, "#"))
            wait_present(ep, dev_id, "local-eu")
            send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "hello"), b"hi")
            assert [r.payload for r in dev.wait_for(1)] == [b"hi"], "its command followed it to local-eu"
    finally:
        federation.remove_region(region)
