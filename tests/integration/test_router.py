"""The router against the real local federation: presence, routed downlink, parking,
desired state, and the Kafka bridge (paho-mqtt devices, a confluent-kafka consumer)."""

from __future__ import annotations

import json
import os
import time
from urllib.parse import quote

import pytest

from backend import contract as c
from backend.amqp import command_headers, publish_confirmed, send_command
from backend.errors import FedgateError
from backend.polling import wait_until
from fedgate import cli
from tests.helpers import (
    _metrics,
    device,
    kafka_records,
    operator_client,
    record_counts,
    records_from,
    router_metrics,
    wait_metric,
    wait_present,
)

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def send(endpoints, dev_id, name, payload, retain=False):
    topic = c.device_command_topic(dev_id, name)
    send_command(endpoints["backend"]["url"], dev_id, topic, payload, retain=retain)
    return topic


def test_a_command_reaches_exactly_the_gateway_that_holds_the_device(endpoints, uid):
    dev_id = f"routed-{uid}"
    d = device(endpoints, "local-us", dev_id)
    spy = operator_client(endpoints, "local-eu", f"spy-{uid}")  # may see any device's commands
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        spy.subscribe(c.device_command_topic(dev_id, "#"))
        wait_present(endpoints, dev_id, "local-us")
        topic = send(endpoints, dev_id, "reboot", "now")
        assert [(r.topic, r.payload) for r in d.wait_for(1)] == [(topic, b"now")]
        time.sleep(1.0)
        assert len(d.received) == 1 and spy.received == []
    finally:
        d.close()
        spy.close()


def test_a_device_that_roams_gets_later_commands_once_at_its_new_gateway(endpoints, uid):
    dev_id = f"roamer-{uid}"
    old = device(endpoints, "local-eu", dev_id, auto_reconnect=False)
    old.subscribe(c.device_command_topic(dev_id, "#"))
    wait_present(endpoints, dev_id, "local-eu")
    new = device(endpoints, "local-us", dev_id)
    try:
        new.subscribe(c.device_command_topic(dev_id, "#"))
        wait_present(endpoints, dev_id, "local-us")
        assert old.dropped.wait(30), (
            "the older session at local-eu was closed (one live session per client id)"
        )
        for i in range(5):
            send(endpoints, dev_id, "step", str(i))
        new.wait_for(5)
        time.sleep(1.0)
        assert [r.payload for r in new.received] == [b"0", b"1", b"2", b"3", b"4"], "each once, in order"
        assert old.received == []
    finally:
        old.close()
        new.close()


def test_commands_sent_between_connect_and_subscribe_wait_for_the_subscription(endpoints, uid):
    """MQTT drops a message for a topic nobody subscribes to: a device that has connected but
    not subscribed yet would lose commands sent in that window (every reconnect of a clean
    session has one).  The router holds them and sends them when the subscription appears."""
    dev_id = f"early-{uid}"
    d = device(endpoints, "local-eu", dev_id)
    try:
        wait_present(endpoints, dev_id, "local-eu")
        held = router_metrics(endpoints).get('fedgate_router_held_total{region="local-eu"}', 0)
        for i in range(3):
            send(endpoints, dev_id, "early", str(i))
        # held, not routed: routed now, MQTT would drop them (nobody subscribes to the topic yet)
        wait_metric(endpoints, 'fedgate_router_held_total{region="local-eu"}', held + 3)
        d.subscribe(c.device_command_topic(dev_id, "#"))
        d.wait_for(3, timeout=15)
        send(endpoints, dev_id, "later", "3")  # subscribed now: routed straight to it
        d.wait_for(4, timeout=15)
        time.sleep(1.0)
        assert [r.payload for r in d.received] == [b"0", b"1", b"2", b"3"], "each once, in order"
    finally:
        d.close()


