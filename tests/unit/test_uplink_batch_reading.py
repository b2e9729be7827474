"""What a tool reading the backend's telemetry exchange gets from a batch: each reading, as a
message of its own, with the region of the batch's hop, filtered by the tool's binding keys."""

from __future__ import annotations

from types import SimpleNamespace

import pika
from pamqp.commands import Basic

from backend import contract as c
from backend import uplink_batch
from backend.amqp import topic_key_matches, unbatched


def test_binding_keys_match_as_rabbitmq_topic_exchanges_do():
    assert topic_key_matches("devices.d1.#", "devices.d1")
    assert topic_key_matches("devices.d1.#", "devices.d1.telemetry.a")
    assert not topic_key_matches("devices.d1.#", "devices.d10.telemetry")
    assert topic_key_matches("devices.*.acks", "devices.d.acks")
    assert not topic_key_matches("devices.*.acks", "devices.d.x.acks")
    assert topic_key_matches("#", "anything.at.all") and topic_key_matches("a.#.z", "a.z")


def test_a_batch_reads_as_its_readings_with_the_batchs_region():
    body = uplink_batch.encode(
        [
            uplink_batch.Reading(
                "devices.d1.telemetry", b"1", Basic.Properties(content_type="application/json")
            ),
            uplink_batch.Reading("devices.d2.state", b"2"),
        ]
    )
    hops = [{"cluster-name": "local-us"}]
    props = pika.BasicProperties(
        content_type=uplink_batch.BATCH_CONTENT_TYPE, headers={c.RECEIVED_FROM_HEADER: hops}
    )
    method = SimpleNamespace(routing_key="fedgate-batch.local-us.2", delivery_tag=9)
    msgs = unbatched(method, props, body)
    assert [(m.topic, m.payload, m.region) for m in msgs] == [
        ("devices/d1/telemetry", b"1", "local-us"),
        ("devices/d2/state", b"2", "local-us"),
    ]
    assert msgs[0].content_type == "application/json" and msgs[0].device == "d1"
    single = unbatched(
        SimpleNamespace(routing_key="devices.d3.telemetry", delivery_tag=1), pika.BasicProperties(), b"3"
    )
    assert [(m.topic, m.payload) for m in single] == [("devices/d3/telemetry", b"3")]
