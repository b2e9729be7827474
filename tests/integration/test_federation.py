"""The federation's message paths against real RabbitMQ nodes and real MQTT devices."""

from __future__ import annotations

import json
import time

import pika
import pika.exceptions
import pytest

from backend import contract as c
from backend.amqp import Tap, connect, publish_downlink
from fedgate.devices import SimDevice
from gateways import mqtt_plugin
from tests.helpers import REFUSED, device, operator_client

pytestmark = pytest.mark.integration


def test_uplink_from_both_gateways_arrives_tagged_with_the_right_region(endpoints, uid):
    url = endpoints["backend"]["url"]
    sent = {}
    keys = [f"devices.{region}-{uid}.#" for region in ("local-eu", "local-us")]
    with Tap(url, c.TELEMETRY_EXCHANGE, keys) as tap:
        for region in ("local-eu", "local-us"):
            dev_id = f"{region}-{uid}"
            with device(endpoints, region, dev_id) as d:
                for i in range(10):
                    d.publish(f"devices/{dev_id}/telemetry", {"seq": i}, qos=1)
            sent[dev_id] = region
        got = tap.drain(expect=20, timeout=15)
    assert len(got) == 20, f"sent 20 QoS 1 messages, backend got {len(got)}"
    for m in got:
        assert m.region == sent[m.device], f"{m.topic} came from {sent[m.device]} but is tagged {m.region}"
    for dev_id in sent:
        seqs = [json.loads(m.payload)["seq"] for m in got if m.device == dev_id]
        assert seqs == list(range(10)), f"{dev_id}: per-device order kept, nothing lost"


def test_downlink_reaches_only_the_target_regions_gateway(endpoints, federation, uid):
    """Same topic filter subscribed on both gateways: only the target region's subscriber gets it."""
    url = endpoints["backend"]["url"]
    target = f"dev-{uid}"
    topic = c.device_command_topic(target, "reboot")
    # operators' clients: a device may only subscribe to its own commands
    eu = operator_client(endpoints, "local-eu", f"eu-{uid}")
    us = operator_client(endpoints, "local-us", f"us-{uid}")
    try:
        eu.subscribe(f"devices/{target}/commands/#")
        us.subscribe(f"devices/{target}/commands/#")
        publish_downlink(url, "local-eu", topic, b"now")
        got = eu.wait_for(1, timeout=10)
        time.sleep(1.0)  # time for a misrouted copy to arrive at the other gateway
        assert [(r.topic, r.payload) for r in got] == [(topic, b"now")]
        assert us.received == [], "the local-us gateway must not receive local-eu's downlink"
    finally:
        eu.close()
        us.close()


def test_downlink_keeps_no_per_device_bindings_on_the_backend(endpoints, federation, uid):
    """Many devices subscribed on a gateway still mean one binding on the backend's downlink exchange."""
    devs = [device(endpoints, "local-eu", f"many-{uid}-{i}") for i in range(5)]
    try:
        for d in devs:
            d.subscribe(c.device_command_topic(d.device_id, "#"))
        time.sleep(0.5)
        bindings = (
            federation.backend()
            .admin()
            .get(f"exchanges/%2F/{c.downlink_exchange('local-eu')}/bindings/source")
        )
        assert len(bindings) == 1, bindings
        assert bindings[0]["routing_key"] == "#"
    finally:
        for d in devs:
            d.close()


def test_downlink_commands_do_not_echo_back_into_telemetry(endpoints, uid):
    url = endpoints["backend"]["url"]
    dev_id = f"echo-{uid}"
    with (
        Tap(url, c.TELEMETRY_EXCHANGE, [f"devices.{dev_id}.#"]) as tap,
        device(endpoints, "local-us", dev_id) as d,
    ):
        d.subscribe(c.device_command_topic(dev_id, "#"))
        publish_downlink(url, "local-us", c.device_command_topic(dev_id, "ping"), b"1")
        assert d.wait_for(1, timeout=10)
        assert tap.drain(timeout=2) == []


def test_connection_events_of_both_gateways_reach_the_backend(endpoints, uid):
    url = endpoints["backend"]["url"]
    with Tap(url, c.PRESENCE_EXCHANGE, c.PRESENCE_EVENT_KEYS) as tap:
        for region in ("local-eu", "local-us"):
            device(endpoints, region, f"presence-{region}-{uid}").close()
        events = tap.drain(expect=4, timeout=10)
    seen = {(e.region, e.topic) for e in events}
    for region in ("local-eu", "local-us"):
        assert (region, "connection/created") in seen
        assert (region, "connection/closed") in seen
    created = [e for e in events if e.topic == "connection/created"]
    for e in created:
        # the client id's place in the event differs between RabbitMQ releases: the adapter knows it
        assert mqtt_plugin.client_id_from_event(e.headers) == f"presence-{e.region}-{uid}"


def test_guest_does_not_exist_and_gateway_credentials_are_confined_to_their_region(federation, endpoints):
    host = endpoints["host"]
    for node in federation.nodes():
        if node.spec.role in ("backend", "gateway"):
            users = {u["name"] for u in node.admin().get("users")}
            assert "guest" not in users, node.name
            with pytest.raises(pika.exceptions.ProbableAuthenticationError):
                connect(f"amqp://guest:guest@{host}:{node.spec.ports['amqp']}/%2F")
    # local-eu's gateway credentials cannot read local-us's downlink
    pw = json.loads(federation.secrets_file.read_text())["gateways"]["local-eu"]
    conn = connect(f"amqp://gw-local-eu:{pw}@{host}:{endpoints['backend']['amqp']}/%2F")
    try:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="ACCESS_REFUSED"):
            q = ch.queue_declare("", exclusive=True).method.queue
            ch.queue_bind(q, c.downlink_exchange("local-us"), "#")
    finally:
        if conn.is_open:
            conn.close()


def test_devices_need_credentials(endpoints):
    from fedgate.devices import DeviceError

    ep = endpoints
    d = SimDevice(
        "intruder",
        ep["gateways"]["local-eu"]["address"],
        ep["gateways"]["local-eu"]["mqtt"],
        "device",
        "wrong",
    )
    with pytest.raises(DeviceError, match=REFUSED):
        d.connect(timeout=5)


def test_management_shows_every_federation_link_running(federation):
    states = federation.link_states()
    assert sorted(s for _, s in states["backend"]) == ["running"] * 4
    for gw in ("gw-local-eu", "gw-local-us"):
        assert [s for _, s in states[gw]] == ["running"]