def test_a_subscription_whose_binding_event_was_lost_still_gets_the_commands_held_for_it(
    federation, endpoints, uid
):
    """A gateway's binding events are at most once: its event exchange publishes them without
    confirms, and one in flight when the gateway node leading the presence link's queue dies
    is gone (the HA chaos suite lost 65 commands that way, 1 run in 9).  Here the event is
    lost for certain: the backend's presence exchange routes no `binding.created` to the
    routers while a clean-session device subscribes.  A command sent just after is held (the
    router saw no subscription) and must still arrive long before the parking TTL: the router
    asks the gateway again (router/reask.py).  Before, it asked once, skipped a clean
    session's queue, and dead-lettered the command at the TTL: 0 of 1."""
    from tests.conftest import PARK_TTL_S

    dev_id = f"unbound-{uid}"
    backend = federation.backend().admin()
    exchange = quote(c.PRESENCE_EXCHANGE, safe="")
    queues = [q["name"] for q in backend.queues() if q["name"].endswith(".presence")]
    assert queues, "no router presence queue on the backend"
    unbound: list[str] = []
    d = device(endpoints, "local-eu", dev_id)
    try:
        wait_present(endpoints, dev_id, "local-eu")
        for queue in queues:
            backend.delete(f"bindings/%2F/e/{exchange}/q/{quote(queue, safe='')}/binding.created")
            unbound.append(queue)
        d.subscribe(c.device_command_topic(dev_id, "#"))  # its binding event goes nowhere
        held = router_metrics(endpoints).get('fedgate_router_held_total{region="local-eu"}', 0)
        topic = send(endpoints, dev_id, "reboot", "after-a-lost-event")
        sent_at = time.monotonic()
        wait_metric(endpoints, 'fedgate_router_held_total{region="local-eu"}', held + 1)
        got = [(r.topic, r.payload) for r in d.wait_for(1, timeout=PARK_TTL_S + 5)]
        waited = time.monotonic() - sent_at
        time.sleep(1.0)
        record_counts(
            sent=1, held=1, delivered=len(d.received), lost=1 - len(d.received), waited_s=round(waited, 1)
        )
        assert got == [(topic, b"after-a-lost-event")] and len(d.received) == 1
        assert waited < PARK_TTL_S, "delivered only after the parking TTL"
    finally:
        d.close()
        for queue in unbound:
            backend.request(
                "POST",
                f"bindings/%2F/e/{exchange}/q/{quote(queue, safe='')}",
                {"routing_key": "binding.created"},
            )


def test_desired_state_sent_between_connect_and_subscribe_reaches_that_connection_once(endpoints, uid):
    """A retained command (`fedgate send --retain`) for a device that has connected but not
    subscribed yet.  Before, the router sent it at once (MQTT dropped it: nothing subscribed)
    and marked it replayed to that connection, so the subscription that followed never got
    it: 0 of 1 until the device's next connection."""
    dev_id = f"early-desired-{uid}"
    d = device(endpoints, "local-eu", dev_id)
    try:
        wait_present(endpoints, dev_id, "local-eu")
        keys = ('fedgate_router_routed_total{region="local-eu"}', "fedgate_router_desired_stored_total")

        def taken() -> float:  # routed (the old code) or kept as desired state
            now = router_metrics(endpoints)
            return sum(now.get(k, 0) for k in keys)

        first = taken()
        topic = send(endpoints, dev_id, "config", "v1", retain=True)
        assert wait_until(lambda: taken() != first, 10, 0.1), "the router never took the command"
        d.subscribe(c.device_command_topic(dev_id, "#"))
        got = d.wait_for(1, timeout=10)
        time.sleep(1.0)
        record_counts(sent=1, delivered=len(d.received), lost=1 - min(len(d.received), 1))
        assert [(r.topic, r.payload) for r in got] == [(topic, b"v1")] and len(d.received) == 1
    finally:
        d.close()


def test_commands_for_an_offline_device_are_parked_and_delivered_in_order_on_reconnect(endpoints, uid):
    dev_id = f"sleeper-{uid}"
    d = device(endpoints, "local-eu", dev_id)
    d.subscribe(c.device_command_topic(dev_id, "#"))
    wait_present(endpoints, dev_id, "local-eu")
    d.close()
    time.sleep(0.5)
    parked_before = router_metrics(endpoints).get("fedgate_router_parked_total", 0)
    for i in range(3):
        send(endpoints, dev_id, "queued", f"p{i}")
    assert wait_until(
        lambda: router_metrics(endpoints).get("fedgate_router_parked_total", 0) >= parked_before + 3, 10, 0.1
    ), "the router parked the commands"
    back = device(endpoints, "local-us", dev_id)  # comes back in the other region
    try:
        back.subscribe(c.device_command_topic(dev_id, "#"))
        got = back.wait_for(3, timeout=10)
        assert [r.payload for r in got] == [b"p0", b"p1", b"p2"]
    finally:
        back.close()


def test_desired_state_follows_the_device_to_another_region(endpoints, uid):
    dev_id = f"follower-{uid}"
    d = device(endpoints, "local-eu", dev_id)
    topic = c.device_command_topic(dev_id, "config")
    try:
        d.subscribe(topic)
        wait_present(endpoints, dev_id, "local-eu")
        send(endpoints, dev_id, "config", '{"interval": 5}', retain=True)
        assert [r.payload for r in d.wait_for(1)] == [b'{"interval": 5}']
    finally:
        d.close()
    time.sleep(0.5)
    elsewhere = device(endpoints, "local-us", dev_id)
    try:
        elsewhere.subscribe(topic)
        got = elsewhere.wait_for(1, timeout=10)
        assert [r.payload for r in got] == [b'{"interval": 5}'], "replayed on subscribe in the other region"
        time.sleep(1.0)
        assert len(elsewhere.received) == 1
    finally:
        elsewhere.close()


