"""Commands to devices subscribed at QoS 0, which acknowledge them themselves (router/acks.py).

QoS 0 costs a gateway less than half the memory of a QoS 1 subscription, but
MQTT delivers it at most once. What is tried here: a command the device
never got (it does not acknowledge), a device that drops before it
acknowledges and comes back at another gateway, and a device that never
acknowledges. Each test prints what was sent, delivered, acknowledged and
lost."""

from __future__ import annotations

import time

import pytest

from backend import contract as c
from backend.amqp import send_command
from tests.helpers import device, kafka_records, record_counts, router_metrics, wait_metric, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

ACK_TIMEOUT_S = 10.0  # router default (ack_timeout_s)


def send(endpoints, dev_id, name, payload, **kw):
    send_command(endpoints["backend"]["url"], dev_id, c.device_command_topic(dev_id, name), payload, **kw)


def metric(endpoints, name):
    return router_metrics(endpoints).get(name, 0.0)


def qos0_device(endpoints, region, dev_id):
    d = device(endpoints, region, dev_id)
    d.subscribe(c.device_command_topic(dev_id, "#"), qos=0)
    wait_present(endpoints, dev_id, region)
    return d


def test_a_qos0_subscriber_that_acknowledges_gets_each_command_once(endpoints, uid):
    dev_id = f"ack0-{uid}"
    acked, resent = (metric(endpoints, f"fedgate_router_{m}_total") for m in ("acked", "resent"))
    d = qos0_device(endpoints, "local-eu", dev_id)
    try:
        for i in range(3):
            send(endpoints, dev_id, "step", str(i))
        got = d.wait_for(3)
        d.ack(*got)
        wait_metric(endpoints, "fedgate_router_acked_total", acked + 3, timeout=20)
        time.sleep(ACK_TIMEOUT_S + 3)  # a command still on record would be sent again by now
        payloads = [r.payload for r in d.received]
        record_counts(sent=3, delivered=len(payloads), acknowledged=3, lost=0)
        assert payloads == [b"0", b"1", b"2"], "each once, in order"
        assert metric(endpoints, "fedgate_router_resent_total") == resent
    finally:
        d.close()


def test_a_command_a_qos0_subscriber_did_not_acknowledge_is_sent_again(endpoints, uid):
    """As if the gateway had dropped it (QoS 0 under overload) or it were lost on the way."""
    dev_id = f"ack-lost-{uid}"
    d = qos0_device(endpoints, "local-us", dev_id)
    try:
        send(endpoints, dev_id, "open", "door")
        first = d.wait_for(1)[0]  # the device "loses" it: no acknowledgement
        again = d.wait_for(2, timeout=ACK_TIMEOUT_S + 15)
        assert [r.payload for r in again] == [b"door", b"door"], "sent again after the ack timeout"
        assert again[1].at - first.at >= ACK_TIMEOUT_S - 1
        d.ack(again[1])
        time.sleep(ACK_TIMEOUT_S + 3)
        record_counts(sent=1, delivered=len(d.received), acknowledged=1, lost=0, delivered_twice=1)
        assert len(d.received) == 2, "acknowledged: not sent a third time"
    finally:
        d.close()


def test_a_qos0_device_that_drops_before_acknowledging_gets_it_at_its_next_session(endpoints, uid):
    dev_id = f"ack-drop-{uid}"
    d = qos0_device(endpoints, "local-eu", dev_id)
    send(endpoints, dev_id, "config", "v2")
    assert d.wait_for(1)[0].payload == b"v2"
    d.close()  # clean session: whatever it had not acknowledged is gone from the gateway
    d2 = device(endpoints, "local-us", dev_id)
    try:
        started = time.monotonic()
        d2.subscribe(c.device_command_topic(dev_id, "#"), qos=0)
        got = d2.wait_for(1, timeout=15)
        assert [r.payload for r in got] == [b"v2"], "the new session gets it as soon as it subscribes"
        assert time.monotonic() - started < ACK_TIMEOUT_S, "without waiting for the ack timeout"
        d2.ack(got[0])
        record_counts(sent=1, delivered=2, acknowledged=1, lost=0, delivered_twice=1)
    finally:
        d2.close()


def test_a_command_never_acknowledged_is_dead_lettered_with_the_attempts_when_it_expires(endpoints, uid):
    dev_id = f"ack-never-{uid}"
    d = qos0_device(endpoints, "local-eu", dev_id)
    try:
        send(endpoints, dev_id, "x", "never-acked", expires_in_s=4)
        d.wait_for(1)
        dead = kafka_records(
            endpoints, c.KAFKA_DEADLETTER_TOPIC, lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id, 1
        )
        record_counts(sent=1, delivered=len(d.received), acknowledged=0, dead_lettered=len(dead), lost=0)
        assert dead, "dead-lettered once its expiry passed"
        assert "never acknowledged" in dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER]
    finally:
        d.close()


def test_qos1_subscribers_are_not_asked_to_acknowledge(endpoints, uid):
    dev_id = f"ack1-{uid}"
    resent = metric(endpoints, "fedgate_router_resent_total")
    d = device(endpoints, "local-eu", dev_id)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"), qos=1)
        wait_present(endpoints, dev_id, "local-eu")
        send(endpoints, dev_id, "x", "once")
        d.wait_for(1)
        time.sleep(ACK_TIMEOUT_S + 3)
        assert [r.payload for r in d.received] == [b"once"]
        assert metric(endpoints, "fedgate_router_resent_total") == resent
    finally:
        d.close()
