"""A local region joins and leaves the running federation (`make gateway REGION=local-…`)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from backend import contract as c
from backend import region_registry
from backend.amqp import Tap, send_command
from backend.polling import wait_until
from fedgate.devices import SimDevice
from fedgate.dns_resolver import device_address, resolver_for
from fedgate.resolver import Endpoint
from infra.dns.query import DnsServer, ask_server
from infra.local import processes
from infra.local.driver import gateway_node_name
from infra.local.services import RouterNode
from tests.helpers import device, kafka_records, leader_url, record_counts, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def routers(federation) -> list[RouterNode]:
    return [n for n in federation.nodes() if isinstance(n, RouterNode) and n.is_running()]


def wait_routers_regions(federation, want: set[str], timeout: float = 20.0) -> dict[str, list[str] | None]:
    """Until every running router routes to exactly `want`; what each routes to."""
    have: dict[str, list[str] | None] = {}

    def right() -> bool:
        nonlocal have
        have = {r.name: r.regions() for r in routers(federation)}
        return all(set(h or ()) == want for h in have.values())

    wait_until(right, timeout, 0.5)
    return have


def test_a_region_registered_in_the_backend_reaches_running_routers_and_a_malformed_one_is_skipped(
    federation,
):
    """Tried: with the routers running, an operator's tooling registers a region in the
    backend (no config file, no signal: in the cloud nothing can send one), then a malformed
    entry, then deregisters both.  The routers follow within a poll, skip the malformed entry
    with an error in their log, and nothing restarts."""
    admin = federation.backend().admin()
    before = set(region_registry.registered(admin))
    pids = {r.name: r.pid() for r in routers(federation)}
    assert pids, "the federation runs routers"
    # a region whose gateways do not answer (nothing listens on port 9): its presence is kept
    # empty, nothing is sent there while it is registered
    extra = {"management_url": ["http://127.0.0.1:9"], "user": "fedgate-admin", "password": "x"}
    try:
        # the malformed entry first: a poll that sees local-zz has read local-bad too (one
        # read lists both), so the wait below cannot end before a router met the bad entry
        region_registry.register(admin, "local-bad", {"management_url": 42})
        region_registry.register(admin, "local-zz", extra)
        have = wait_routers_regions(federation, before | {"local-zz"})
        assert all(set(h or ()) == before | {"local-zz"} for h in have.values()), (
            f"every router added the registered region and skipped the malformed one: {have}"
        )
    finally:
        region_registry.deregister(admin, "local-zz")
        region_registry.deregister(admin, "local-bad")
    have = wait_routers_regions(federation, before)
    assert all(set(h or ()) == before for h in have.values()), f"and dropped it when deregistered: {have}"
    assert {r.name: r.pid() for r in routers(federation)} == pids, "no router restarted"
    for r in routers(federation):
        log = r.log_file.read_text(errors="replace")
        assert "registered region local-bad skipped" in log, f"{r.name} says why it skipped the entry"


def test_a_third_region_joins_carries_traffic_both_ways_and_leaves_no_trace(federation, endpoints, uid):
    region = "local-ap"
    others = {n.name: n.pid() for n in federation.nodes()}
    before = {r.name: r.regions() for r in routers(federation)}
    assert before and all(h is not None for h in before.values()), f"every router answers: {before}"
    federation.add_region(region)
    try:
        assert {n.name: n.pid() for n in federation.nodes() if n.name in others} == others, (
            "nothing restarted"
        )
        # the routers learnt it from the backend's registry, where the wiring put it
        assert region in region_registry.registered(federation.backend().admin())
        have = {r.name: r.regions() for r in routers(federation)}
        assert have and all(h is not None and region in h for h in have.values()), have
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
    assert region not in region_registry.registered(backend), "the backend's registry forgot it"
    # every router answers and no longer routes there (one that does not answer proves nothing)
    have = wait_routers_regions(federation, set(next(iter(before.values())) or ()))
    assert have.keys() == before.keys() and all(h is not None and region not in h for h in have.values()), (
        f"so did the routers: {have}"
    )
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


def _answered(ep: dict, region: str, want: str, timeout: float) -> float:
    """Seconds until the DNS server answers a client of `region`'s network `want` (no cache)."""
    dns_ep = ep["dns"]
    server, source = (
        DnsServer(dns_ep["host"], dns_ep["port"]),
        device_address(dns_ep["client_networks"][region], "q"),
    )
    t0 = time.monotonic()
    while (got := ask_server(server, dns_ep["name"], source)[0]) != [want]:
        assert time.monotonic() - t0 < timeout, f"answered {got}, not {want}, after {timeout} s"
        time.sleep(0.1)
    return round(time.monotonic() - t0, 1)


def test_a_device_finds_its_region_by_dns_and_the_next_when_its_gateway_dies_and_its_commands_follow(
    federation, uid
):
    """`make gateway REGION=local-fo`: its client network is answered its gateway within a
    health-check interval.  A device there resolves mqtt.<domain> and connects; its gateway
    stopped, DNS answers the next region (local-eu) once the health check saw it and the
    device's TTL ran out: the device reconnects there and a command sent then reaches it.
    The gateway back, new resolutions return to it."""
    region = "local-fo"
    federation.add_region(region)
    try:
        ep = federation.endpoints()
        dns_ep, own = ep["dns"], ep["gateways"][region]
        interval, ttl = dns_ep["health_check_interval"], dns_ep["ttl"]
        new_region_after = _answered(ep, region, own["address"], timeout=interval * 2 + 2)
        near = Endpoint(region, own["address"], own["mqtt"])
        dev_id = f"fo-{uid}"
        secret = federation.add_devices([dev_id])[dev_id]
        dev = SimDevice.nearest(dev_id, resolver_for(ep, region, dev_id), dev_id, secret, keepalive=5)
        with dev.connect():
            assert dev.region == region
            wait_present(ep, dev_id, region)
            federation.node(gateway_node_name(region)).stop()  # the gateway dies
            stopped_at = time.monotonic()
            deadline = stopped_at + ttl + interval + 20
            while not (dev.connected and dev.region == "local-eu") and time.monotonic() < deadline:
                time.sleep(0.05)
            moved_after = round(time.monotonic() - stopped_at, 1)
            assert dev.region == "local-eu" and dev.connected, "device did not fail over to local-eu"
            assert dev.failovers == [near]
            dev.subscribe(c.device_command_topic(dev_id, "#"))
            wait_present(ep, dev_id, "local-eu")
            send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "hello"), b"hi")
            assert [r.payload for r in dev.wait_for(1)] == [b"hi"], "its command followed it to local-eu"
            federation.start_node(gateway_node_name(region))
            back_after = _answered(ep, region, own["address"], timeout=interval * 2 + 2)
        record_counts(
            dns_ttl_s=ttl,
            health_check_interval_s=interval,
            new_region_answered_after_s=new_region_after,
            device_on_the_next_region_after_s=moved_after,
            answered_its_gateway_again_after_s=back_after,
        )
    finally:
        federation.remove_region(region)