def _reading_latency(endpoints) -> tuple[float, float]:
    """(count, sum) of fedgate_router_reading_latency_seconds for local-eu, over the routers."""
    count = total = 0.0
    for url in endpoints["routers"].values():
        m = _metrics(url)
        count += m.get('fedgate_router_reading_latency_seconds_count{region="local-eu"}', 0.0)
        total += m.get('fedgate_router_reading_latency_seconds_sum{region="local-eu"}', 0.0)
    return count, total


def test_telemetry_is_bridged_into_kafka_with_key_and_headers(endpoints, uid):
    dev_id = f"bridged-{uid}"
    count, total = _reading_latency(endpoints)
    with device(endpoints, "local-eu", dev_id) as d:
        for i in range(5):
            d.publish(f"devices/{dev_id}/telemetry/temp", {"seq": i})
    recs = kafka_records(
        endpoints, c.KAFKA_TELEMETRY_TOPIC, lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id, expect=5
    )
    assert [json.loads(m.value())["seq"] for m, _ in recs] == [0, 1, 2, 3, 4]
    for m, h in recs:
        assert m.key() == dev_id.encode()
        assert h[c.KAFKA_REGION_HEADER] == "local-eu"
        assert h[c.KAFKA_MQTT_TOPIC_HEADER] == f"devices/{dev_id}/telemetry/temp"
        assert int(h[c.KAFKA_RECEIVED_AT_HEADER]) > 0
    # each reading timed from its gateway's batcher to Kafka (the batch's header, in ms)
    assert wait_until(lambda: _reading_latency(endpoints)[0] >= count + 5, 10, 0.2)
    count_after, total_after = _reading_latency(endpoints)
    assert 0.001 < (total_after - total) / (count_after - count) < 10


def test_unmatched_topics_go_to_the_catch_all_with_their_topic(endpoints, uid):
    # devices publish only under devices/<id>/...; a line controller with wider rights does not
    with operator_client(endpoints, "local-us", f"odd-{uid}") as d:
        d.publish(f"factory/{uid}/line-1", b"hello")
    recs = records_from(endpoints, c.KAFKA_UNMATCHED_TOPIC, f"factory/{uid}/line-1", expect=1)
    assert len(recs) == 1 and recs[0][0].value() == b"hello"
    assert recs[0][1][c.KAFKA_REGION_HEADER] == "local-us"


def test_poison_messages_are_dead_lettered_with_reasons_and_the_router_keeps_running(endpoints, uid):
    dev_id = f"poison-{uid}"
    with device(endpoints, "local-eu", dev_id) as d:
        d.publish(f"devices/{dev_id}/telemetry", b"x" * (300 * 1024))  # over the 256 KiB limit
        d.publish(f"devices/{dev_id}/telemetry", b"\xff\xfe\x00binary")  # not UTF-8
        d.publish(f"devices/{dev_id}/telemetry", b'{"after": "poison"}')
    with operator_client(endpoints, "local-eu", f"op-{uid}") as op:  # a device may not publish there
        op.publish(f"devices//telemetry/{uid}", b"{}")  # no device
    dead = kafka_records(
        endpoints,
        c.KAFKA_DEADLETTER_TOPIC,
        lambda m, h: (
            dev_id in h.get(c.KAFKA_MQTT_TOPIC_HEADER, "") or uid in h.get(c.KAFKA_MQTT_TOPIC_HEADER, "")
        ),
        expect=3,
    )
    reasons = sorted(h[c.KAFKA_DEADLETTER_REASON_HEADER] for _, h in dead)
    assert len(reasons) == 3, reasons
    assert any("over the limit" in r for r in reasons)
    assert any("not valid UTF-8" in r for r in reasons)
    assert any("names no device" in r for r in reasons)
    ok = kafka_records(
        endpoints, c.KAFKA_TELEMETRY_TOPIC, lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id, expect=1
    )
    assert [m.value() for m, _ in ok] == [b'{"after": "poison"}']


