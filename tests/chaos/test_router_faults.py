"""The router under faults: killed mid-stream, Kafka away for 30 s, a region on one router.

What is tried in each: devices publish numbered QoS 1 messages without pause
while the fault happens; afterwards a Kafka consumer reads everything back.
Every message a gateway acknowledged must be in Kafka (nothing lost), in the
order each device sent it; duplicates are allowed only within the in-flight
window and are counted.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.parse

import pytest

from backend.polling import wait_until
from infra.local import processes
from tests.chaos.counting import Fleet, check, read_back, resend_bound
from tests.helpers import device

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.chaos,
    pytest.mark.spark,
    pytest.mark.usefixtures("spark_job"),
]


def _bridged(federation, name: str) -> float:
    """Device messages the router `name` stored in Kafka since it started."""
    return _metric(federation, name, "fedgate_router_bridged_total")


def _metric(federation, name: str, metric: str) -> float:
    """The sum of a metric's series on the router `name`."""
    return federation.node(name).metrics().get(metric, 0.0)


def test_a_region_is_bridged_by_one_router_at_a_time_in_each_devices_order(federation, endpoints, uid):
    """Both routers run; 8 devices of one region publish for 3 s, then 8 of the other.  A
    region's readings travel in one batch a flush (the gateway batcher's one bucket), so they
    take one shard and one router bridges them all: every reading reaches Kafka once, each
    device's in the order it sent them, and the other router bridges none of that region's.
    (With four buckets a region, the default before, a region's keys took several shards and
    both routers bridged it.)"""
    routers = ("router-0", "router-1")
    for region in ("local-eu", "local-us"):
        before = {n: _bridged(federation, n) for n in routers}
        devices = [device(endpoints, region, f"one-{uid}-{region}-{i}", node=i) for i in range(8)]
        with Fleet(devices) as fleet:
            time.sleep(3)
        got = read_back(endpoints["kafka"]["bootstrap"], fleet.acked)
        check(fleet, got, max_duplicates=0)
        sent = fleet.total_acked
        # a router counts a reading once Kafka's delivery report is back: maybe just after
        took = wait_until(lambda b=before, n=sent: _bridged_since(federation, b, n), 10, 0.2)
        took = took or {n: _bridged(federation, n) - before[n] for n in routers}
        assert sorted(took.values()) == [0, sent], f"{region}: {sent} readings bridged as {took}"


def _bridged_since(federation, before: dict[str, float], n: int) -> dict[str, float] | None:
    """What each router bridged since `before`, once they bridged `n` together (else None)."""
    took = {name: _bridged(federation, name) - count for name, count in before.items()}
    return took if sum(took.values()) >= n else None


def test_a_router_killed_mid_stream_loses_nothing(federation, endpoints, uid):
    with Fleet.on_both_gateways(endpoints, f"kill-{uid}", per_region=4) as fleet:
        time.sleep(1.5)
        victim = federation.node("router-1")
        pid = victim.pid()
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.5)  # devices keep publishing; router-0 takes router-1's shards meanwhile
        federation.start_node("router-1")
        time.sleep(1.5)
    got = read_back(endpoints["kafka"]["bootstrap"], fleet.acked)
    # duplicates only from the killed router's in-flight window (its prefetch)
    check(fleet, got, max_duplicates=2000, spark_federation=federation, device_prefix=f"kill-{uid}-")


