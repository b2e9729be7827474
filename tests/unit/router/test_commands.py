"""A command's wire forms (router/commands.py): what a sender puts on the commands
exchange, what the router publishes downlink, and that a returned command keeps all of it."""

import asyncio
import time

import pytest

from backend import contract as c
from gateways.mqtt_plugin import Mqtt5Properties
from router.bridge import mqtt5_headers
from router.commands import BadCommand, downlink_message, parse_command
from router.routing import Command


def test_a_senders_command_with_expiry_and_a_response_topic():
    headers = {
        c.DEVICE_HEADER: "d1",
        c.TOPIC_HEADER: "devices/d1/commands/reboot",
        c.EXPIRES_AT_HEADER: "1800000000000",
        c.RESPONSE_TOPIC_HEADER: "devices/d1/replies",
    }
    cmd = parse_command(headers, "application/json", "cmd-1")
    assert (cmd.device, cmd.topic, cmd.expires_at) == ("d1", "devices/d1/commands/reboot", 1_800_000_000.0)
    assert cmd.properties == Mqtt5Properties(
        content_type="application/json", response_topic="devices/d1/replies", correlation_data=b"cmd-1"
    )


def test_an_expiry_that_is_not_epoch_milliseconds_is_refused_with_the_reason():
    with pytest.raises(BadCommand, match=c.EXPIRES_AT_HEADER):
        parse_command({c.DEVICE_HEADER: "d1", c.EXPIRES_AT_HEADER: "tomorrow"}, None, None)


def test_the_downlink_message_carries_the_remaining_time_and_what_mqtt_5_devices_get():
    expires_at = time.time() + 30
    p = Mqtt5Properties(
        response_topic="devices/d1/replies", correlation_data=b"cmd-1", content_type="text/plain"
    )
    cmd = Command("d1", "devices/d1/commands/x", expires_at=expires_at, properties=p)
    m = downlink_message(cmd, b"{}")
    assert 28_000 <= int(m.properties.expiration) <= 30_000  # milliseconds on the wire
    assert m.correlation_id == "cmd-1" and m.content_type == "text/plain"
    assert m.headers["x-reply-to-topic"] == "devices.d1.replies"
    # what a returned copy (dead-lettered back by the backend) is routed again with
    back = parse_command(m.headers, m.content_type, m.correlation_id)
    assert back.expires_at == pytest.approx(expires_at, abs=0.001)
    assert back.properties == p and (back.device, back.topic) == ("d1", "devices/d1/commands/x")


def test_a_command_past_its_expiry_still_gets_a_positive_expiration():
    m = downlink_message(Command("d1", "devices/d1/commands/x", expires_at=time.time() - 5), b"{}")
    assert int(m.properties.expiration) >= 1


def test_mqtt_5_properties_reach_kafka_as_headers_under_their_own_prefix():
    p = Mqtt5Properties(
        user_properties=(("unit", "C"), ("fedgate.region", "spoofed")),
        content_type="application/json",
        response_topic="devices/d1/replies",
        correlation_data=b"\x00\x01",
    )
    assert mqtt5_headers(p) == [
        ("mqtt.user.unit", b"C"),
        ("mqtt.user.fedgate.region", b"spoofed"),
        ("mqtt.content_type", b"application/json"),
        ("mqtt.response_topic", b"devices/d1/replies"),
        ("mqtt.correlation_data", b"\x00\x01"),
    ]
    assert mqtt5_headers(Mqtt5Properties()) == []


# --- acknowledged commands (router/acks.py) ------------------------------------------------


def test_an_acknowledgement_names_command_ids_and_anything_else_is_refused_with_the_reason():
    assert c.parse_acks(b'{"acks": ["a1", "b2"]}') == ["a1", "b2"]
    for bad in (b"a1", b"[1]", b'{"acks": "a1"}', b'{"acks": [""]}', b'{"acks": [1]}', b"\xff"):
        with pytest.raises(ValueError, match="acknowledgement"):
            c.parse_acks(bad)


def test_the_command_id_a_device_acknowledges_is_in_the_downlink_message():
    m = downlink_message(Command("d1", "devices/d1/commands/x"), b"{}")
    assert m.headers[c.COMMAND_ID_HEADER] == c.message_id("devices/d1/commands/x", b"{}")