def test_a_record_kafka_refuses_for_good_is_dead_lettered_with_kafkas_reason(endpoints, uid):
    """The catch-all topic takes record batches of 512 bytes at most (an operator's limit lower
    than the router's); a line controller publishes 2 KB of random text there, then 30 small
    readings right behind it.  Before, Kafka's refusal sent the big one back to RabbitMQ,
    again and again; then it dead-lettered the small readings that happened to share its
    record batch too (Kafka refuses whole batches).  Now the big one alone is in the
    dead-letter topic with Kafka's error as the reason, and every small one is bridged."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    admin = AdminClient({"bootstrap.servers": endpoints["kafka"]["bootstrap"]})

    def limit(op: AlterConfigOpType, value: str | None = None) -> None:
        entry = ConfigEntry("max.message.bytes", value, incremental_operation=op)
        res = ConfigResource(ConfigResource.Type.TOPIC, c.KAFKA_UNMATCHED_TOPIC, incremental_configs=[entry])
        for fut in admin.incremental_alter_configs([res]).values():
            fut.result(timeout=30)

    topic = f"factory/{uid}/line"
    big = os.urandom(1024).hex().encode()  # 2 KB that compression cannot shrink under 512 bytes
    smalls = [f"reading {i}".encode() for i in range(30)]
    limit(AlterConfigOpType.SET, "512")
    try:
        time.sleep(1.0)
        with operator_client(endpoints, "local-us", f"big-line-{uid}") as line:
            for payload in [big, *smalls]:  # one client, one topic: one shard, one router, one burst
                line.publish(topic, payload)
        bridged = records_from(endpoints, c.KAFKA_UNMATCHED_TOPIC, topic, expect=len(smalls), timeout=30)
        # more than one would be a small reading dead-lettered: look a few seconds for those too
        dead = records_from(endpoints, c.KAFKA_DEADLETTER_TOPIC, topic, expect=1 + len(smalls), timeout=5)
    finally:
        limit(AlterConfigOpType.DELETE)
    dead_values = [m.value() for m, _ in dead]
    bridged_values = {m.value() for m, _ in bridged}
    record_counts(
        sent=1 + len(smalls),
        deadlettered=len(dead),
        small_deadlettered=sum(v in smalls for v in dead_values),
        bridged=len(bridged),
        lost=1 + len(smalls) - len(set(dead_values) | bridged_values),
    )
    assert dead_values == [big], f"{len(dead_values) - 1} small readings dead-lettered with the big one"
    assert "MSG_SIZE_TOO_LARGE" in dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER]
    assert bridged_values == set(smalls) and len(bridged) == len(smalls)


def test_a_command_without_a_device_is_dead_lettered(endpoints, uid):
    send_command(endpoints["backend"]["url"], "", f"devices/x/commands/{uid}", b"lost?")
    dead = records_from(endpoints, c.KAFKA_DEADLETTER_TOPIC, f"devices/x/commands/{uid}", expect=1)
    assert "without the x-fedgate-device header" in dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER]


def test_a_command_too_large_to_park_is_refused_at_send_and_dead_lettered_when_it_arrives(endpoints, uid):
    """1.5 MB for a device that is away: Kafka takes records of 1 MB at most, so parking it
    failed and the command went back to the queue, again and again (RabbitMQ 4.0 drops a
    quorum queue's message after 20 such returns).  Now `fedgate send` refuses it, and one
    that arrives by AMQP all the same is dead-lettered with the reason and its first bytes."""
    dev_id = f"big-{uid}"
    topic = c.device_command_topic(dev_id, "firmware")
    big = b"x" * 1_500_000
    with pytest.raises(FedgateError, match="over the limit"):
        send_command(endpoints["backend"]["url"], dev_id, topic, big)
    publish_confirmed(
        endpoints["backend"]["url"], c.COMMANDS_EXCHANGE, dev_id, big, command_headers(dev_id, topic)
    )
    dead = records_from(endpoints, c.KAFKA_DEADLETTER_TOPIC, topic, expect=1)
    record_counts(sent=1, deadlettered=len(dead), lost=1 - len(dead))
    reason = dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER]
    assert reason == f"command of 1500000 bytes is over the limit of {c.MAX_COMMAND_BYTES}"
    assert dead[0][1][c.KAFKA_DEVICE_HEADER] == dev_id and len(dead[0][0].value()) == c.MAX_COMMAND_BYTES


def test_a_command_every_router_fails_on_is_set_aside_in_the_poison_queue_not_dropped(
    federation, endpoints, uid
):
    """A command returned to its queue again and again (here by a consumer that nacks it with
    requeue, as a router does when it fails on it).  RabbitMQ 4.0 drops a quorum queue's
    message after 20 deliveries unless it is dead-lettered: before, it was gone without a
    trace.  Now it is in fedgate.poison, naming the queue it came from."""
    from backend.amqp import connect
    from infra.local.layout import ROLE_ROUTER

    dev_id = f"poison-{uid}"
    topic = c.device_command_topic(dev_id, "x")
    routers = [s.name for s in federation.specs() if s.role == ROLE_ROUTER]
    for name in routers:
        federation.stop_node(name)  # the test is the commands queue's only reader meanwhile
    conn = connect(endpoints["backend"]["url"])
    try:
        ch = conn.channel()
        send(endpoints, dev_id, "x", "poison")
        deliveries = 0
        # a consumer (the queue has a single active one, which basic.get may not bypass)
        # that nacks every delivery with requeue, as a router failing on it would
        ch.basic_qos(prefetch_count=1)
        for method, props, _ in ch.consume(c.COMMANDS_QUEUE, inactivity_timeout=3):
            if method is None or deliveries >= 40:
                break
            deliveries += (props.headers or {}).get(c.DEVICE_HEADER) == dev_id
            ch.basic_nack(method.delivery_tag, requeue=True)
        ch.cancel()
        # an operator sees it in `fedgate status` (the backend's line)
        assert wait_until(
            lambda: any(c.POISON_QUEUE in r.detail for r in federation.status() if r.role == "backend"),
            20,
            1.0,
        ), "fedgate status never showed the poison queue's message"
        deadline = time.monotonic() + 10
        found = None
        while found is None and time.monotonic() < deadline:
            method, props, body = ch.basic_get(c.POISON_QUEUE)
            if method is None:
                time.sleep(0.2)
                continue
            if (props.headers or {}).get(c.DEVICE_HEADER) == dev_id:
                found = props.headers
            ch.basic_ack(method.delivery_tag)  # a test's own leftover: taken out
        record_counts(
            sent=1, deliveries=deliveries, in_poison_queue=int(found is not None), lost=int(found is None)
        )
        assert found is not None, "the command was dropped"
        assert deliveries == c.POISON_DELIVERY_LIMIT + 1 or deliveries == c.POISON_DELIVERY_LIMIT
        assert found["x-first-death-reason"] == "delivery_limit"
        assert found["x-first-death-queue"] == c.COMMANDS_QUEUE
        assert found[c.TOPIC_HEADER] == topic
    finally:
        conn.close()
        for name in routers:
            federation.start_node(name)


def test_fedgate_presence_shows_where_a_device_is_and_counts_per_region(federation, endpoints, uid):
    import os
    import subprocess
    import sys

    env = {**os.environ, "FEDGATE_STATE_DIR": str(federation.state_dir)}
    ds = [device(endpoints, r, f"count-{r}-{uid}") for r in ("local-eu", "local-us")]
    try:
        for d, r in zip(ds, ("local-eu", "local-us"), strict=True):
            wait_present(endpoints, d.device_id, r)
        out = subprocess.run(
            [sys.executable, "-m", "fedgate.cli", "presence", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        data = json.loads(out.stdout)
        where = {d["device"]: d["region"] for d in data["devices"]}
        assert where[f"count-local-eu-{uid}"] == "local-eu" and where[f"count-local-us-{uid}"] == "local-us"
        assert data["per_region"]["local-eu"] >= 1 and data["per_region"]["local-us"] >= 1
        one = subprocess.run(
            [sys.executable, "-m", "fedgate.cli", "presence", f"count-local-us-{uid}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert one.returncode == 0 and "local-us" in one.stdout and "since" in one.stdout
    finally:
        for d in ds:
            d.close()


def _park_for(endpoints, dev_id):
    """Connect, subscribe and leave: the device is known and offline."""
    d = device(endpoints, "local-eu", dev_id)
    d.subscribe(c.device_command_topic(dev_id, "#"))
    wait_present(endpoints, dev_id, "local-eu")
    d.close()
    time.sleep(0.5)


def _restart_every_router(federation) -> None:
    """Every router stopped, then started: whichever leads then has restarted.  (One router
    restarted alone hands the lead to the other, which never stopped: a check after it would
    pass whatever a restarted router had lost.)"""
    from infra.local.layout import ROLE_ROUTER

    routers = [s.name for s in federation.specs() if s.role == ROLE_ROUTER]
    for name in routers:
        federation.stop_node(name)
    for name in routers:
        federation.start_node(name)


def test_parked_messages_and_desired_state_survive_a_router_restart(federation, endpoints, uid):
    dev_id = f"restart-{uid}"
    _park_for(endpoints, dev_id)
    parked = router_metrics(endpoints).get("fedgate_router_parked_total", 0)
    send(endpoints, dev_id, "config", "desired-v1", retain=True)
    send(endpoints, dev_id, "reboot", "parked-1")
    wait_metric(endpoints, "fedgate_router_parked_total", parked + 1)

    _restart_every_router(federation)

    back = device(endpoints, "local-us", dev_id)
    try:
        back.subscribe(c.device_command_topic(dev_id, "#"))
        got = back.wait_for(2, timeout=15)
        assert sorted((r.topic.rsplit("/", 1)[1], r.payload) for r in got) == [
            ("config", b"desired-v1"),
            ("reboot", b"parked-1"),
        ]
    finally:
        back.close()


def test_a_device_offline_across_a_restart_of_every_router_gets_the_command_sent_after_it(
    federation, endpoints, uid
):
    """The device connected once and left; every router restarts; a command is sent; the
    device comes back at the other gateway.  Before, the restarted routers took it for a
    device never seen and broadcast the command, which both gateways dropped: 0 of 1."""
    from infra.local.layout import ROLE_ROUTER

    dev_id = f"away-{uid}"
    _park_for(endpoints, dev_id)
    routers = [s.name for s in federation.specs() if s.role == ROLE_ROUTER]
    for name in routers:
        federation.stop_node(name)
    for name in routers:
        federation.start_node(name)
    before = router_metrics(endpoints)
    send(endpoints, dev_id, "reboot", "while-away")
    wait_metric(endpoints, "fedgate_router_parked_total", before.get("fedgate_router_parked_total", 0) + 1)
    after = router_metrics(endpoints)
    broadcast = after.get("fedgate_router_broadcast_total", 0) - before.get(
        "fedgate_router_broadcast_total", 0
    )
    back = device(endpoints, "local-us", dev_id)
    try:
        back.subscribe(c.device_command_topic(dev_id, "#"))
        got = [r.payload for r in back.wait_for(1, timeout=15)]
        time.sleep(1.0)
        record_counts(
            routers_restarted=len(routers),
            sent=1,
            parked=1,
            broadcast=broadcast,
            delivered=len(back.received),
            lost=1 - len(back.received),
        )
        assert broadcast == 0, "a device seen before the restart is not one never seen"
        assert got == [b"while-away"] and len(back.received) == 1
    finally:
        back.close()


def test_a_device_that_left_while_every_router_was_down_gets_the_commands_sent_meanwhile(
    federation, endpoints, uid
):
    """The restart window: the device is connected when every router stops, leaves a moment
    later (its close event waits in each router's durable presence queue), and three commands
    are sent while no router runs.  At the restart the saved table still has the device, and
    its connection is too young for the rebuild to drop it unlisted: the commands may be routed
    to a gateway where its clean session is gone.  They must follow it to its next session."""
    from infra.local.layout import ROLE_ROUTER

    dev_id = f"left-{uid}"
    d = device(endpoints, "local-eu", dev_id)
    d.subscribe(c.device_command_topic(dev_id, "#"))
    wait_present(endpoints, dev_id, "local-eu")
    routers = [s.name for s in federation.specs() if s.role == ROLE_ROUTER]
    for name in routers:
        federation.stop_node(name)
    d.close()
    for i in range(3):
        send(endpoints, dev_id, "set", f"meanwhile-{i}")
    for name in routers:
        federation.start_node(name)
    back = device(endpoints, "local-us", dev_id)
    try:
        back.subscribe(c.device_command_topic(dev_id, "#"))
        back.wait_for(3, timeout=20)
        time.sleep(1.0)  # a second copy would arrive now
        got = [r.payload.decode() for r in back.received]
        fresh = router_metrics(endpoints)  # counted since the restart: how the commands went
        record_counts(
            routers_restarted=len(routers),
            sent=3,
            parked_at_once=int(fresh.get("fedgate_router_parked_total", 0)),
            routed_to_the_old_session_and_parked_again=int(fresh.get("fedgate_router_reparked_total", 0)),
            delivered=len(got),
            lost=len({f"meanwhile-{i}" for i in range(3)} - set(got)),
            delivered_twice=len(got) - len(set(got)),
        )
        assert sorted(set(got)) == [f"meanwhile-{i}" for i in range(3)]
    finally:
        back.close()


def test_parked_messages_expire_into_the_dead_letter_topic_with_the_reason(endpoints, uid):
    from tests.conftest import PARK_TTL_S

    dev_id = f"expiry-{uid}"
    _park_for(endpoints, dev_id)
    topic = send(endpoints, dev_id, "stale", "too late")
    dead = kafka_records(
        endpoints,
        c.KAFKA_DEADLETTER_TOPIC,
        lambda m, h: h.get(c.KAFKA_MQTT_TOPIC_HEADER) == topic,
        expect=1,
        timeout=PARK_TTL_S + 20,
    )
    assert dead, "the expired command was dead-lettered"
    assert dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER].startswith(f"parked for {PARK_TTL_S}s")
    assert dead[0][0].value() == b"too late"
    # and it is not delivered when the device finally comes back
    late = device(endpoints, "local-eu", dev_id)
    try:
        late.subscribe(c.device_command_topic(dev_id, "#"))
        time.sleep(1.5)
        assert late.received == []
    finally:
        late.close()


def test_a_restarted_router_routes_correctly_from_its_first_message(federation, endpoints, uid):
    """Presence is rebuilt from the gateways and from the events that waited during the restart."""
    dev_id = f"rebuild-{uid}"
    d = device(endpoints, "local-us", dev_id)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        wait_present(endpoints, dev_id, "local-us")
        _restart_every_router(federation)
        before = router_metrics(endpoints)
        topic = send(endpoints, dev_id, "first", "after-restart")
        assert [r.payload for r in d.wait_for(1)] == [b"after-restart"]
        key = 'fedgate_router_routed_total{region="local-us"}'
        # counted once the backend confirmed the publish, which may be just after the device got it
        wait_metric(endpoints, key, before.get(key, 0) + 1)
        after = router_metrics(endpoints)
        assert after.get(key, 0) == before.get(key, 0) + 1, "routed to its region, not broadcast or parked"
        assert after.get("fedgate_router_broadcast_total", 0) == before.get(
            "fedgate_router_broadcast_total", 0
        )
        del topic
    finally:
        d.close()


def test_a_command_for_a_registered_device_that_never_connected_waits_for_it(endpoints, uid):
    """A device registered (`fedgate devices add`) and still in its box: no router has seen it.
    Before, its command was broadcast, every gateway dropped it (nobody subscribed): 0 of 1.
    Now the registry says it exists, so the command is parked until it connects."""
    dev_id = f"boxed-{uid}"
    endpoints["credentials"](dev_id)  # registered, pushed to every gateway
    before = router_metrics(endpoints)
    topic = send(endpoints, dev_id, "setup", "first-config")
    wait_metric(endpoints, "fedgate_router_parked_total", before.get("fedgate_router_parked_total", 0) + 1)
    with device(endpoints, "local-us", dev_id) as d:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        got = d.wait_for(1, timeout=15)
        time.sleep(1)  # a second copy would arrive now
        after = router_metrics(endpoints)
        broadcast = after.get("fedgate_router_broadcast_total", 0) - before.get(
            "fedgate_router_broadcast_total", 0
        )
        record_counts(
            sent=1, parked=1, broadcast=int(broadcast), delivered=len(d.received), lost=1 - len(got)
        )
        assert [(r.topic, r.payload) for r in d.received] == [(topic, b"first-config")]
        assert broadcast == 0


def test_a_command_for_an_id_that_is_not_registered_is_refused_and_dead_lettered(
    federation, endpoints, uid, monkeypatch, capsys
):
    """`fedgate send` refuses it with the reason; sent by AMQP all the same, the router
    dead-letters it with the reason instead of broadcasting it to every gateway."""
    ghost = f"ghost-{uid}"
    monkeypatch.setenv("FEDGATE_STATE_DIR", str(federation.state_dir))
    monkeypatch.setenv("FEDGATE_PORT_BASE", str(federation.settings.port_base))
    capsys.readouterr()
    assert cli.main(["send", ghost, c.device_command_topic(ghost, "x"), "{}"]) == 5  # refused
    err = capsys.readouterr().err
    assert f"device {ghost!r} is not registered (fedgate devices add {ghost})" in err, err
    spies = [operator_client(endpoints, r, f"spy-{r}-{uid}") for r in ("local-eu", "local-us")]
    try:
        for s in spies:
            s.subscribe(c.device_command_topic(ghost, "#"))
        before = router_metrics(endpoints).get("fedgate_router_broadcast_total", 0)
        topic = send(endpoints, ghost, "hello", "anyone")
        dead = records_from(endpoints, c.KAFKA_DEADLETTER_TOPIC, topic, expect=1)
        time.sleep(0.5)
        record_counts(sent=1, deadlettered=len(dead), seen_by_gateways=sum(len(s.received) for s in spies))
        assert dead and dead[0][1][c.KAFKA_DEADLETTER_REASON_HEADER] == f"device {ghost!r} is not registered"
        assert all(s.received == [] for s in spies), "no gateway was sent it"
        assert router_metrics(endpoints).get("fedgate_router_broadcast_total", 0) == before
    finally:
        for s in spies:
            s.close()


def test_a_command_to_a_gateway_whose_downlink_link_is_down_waits_and_is_delivered_when_it_is_back(
    federation, endpoints, uid
):
    """The gateway's downlink link is stopped (its federation policy cleared) and the queue it
    read on the backend deleted -- a stopped link keeps its queue (resource-cleanup-mode
    never), so this is the state of a gateway that never linked: nothing is bound to the
    region's downlink exchange -- while its events still reach the backend.  The backend
    returns a command sent then.  Before, the router published on a channel that ignored
    returns and acked it: 0 of 1."""
    dev_id = f"unlinked-{uid}"
    gateway = next(g for g in federation.gateways() if g.spec.region == "local-us").admin()
    backend = federation.backend().admin()
    policy_path = "policies/%2F/fedgate-downlink"
    policy = gateway.get(policy_path)
    bindings = f"exchanges/%2F/{c.downlink_exchange('local-us')}/bindings/source"
    restored = True

    def restore_link():
        nonlocal restored
        body = {k: policy[k] for k in ("pattern", "definition", "apply-to", "priority")}
        gateway.request("PUT", policy_path, body)
        restored = True

    d = device(endpoints, "local-us", dev_id)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        wait_present(endpoints, dev_id, "local-us")
        restored = False
        gateway.delete(policy_path)
        link_queue = f"{c.DOWNLINK_LINK_QUEUE_PREFIX}local-us -> "
        deadline = time.monotonic() + 15
        while links := [q["name"] for q in backend.queues() if q["name"].startswith(link_queue)]:
            assert time.monotonic() < deadline, "the downlink link's queue could not be deleted"
            for name in links:
                backend.delete(f"queues/%2F/{quote(name, safe='')}")
            time.sleep(0.2)
        while backend.get(bindings):
            assert time.monotonic() < deadline, "the downlink link never stopped"
            time.sleep(0.2)
        key = 'fedgate_router_unroutable_total{region="local-us"}'
        before = router_metrics(endpoints)
        handled = ("fedgate_router_routed_total", "fedgate_router_parked_total")

        def taken() -> float:  # routed (the old code: returned, acked, dropped) or parked
            now = router_metrics(endpoints)
            return sum(now.get(f'{m}{{region="local-us"}}', 0) + now.get(m, 0) for m in handled)

        first = taken()
        topic = send(endpoints, dev_id, "reboot", "while-unlinked")
        assert wait_until(lambda: taken() != first, 10, 0.1), "the router never took the command"
        time.sleep(1.0)
        while_down = len(d.received)
        restore_link()
        got = [(r.topic, r.payload) for r in d.wait_for(1, timeout=30)]
        time.sleep(1.0)
        record_counts(
            sent=1,
            returned=router_metrics(endpoints).get(key, 0) - before.get(key, 0),
            delivered_while_down=while_down,
            delivered=len(d.received),
            lost=1 - len(d.received),
        )
        assert while_down == 0
        assert got == [(topic, b"while-unlinked")] and len(d.received) == 1
    finally:
        d.close()
        if not restored:
            restore_link()
        federation.wait_for_links()


def test_commands_sent_as_clean_session_devices_leave_follow_them_to_their_next_session(endpoints, uid):
    """Ten devices with clean sessions (MQTT's default) leave at once while 300 commands stream
    to them round robin, and come back at the other gateway.  The router learns of a
    disconnect only after it happened, and the gateway drops what arrives for a clean session
    that is gone: before, the commands routed to the old gateway in that window were lost.
    Now the router parks again what it sent in the 1 s before a connection ended (the
    gateway's clock), and every device gets every command at its next session (some twice:
    at least once)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import pika

    from backend.amqp import connect

    ids = [f"clean-{uid}-{i}" for i in range(10)]
    commands = c.device_command_topic("{}", "#")
    fleet = [device(endpoints, "local-eu", d) for d in ids]  # clean sessions: nothing kept after
    for d in fleet:
        d.subscribe(commands.format(d.device_id))
    for d in ids:
        wait_present(endpoints, d, "local-eu")

    def stream() -> None:
        # without a confirm per message (as fast as a backend service sends): the window is
        # tens of milliseconds here, and one command every few milliseconds per device hits it
        conn = connect(endpoints["backend"]["url"])
        try:
            ch = conn.channel()
            for n in range(300):
                dev_id = ids[n % len(ids)]
                headers = command_headers(dev_id, c.device_command_topic(dev_id, "n"))
                props = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, headers=headers)
                ch.basic_publish(c.COMMANDS_EXCHANGE, dev_id, str(n).encode(), props)
                time.sleep(0.0005)
        finally:
            conn.close()  # after what was published reached the backend

    sender = threading.Thread(target=stream)
    sender.start()
    # they leave while commands reach them: once the first arrived (a fixed pause was too short
    # on a loaded machine, and every device left before any command came)
    wait_until(lambda: any(d.received for d in fleet), 30, 0.005)
    with ThreadPoolExecutor(len(fleet)) as pool:
        list(pool.map(lambda d: d.close(), fleet))
    sender.join()
    before = [int(r.payload) for d in fleet for r in list(d.received)]
    back = [device(endpoints, "local-us", d) for d in ids]
    try:
        for d in back:
            d.subscribe(commands.format(d.device_id))

        def got() -> list[int]:
            return before + [int(r.payload) for d in back for r in list(d.received)]

        wait_until(lambda: set(got()) == set(range(300)), 30, 0.2)
        time.sleep(1.0)  # what else comes (twice) comes by now
        received = got()
    finally:
        for d in back:
            d.close()
    lost = sorted(set(range(300)) - set(received))
    record_counts(
        devices=len(ids),
        sent=300,
        before_leaving=len(before),
        at_next_session=len(received) - len(before),
        delivered=len(set(received)),
        delivered_twice=len(received) - len(set(received)),
        lost=len(lost),
    )
    assert not lost, f"lost {lost}"
    assert before, "the devices left while commands reached them"