def test_a_router_killed_and_kept_down_its_shards_flow_through_the_other_at_once(federation, endpoints, uid):
    """router-1 SIGKILLed while 16 devices publish, and kept down for 12 s.  Before, its shards
    waited in RabbitMQ until it was back (router i read only the shards s with s % n == i).
    Now every router stands by on every shard (consumer priority, router/bridge.py): what the
    devices publish after the kill is in Kafka while router-1 is still down.  Then router-1 is
    started again, takes its shards back, and nothing is lost or out of order."""
    from tests.helpers import record_counts

    bootstrap = endpoints["kafka"]["bootstrap"]
    with Fleet.on_both_gateways(endpoints, f"down-{uid}", per_region=8) as fleet:
        time.sleep(1.5)
        victim = federation.node("router-1")
        os.kill(victim.pid(), signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(4)
        snapshot = {d: list(seqs) for d, seqs in fleet.acked.items()}
        acked_while_down = sum(len(v) for v in snapshot.values())
        # everything acked so far in Kafka while router-1 is still dead, device by device
        got_while_down = read_back(bootstrap, snapshot, timeout=10)
        missing_while_down = sum(len(set(v) - set(got_while_down[d])) for d, v in snapshot.items())
        flowing_after_s = round(time.monotonic() - killed_at, 1)
        assert not victim.is_running(), "router-1 stayed down meanwhile"
        time.sleep(max(0.0, 12 - (time.monotonic() - killed_at)))
        federation.start_node("router-1")
        time.sleep(3)
        taken_back = _bridged(federation, "router-1")  # counted since its restart
    got = read_back(bootstrap, fleet.acked)
    record_counts(
        acked_4s_after_the_kill=acked_while_down,
        of_those_not_in_kafka_while_router_1_was_down=missing_while_down,
        read_back_after_s=flowing_after_s,
        bridged_by_router_1_after_its_return=int(taken_back),
    )
    assert missing_while_down == 0, "router-1's shards waited for it"
    assert taken_back > 0, "router-1 took its shards back when it returned"
    check(fleet, got, max_duplicates=2000, spark_federation=federation, device_prefix=f"down-{uid}-")


def test_the_backend_closing_every_router_connection_mid_stream_loses_nothing(federation, endpoints, uid):
    """The backend closes all the routers' AMQP connections (the uplink's own, on aiormq with its
    own reconnect loop, and the downlink's robust one) while devices publish: both routers
    reconnect, take their shards again and every acknowledged reading reaches Kafka, in order.

    "Took their shards again" is read from the backend (each shard's active consumer is the
    router of the highest priority on it, and both routers are on every shard), not from each
    router's bridged count: eight devices all hash onto one router's shards once in ~128 runs
    (uid 406eaa4b put all eight on router-1's), and then the other has nothing to bridge."""
    from backend import contract as c
    from backend.rabbitmq_admin import RabbitAdmin

    admin = RabbitAdmin(
        f"http://{endpoints['host']}:{endpoints['backend']['management']}",
        endpoints["admin"]["user"],
        endpoints["admin"]["password"],
    )
    routers = ("router-0", "router-1")
    reconnects = "fedgate_router_uplink_reconnects_total"
    before = {n: _metric(federation, n, reconnects) for n in routers}
    logged = _log_sizes(federation, routers)
    with Fleet.on_both_gateways(endpoints, f"closed-{uid}", per_region=4) as fleet:
        time.sleep(1.5)
        closed = [x["name"] for x in admin.connections() if x.get("user") == c.ROUTER_USER]
        for name in closed:
            admin.delete(f"connections/{urllib.parse.quote(name, safe='')}")
        # devices keep publishing while the routers reconnect and each takes its own shards
        # back from the other (once the other acked what it held): how soon depends on the
        # machine's load (5 s were not always enough beside the rest of `make test`)
        reconnected = wait_until(
            lambda: all(_metric(federation, n, reconnects) > before[n] for n in routers), 60, 0.5
        )
        # each look is four rabbitmqctl calls (~1 CPU s each): every 2 s, not every 0.5
        taken_back = wait_until(
            lambda: _each_shard_read_by_its_first(_shard_table(federation), routers), 60, 2
        )
        acked_at_take_back = fleet.total_acked
        time.sleep(1.0)  # and readings flow on through them
    assert len(closed) >= 4, f"the routers' connections were closed: {closed}"
    got = read_back(endpoints["kafka"]["bootstrap"], fleet.acked)
    check(fleet, got, max_duplicates=2000)
    assert reconnected, {n: _metric(federation, n, reconnects) - before[n] for n in routers}
    assert fleet.total_acked > acked_at_take_back, "devices published after the shards were taken back"
    if not taken_back:
        said = {n: text[-3000:] for n, text in _said_since(federation, logged).items()}
        pytest.fail(
            "each router took its shards back after its reconnect; the shards' consumers:\n"
            f"{_shard_consumers(federation)}\nthe routers said: {said}"
        )


#: one uplink shard as the backend sees it: messages ready and unacked, and its consumers
#: as (router connection name, activity status, x-priority)
Shard = tuple[int, int, list[tuple[str, str, int]]]


def _each_shard_read_by_its_first(shards: dict[str, Shard], routers: tuple[str, ...]) -> bool:
    """Every router stands by on every shard, and each shard's single active consumer is the
    one of the highest priority on it (router/bridge.py: its owner's)."""

    def ok(consumers: list[tuple[str, str, int]]) -> bool:
        on = {name for name, _, _ in consumers}
        active = [prio for _, status, prio in consumers if status == "single_active"]
        return all(any(r in name for name in on) for r in routers) and active == [
            max(prio for _, _, prio in consumers)
        ]

    return bool(shards) and all(ok(consumers) for _, _, consumers in shards.values())


def _shard_consumers(federation) -> str:
    """Each uplink shard's consumers as the backend sees them -- which router connection,
    priority, active or waiting -- and its messages: what tells a shard nobody reads from a
    slow one.  Called to explain a failure, so it says why it could not rather than raise in
    the failure's place."""
    try:
        shards = _shard_table(federation)
    except (AssertionError, OSError, subprocess.SubprocessError) as e:
        return f"(could not list them: {e})"
    lines = []
    for name, (ready, unacked, consumers) in sorted(shards.items()):
        lines.append(f"{name}: ready {ready}, unacked {unacked}")
        lines += [f"  {conn} {status} x-priority {prio}" for conn, status, prio in consumers]
    return "\n".join(lines)


def _shard_table(federation) -> dict[str, Shard]:
    """The uplink shards from rabbitmqctl (the management plugin keeps no statistics here)."""
    from backend import contract as c
    from tests.chaos.faults import rabbitmqctl

    def table(*args: str) -> list[list[str]]:
        out = rabbitmqctl(federation, "backend", ["-q", "--no-table-headers", *args], timeout=60)
        return [line.split("\t") for line in out.splitlines() if line.strip()]

    named = {}  # client_properties prints as [{"connection_name","longstr","fedgate router ..."},...]
    for pid, props in table("list_connections", "pid", "client_properties"):
        name = re.search(r'connection_name"?,\s*"?[a-z]*"?,?\s*"([^"]*)"', props)
        named[pid] = name.group(1) if name else props[:80]
    channel_of = {pid: named.get(conn, conn) for pid, conn in table("list_channels", "pid", "connection")}
    shards: dict[str, Shard] = {
        name: (int(ready), int(unacked), [])
        for name, ready, unacked in table("list_queues", "name", "messages_ready", "messages_unacknowledged")
        if name.startswith(f"{c.UPLINK_EXCHANGE}.")
    }
    # in rabbitmqctl's own column order, which it prints whatever order they are asked in
    for queue, channel, status, args in table(
        "list_consumers", "queue_name", "channel_pid", "activity_status", "arguments"
    ):
        if queue in shards:  # arguments print as [{"x-priority",10}]
            prio = re.search(r'"x-priority",\s*(-?\d+)', args)
            shards[queue][2].append(
                (channel_of.get(channel, channel), status, int(prio.group(1)) if prio else 0)
            )
    return shards


def _log_sizes(federation, names) -> dict[str, int]:
    """Where each router's log ends now (bytes), for _said_since."""
    return {n: federation.node(n).log_file.stat().st_size for n in names}


def _said_since(federation, since: dict[str, int]) -> dict[str, str]:
    """What each router logged since `since` (_log_sizes)."""
    return {
        n: federation.node(n).log_file.read_bytes()[at:].decode(errors="replace") for n, at in since.items()
    }


def test_kafka_down_for_30s_while_devices_publish_loses_nothing(federation, endpoints, uid):
    """Kafka stopped 30 s, longer than the routers' kafka_stall_s: Kafka away is ridden out, not
    taken for a stalled producer (no router fails while Kafka is away).  A producer that stalls
    once Kafka is back (seen once, before the stall guard) is failed and started again: then its
    unacked window may reach Kafka twice."""
    routers = [federation.node(name) for name in ("router-0", "router-1")]
    logged = _log_sizes(federation, [r.name for r in routers])
    with Fleet.on_both_gateways(endpoints, f"kafka-{uid}", per_region=2, interval=0.05) as fleet:
        time.sleep(1.0)
        federation.stop_node("kafka")
        stopped_at = time.monotonic()
        acked_at_stop = fleet.total_acked
        time.sleep(30)
        published_while_down = fleet.total_acked - acked_at_stop
        federation.start_node("kafka")
        back_at = time.time()
        down_s = round(time.monotonic() - stopped_at)
        time.sleep(2.0)
    assert published_while_down > 0, "devices kept publishing while Kafka was down"
    got = read_back(endpoints["kafka"]["bootstrap"], fleet.acked, timeout=120)
    said = _said_since(federation, logged)
    stalls = {name: _stalled_at(text) for name, text in said.items()}
    restarted = sum(bool(at) for at in stalls.values())
    check(
        fleet,
        got,
        max_duplicates=resend_bound(fleet, routers=restarted) if restarted else 0,
        spark_federation=federation,
        device_prefix=f"kafka-{uid}-",
        kafka_down_s=down_s,
        acked_while_down=published_while_down,
        routers_stalled_after_kafka_was_back=restarted,
    )
    for r in routers:
        assert r.is_running(), f"{r.name} survived the Kafka outage"
        assert all(at >= back_at for at in stalls[r.name]), (
            f"{r.name} took Kafka away for a stall: {said[r.name][-2000:]}"
        )


def _stalled_at(log_text: str) -> list[float]:
    """When (epoch s) the router's log says its producer stalled."""
    import datetime as dt

    return [
        dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for line in log_text.splitlines()
        if "Kafka producer stalled" in line
    ]


def test_sigterm_drains_and_exits_cleanly(federation, endpoints, uid):
    with Fleet.on_both_gateways(endpoints, f"term-{uid}", per_region=2) as fleet:
        time.sleep(1.0)
        node = federation.node("router-1")
        pid = node.pid()
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: processes.exit_code(pid) is not None, 30, 0.1)
        code = processes.exit_code(pid)
        federation.start_node("router-1")
        time.sleep(1.0)
    assert code == 0, f"router exit code {code} after SIGTERM"
    log = node.stdout_log.read_text()
    assert "stopping: producer flushed" in log and "stopped" in log
    got = read_back(endpoints["kafka"]["bootstrap"], fleet.acked)
    check(fleet, got, max_duplicates=0, spark_federation=federation, device_prefix=f"term-{uid}-")


