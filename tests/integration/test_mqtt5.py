"""MQTT 5 devices beside MQTT 3.1.1 devices, through the federation and the router
(paho-mqtt's MQTT 5 client against RabbitMQ 4.0 gateways).

What a device maker would check: a reading's user properties arrive in Kafka;
a command reaches an MQTT 5 device with its deadline, and a stale one is not
delivered but dead-lettered with the reason; the device's answer (response
topic + correlation data) is what `fedgate send --wait` prints; an MQTT 3.1.1
device on the same gateway notices none of it.
"""

from __future__ import annotations

import threading
import time

import pytest

from backend import contract as c
from backend.amqp import send_and_wait, send_command
from fedgate.devices import Received, SimDevice, publish_properties
from tests.helpers import device, kafka_records, record_counts, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def mqtt5(endpoints, region, dev_id, **kw) -> SimDevice:
    return device(endpoints, region, dev_id, mqtt5=True, **kw)


def test_an_mqtt5_and_an_mqtt311_device_share_a_gateway_and_both_readings_reach_kafka(endpoints, uid):
    new, old = f"m5-{uid}", f"m311-{uid}"
    d5, d3 = mqtt5(endpoints, "local-eu", new), device(endpoints, "local-eu", old)
    try:
        props = publish_properties(user={"unit": "celsius", "fw": "2.1.0"}, content_type="application/json")
        d5.publish(c.device_telemetry_topic(new), {"t": 21.5}, properties=props)
        d3.publish(c.device_telemetry_topic(old), {"t": 19.0})
        got = kafka_records(
            endpoints,
            c.KAFKA_TELEMETRY_TOPIC,
            lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) in (new, old),
            expect=2,
        )
        by_device = {h[c.KAFKA_DEVICE_HEADER]: h for _m, h in got}
        assert set(by_device) == {new, old}, f"both readings bridged: {sorted(by_device)}"
        h5, h3 = by_device[new], by_device[old]
        assert h5["mqtt.user.unit"] == "celsius" and h5["mqtt.user.fw"] == "2.1.0"
        assert h5[c.KAFKA_CONTENT_TYPE_HEADER] == "application/json"
        assert h5[c.KAFKA_REGION_HEADER] == "local-eu"
        assert not [k for k in h3 if k.startswith("mqtt.")], (
            f"an MQTT 3.1.1 reading has no MQTT 5 headers: {h3}"
        )

        # both get their commands; only the MQTT 5 device sees properties
        for d in (d5, d3):
            d.subscribe(c.device_command_topic(d.device_id, "#"))
            wait_present(endpoints, d.device_id, "local-eu")
            send_command(
                endpoints["backend"]["url"],
                d.device_id,
                c.device_command_topic(d.device_id, "blink"),
                "on",
                content_type="text/plain",
            )
        r5, r3 = d5.wait_for(1)[0], d3.wait_for(1)[0]
        assert (r5.payload, r3.payload) == (b"on", b"on")
        assert r5.prop("ContentType") == "text/plain" and r3.properties is None
    finally:
        d5.close()
        d3.close()


def test_a_command_reaches_an_mqtt5_device_with_its_deadline(endpoints, uid):
    dev_id = f"m5-deadline-{uid}"
    d = mqtt5(endpoints, "local-us", dev_id)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        wait_present(endpoints, dev_id, "local-us")
        sent_at = time.time()
        send_command(
            endpoints["backend"]["url"], dev_id, c.device_command_topic(dev_id, "x"), "go", expires_in_s=60
        )
        r = d.wait_for(1)[0]
        deadline_s = int(r.user_properties[c.EXPIRES_AT_HEADER]) / 1000
        assert sent_at + 59 <= deadline_s <= time.time() + 60, "the deadline the sender asked for"
    finally:
        d.close()


def test_a_command_that_expires_while_its_device_is_away_is_dead_lettered_not_delivered(endpoints, uid):
    dev_id = f"m5-stale-{uid}"
    url = endpoints["backend"]["url"]
    d = mqtt5(endpoints, "local-eu", dev_id)
    d.subscribe(c.device_command_topic(dev_id, "#"))
    wait_present(endpoints, dev_id, "local-eu")
    d.close()  # known to the router, now offline: commands are parked
    time.sleep(1.0)
    send_command(url, dev_id, c.device_command_topic(dev_id, "stale"), "old", expires_in_s=1.5)
    send_command(url, dev_id, c.device_command_topic(dev_id, "fresh"), "new", expires_in_s=120)
    time.sleep(3.0)
    d = mqtt5(endpoints, "local-us", dev_id)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        received = d.wait_for(1, timeout=15)
        time.sleep(2.0)  # the stale one would come now
        dead = kafka_records(
            endpoints,
            c.KAFKA_DEADLETTER_TOPIC,
            lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id,
            expect=1,
        )
        payloads = [r.payload for r in d.received]
        record_counts(sent=2, delivered=len(payloads), expired_with_reason=len(dead), lost=0)
        assert payloads == [b"new"], f"only the command still valid is delivered: {payloads}"
        assert [m.value() for m, _h in dead] == [b"old"]
        assert "expired" in dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER], dead[0][1]
        assert received
    finally:
        d.close()


def test_an_mqtt5_devices_answer_is_what_its_sender_gets(endpoints, uid):
    dev_id = f"m5-answers-{uid}"
    d = mqtt5(endpoints, "local-eu", dev_id)
    answered: list[Received] = []

    def answer_everything() -> None:
        while not stop.is_set():
            for r in d.received[len(answered) :]:
                d.reply(r, {"ok": True, "did": r.payload.decode()})
                answered.append(r)
            time.sleep(0.05)

    stop = threading.Event()
    answering = threading.Thread(target=answer_everything, daemon=True)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        wait_present(endpoints, dev_id, "local-eu")
        answering.start()
        command_id, reply = send_and_wait(
            endpoints["backend"]["url"], dev_id, c.device_command_topic(dev_id, "reboot"), "now", timeout_s=20
        )
        assert reply is not None, "the device answered within 20 s"
        assert reply.payload == b'{"ok": true, "did": "now"}' and reply.region == "local-eu"
        # the sender can have the answer before the device has the gateway's PUBACK for it, so
        # the command is read from what the device received, not from what it has answered
        cmd = d.received[0]
        assert cmd.prop("ResponseTopic") == c.device_reply_topic(dev_id)
        assert cmd.prop("CorrelationData") == command_id.encode()
        # the answer is a device message like any other: analysts have it too
        replies = kafka_records(
            endpoints,
            "telemetry.replies",
            lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id,
            expect=1,
        )
        assert replies and replies[0][1][c.KAFKA_CORRELATION_DATA_HEADER] == command_id
    finally:
        stop.set()
        if answering.is_alive():  # an answer still waiting for its PUBACK ends before the device does
            answering.join(timeout=15)
        d.close()


def test_a_response_topic_the_device_may_not_publish_to_is_refused_with_the_reason(endpoints, uid):
    dev_id = f"m5-refused-{uid}"
    send_command(
        endpoints["backend"]["url"],
        dev_id,
        c.device_command_topic(dev_id, "x"),
        "p",
        response_topic=f"devices/someone-else-{uid}/replies",
        correlation_id="c-1",
    )
    dead = kafka_records(
        endpoints, c.KAFKA_DEADLETTER_TOPIC, lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id, expect=1
    )
    assert dead and "response topic" in dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER]