def test_only_a_command_reaching_a_connection_through_qos0_subscriptions_alone_is_tracked():
    from router.subscriptions import Subscriptions

    s = Subscriptions()
    s.opened("conn")
    s.add("conn", ["devices/d1/commands/#"], qos=0)
    assert s.only_qos0("conn", "devices/d1/commands/x")
    assert not s.only_qos0("conn", "devices/d1/other")  # not subscribed at all
    s.add("conn", ["devices/d1/commands/urgent"], qos=1)  # overlapping QoS 1: MQTT acknowledges it
    assert not s.only_qos0("conn", "devices/d1/commands/urgent")
    assert s.only_qos0("conn", "devices/d1/commands/x")
    assert not s.only_qos0("unseen-connection", "devices/d1/commands/x")  # filters not known


# --- table writes confirmed after the lock (router/stores.py) ---------------------------------


class _Producer:
    """Delivery reports on demand: the test decides whether Kafka stored a write."""

    def __init__(self):
        self.reports = []

    def send_soon(self, topic, value, key):
        fut = asyncio.get_running_loop().create_future()
        self.reports.append(fut)
        return fut


def _table(producer):
    from router.stores import KafkaTable

    return KafkaTable("127.0.0.1:1", "t", producer, "unit")  # never started: no broker is asked


def test_a_write_made_while_confirmations_are_collected_is_seen_at_once_and_confirmed_later():
    from router.stores import all_confirmed, confirm_later

    async def scenario():
        producer = _Producer()
        table = _table(producer)
        async with confirm_later() as pending:
            await table.put("d1\x00k", b"v")
            assert table.data["d1\x00k"] == b"v", "seen before Kafka answered"
        producer.reports[0].set_result(None)
        await all_confirmed(pending)
        assert table.data["d1\x00k"] == b"v"

    asyncio.run(scenario())


def test_a_write_kafka_refuses_is_taken_back_from_the_view_and_raises():
    from router.stores import all_confirmed, confirm_later

    async def scenario():
        producer = _Producer()
        table = _table(producer)
        table._apply("d1\x00k", b"old")
        async with confirm_later() as pending:
            await table.put("d1\x00k", b"new")
            await table.put("d1\x00gone", None)
        producer.reports[0].set_exception(RuntimeError("Kafka refused"))
        producer.reports[1].set_result(None)
        with pytest.raises(RuntimeError, match="refused"):
            await all_confirmed(pending)
        assert table.data["d1\x00k"] == b"old", "the input is requeued and handled again from here"

    asyncio.run(scenario())


def test_a_device_that_went_offline_stays_known_to_the_next_router_run():
    # the bug: an offline device's record was a tombstone, so a restarted router took it for a
    # device never seen and broadcast its commands, which every gateway dropped
    from router.presence import Session
    from router.stores import PresenceStore

    async def scenario():
        producer = _Producer()
        store = PresenceStore(_table(producer))
        s1 = Session("d1", "local-eu", "n", "c1", 5)
        writes = [store.save_soon(s1), store.save_soon(Session("d2", "local-us", "m", "c2", 6))]
        writes.append(store.offline_soon("d1"))
        for report in producer.reports:
            report.set_result(None)
        await asyncio.gather(*writes)
        assert [s.client_id for s in store.load()] == ["d2"], "only live sessions are rebuilt"
        assert store.seen() == {"d1", "d2"}, "the offline device is still one seen"

    asyncio.run(scenario())


def test_a_command_over_the_size_limit_is_refused_by_the_sender_and_the_router_with_the_reason():
    from backend.amqp import check_command_size
    from backend.errors import FedgateError
    from router.commands import check_size

    cmd = Command("d1", "devices/d1/commands/firmware")
    check_size(cmd, b"x" * c.MAX_COMMAND_BYTES)
    check_command_size("x" * c.MAX_COMMAND_BYTES)
    with pytest.raises(BadCommand, match=f"of {c.MAX_COMMAND_BYTES + 1} bytes is over the limit") as e:
        check_size(cmd, b"x" * (c.MAX_COMMAND_BYTES + 1))
    assert (e.value.device, e.value.topic) == ("d1", "devices/d1/commands/firmware")
    with pytest.raises(FedgateError, match="over the limit"):
        check_command_size(b"x" * (c.MAX_COMMAND_BYTES + 1))