def test_with_kafka_away_commands_to_connected_devices_and_presence_keep_flowing(federation, endpoints, uid):
    """Kafka stopped; 150 commands for a device that is away, each of which must be parked in
    Kafka; then a command for a connected device, and one for a device that connects at the
    other gateway meanwhile.  Before, a parked command held its AMQP message until Kafka
    confirmed, and 100 of them (the prefetch) stopped every command behind them, to connected
    devices too, until Kafka was back.  Once it is, the away device gets all 150 in order --
    but for those parked longer than parking's TTL (PARK_TTL_S) by then, as a loaded machine's
    slow Kafka restart can make them: each of those is in the dead-letter topic with that
    reason, and the device gets the rest in order."""
    from backend import contract as c
    from backend.amqp import send_command
    from tests.conftest import PARK_TTL_S
    from tests.helpers import device, record_counts, wait_present

    def send(dev_id: str, payload: str) -> None:
        send_command(endpoints["backend"]["url"], dev_id, c.device_command_topic(dev_id, "k"), payload)

    away, here, newcomer = f"kaway-{uid}", f"khere-{uid}", f"knew-{uid}"
    gone = device(endpoints, "local-eu", away)
    wait_present(endpoints, away, "local-eu")
    gone.close()  # seen once: its commands are parked while it is away
    h = device(endpoints, "local-eu", here)
    n = back = None
    try:
        h.subscribe(c.device_command_topic(here, "#"))
        wait_present(endpoints, here, "local-eu")
        federation.stop_node("kafka")
        first_sent = time.time()
        try:
            for i in range(150):
                send(away, f"p{i}")
            t0 = time.monotonic()
            send(here, "while-kafka-away")
            got_here = [r.payload for r in h.wait_for(1, timeout=15)]
            here_s = time.monotonic() - t0
            n = device(endpoints, "local-us", newcomer)
            n.subscribe(c.device_command_topic(newcomer, "#"))
            wait_present(endpoints, newcomer, "local-us", timeout=15)
            send(newcomer, "hello")
            got_new = [r.payload for r in n.wait_for(1, timeout=15)]
        finally:
            federation.start_node("kafka")
        back = device(endpoints, "local-us", away)
        back.subscribe(c.device_command_topic(away, "#"))
        # a margin for the TTL's sweep: a command this close to its expiry may go either way
        within_ttl = time.time() - first_sent < PARK_TTL_S - 5
        parked = [r.payload for r in back.wait_for(150, timeout=120 if within_ttl else 30)]
        time.sleep(1.0)
        expired = [] if within_ttl else _expired_commands(endpoints, away, 150 - len(back.received))
        record_counts(
            parked_while_kafka_away=150,
            delivered_after=len(back.received),
            expired_by_parking_ttl=len(expired),
            to_connected_while_away=len(got_here),
            connected_device_got_it_after_s=round(here_s, 2),
            to_newcomer_while_away=len(got_new),
            lost=150 - len(back.received) - len(expired) + (1 - len(got_here)) + (1 - len(got_new)),
        )
        assert got_here == [b"while-kafka-away"], "a connected device's command waited for Kafka"
        assert got_new == [b"hello"], "presence or routing stopped while Kafka was away"
        assert all(reason.startswith(f"parked for {PARK_TTL_S}s") for _, reason in expired), expired
        # the oldest expired, the rest reached the device in order: none lost, none twice
        payloads = [p for p, _ in expired] + parked
        assert payloads == [f"p{i}".encode() for i in range(150)] and len(back.received) == len(parked)
        assert parked, "commands parked within their TTL reached the device"
    finally:
        for d in (h, n, back):
            if d is not None:
                d.close()


def test_the_router_routing_commands_killed_another_takes_over_and_no_command_is_lost(
    federation, endpoints, uid
):
    """Commands stream to a connected device (20 a second) when the router that routes them is
    killed (SIGKILL); right after, five commands go to a device that is away.  Before, only
    router-0 routed commands: with it dead, every command waited until it was back.  Now the
    other router takes over within seconds, and it stays killed until every command arrived.
    Then it comes back (standing by), the away device reconnects at the other gateway, and
    gets its five once each: two routers must not both deliver parked commands."""
    import threading
    import urllib.request

    from backend import contract as c
    from backend.amqp import send_command
    from tests.helpers import device, leader_url, record_counts, wait_present

    def send(dev_id: str, payload: str) -> None:
        send_command(endpoints["backend"]["url"], dev_id, c.device_command_topic(dev_id, "n"), payload)

    leader = next(name for name, url in endpoints["routers"].items() if url == leader_url(endpoints))
    here, away = f"fo-here-{uid}", f"fo-away-{uid}"
    gone = device(endpoints, "local-eu", away)
    wait_present(endpoints, away, "local-eu")
    gone.close()  # seen once: its commands are parked while it is away
    h = device(endpoints, "local-eu", here)
    back = None
    sent: list[tuple[int, float]] = []
    try:
        h.subscribe(c.device_command_topic(here, "#"))
        wait_present(endpoints, here, "local-eu")

        def stream() -> None:
            for i in range(120):
                sent.append((i, time.time()))
                send(here, str(i))
                time.sleep(0.05)

        sender = threading.Thread(target=stream)
        sender.start()
        time.sleep(1.5)
        killed_at = time.time()
        os.kill(federation.node(leader).pid(), signal.SIGKILL)
        for i in range(5):
            send(away, f"parked-{i}")
        sender.join()
        h.wait_for(count=120, timeout=30)
        got = [int(r.payload) for r in list(h.received)]
        new_leader = next(name for name, url in endpoints["routers"].items() if url == leader_url(endpoints))
        # the first command sent after the kill, and when it arrived
        after_kill = [i for i, at in sent if at > killed_at]
        arrivals = {int(r.payload): r.at for r in list(h.received)}
        resumed_s = min((arrivals[i] - killed_at for i in after_kill if i in arrivals), default=float("inf"))
        federation.start_node(leader)
        back = device(endpoints, "local-us", away)
        back.subscribe(c.device_command_topic(away, "#"))
        back.wait_for(count=5, timeout=20)
        time.sleep(2.0)  # a second delivery by the other router would arrive by now
        parked = [r.payload for r in list(back.received)]
        with urllib.request.urlopen(endpoints["routers"][leader] + "/health", timeout=5) as r:
            restarted_ok = r.status == 200
    finally:
        h.close()
        if back is not None:
            back.close()
    lost = len(set(range(120)) - set(got)) + len({f"parked-{i}".encode() for i in range(5)} - set(parked))
    record_counts(
        killed=leader,
        took_over=new_leader,
        routing_resumed_after_s=round(resumed_s, 2),
        sent=125,
        delivered=len(set(got)) + len(set(parked)),
        delivered_twice=len(got) - len(set(got)) + len(parked) - len(set(parked)),
        lost=lost,
    )
    assert new_leader != leader
    assert sorted(set(got)) == list(range(120)), f"lost: {sorted(set(range(120)) - set(got))}"
    # each parked command once, in order: the restarted router stands by
    assert parked == [f"parked-{i}".encode() for i in range(5)]
    assert restarted_ok
    # the in-flight window of the killed router (its unacked commands) is sent again: bounded
    assert len(got) - len(set(got)) <= 20


def _expired_commands(endpoints: dict, dev_id: str, expect: int) -> list[tuple[bytes, str]]:
    """The dead-lettered commands of `dev_id` (payload, reason), in the order they were parked."""
    from backend import contract as c
    from tests.helpers import kafka_records

    dead = kafka_records(
        endpoints,
        c.KAFKA_DEADLETTER_TOPIC,
        lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id,
        expect,
        timeout=30,
        settle_s=2.0,
    )
    out = [(m.value(), h.get(c.KAFKA_DEADLETTER_REASON_HEADER, "")) for m, h in dead]
    return sorted(out, key=lambda pr: int(pr[0][1:]))
