"""One node of a cluster dies while the rest carry on: the HA profile (FEDGATE_PROFILE=ha).

Every test here shares the HA federation of tests/ha (tests/ha/conftest.py),
Spark job included; `make test` runs this package in a lane of its own while
the session federation's lane runs its plain tests, before its fault
scenarios (tests/conftest.py LANES).  Each test has real devices publishing QoS 1
readings on both gateways, kills one node with SIGKILL, keeps it down, and counts: sent
(acknowledged by the gateway), in Kafka, in telemetry_raw, lost, duplicated,
and the longest time Kafka took no record of theirs after the kill.  Lost
must be 0, and telemetry_raw hold each reading once.

The HA profile clusters Kafka (3 KRaft brokers, replication 3,
min.insync.replicas 2), the backend (3 RabbitMQ nodes, every quorum queue a
replica on each) and each region's gateways (3 RabbitMQ nodes, devices
spread over them); routers and clients move to another node when theirs
dies, and the leading router starts federation links RabbitMQ lost
(router/link_keeper.py; docs/operations.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aio_pika
import aio_pika.exceptions
import pytest
from confluent_kafka.admin import AdminClient

from backend import contract as c
from backend.amqp import send_command
from backend.polling import wait_until
from infra.local import processes
from infra.local.driver import LocalFederation
from infra.local.layout import kafka_broker_id
from infra.local.nodes import Node
from router.presence_feed import LISTING_LAG_S
from tests.chaos.counting import CommandSender, Fleet, check, read_back, resend_bound
from tests.chaos.faults import LOSE_EXCHANGE_LINK_RECORDS, rabbitmq_eval
from tests.helpers import _metrics, device, leader_url, record_counts, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.kafka]

#: Seconds between one device's readings.  The HA federation is 16 processes on two cores,
#: each reading replicated three times in RabbitMQ and in Kafka: at full speed (0.01) the
#: machine is saturated and a SIGKILLed JVM took over 90 s to boot again on CI.  The claims
#: here are about faults, not throughput: ~100 readings/s are in flight at every kill.
HA_PUBLISH_INTERVAL = 0.04


def _leading_broker(fed: LocalFederation, ep: dict) -> tuple[dict[int, int], int, Node]:
    """The telemetry topic's leaders, the id of the broker leading most partitions, its node."""
    leaders = _leaders(ep["kafka"]["bootstrap"], c.KAFKA_TELEMETRY_TOPIC)
    broker_id = max(set(leaders.values()), key=list(leaders.values()).count)
    node = next(n for n in fed.nodes() if n.spec.role == "kafka" and kafka_broker_id(n.name) == broker_id)
    return leaders, broker_id, node


def _leaders(bootstrap: str, topic: str) -> dict[int, int]:
    """partition -> the broker id leading it."""
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    return {p: m.leader for p, m in md.topics[topic].partitions.items()}


class KafkaWrites:
    """The routers' records stored in Kafka, sampled every 0.1 s: the longest stall after a mark.

    Each router's own count is followed: a router that is down (killed in the test) is not
    asked, and a restarted one counts from 0 again."""

    def __init__(self, endpoints: dict):
        self.urls = list(endpoints["routers"].values())
        #: (time, {router url: its bridged count}) for the routers that answered
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _bridged(self, url: str) -> float | None:
        try:
            return sum(
                v for k, v in _metrics(url).items() if k.split("{")[0] == "fedgate_router_bridged_total"
            )
        except OSError:
            return None

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            counts = {u: n for u in self.urls if (n := self._bridged(u)) is not None}
            self.samples.append((time.monotonic(), counts))

    def longest_stall_after(self, t0: float) -> float:
        """Seconds, from t0 on, of the longest stretch in which no router stored a record."""
        longest, last_change = 0.0, t0
        previous: dict[str, float] = {}
        for at, counts in self.samples:
            stored = any(n > previous[u] or n < previous[u] for u, n in counts.items() if u in previous)
            previous.update(counts)
            if at < t0:
                continue
            if stored:
                longest = max(longest, at - last_change)
                last_change = at
        return round(longest, 1)

    def __enter__(self) -> KafkaWrites:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def test_the_kafka_cluster_has_three_brokers_and_every_topic_three_in_sync_replicas(ha_federation):
    bootstrap = ha_federation.endpoints()["kafka"]["bootstrap"]
    topics = (c.KAFKA_TELEMETRY_TOPIC, c.KAFKA_COMMAND_OUTCOMES_TOPIC)
    md = None

    def listed() -> bool:  # the routers create their topics as they start
        nonlocal md
        md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
        return all(t in md.topics for t in topics)

    wait_until(listed, 30, 0.5)
    assert sorted(md.brokers) == [1, 2, 3]
    for topic in topics:
        for p, m in md.topics[topic].partitions.items():
            assert len(m.replicas) == 3 and len(m.isrs) == 3, f"{topic}[{p}]: {m.replicas} in sync {m.isrs}"


def test_a_kafka_broker_killed_while_devices_publish_loses_nothing(ha_federation, ha_endpoints, uid):
    """SIGKILL the broker leading most telemetry partitions; keep it down 15 s; start it again."""
    fed, ep = ha_federation, ha_endpoints
    leaders, victim_id, victim = _leading_broker(fed, ep)
    with (
        KafkaWrites(ep) as writes,
        Fleet.on_both_gateways(ep, f"hak-{uid}", per_region=2, interval=HA_PUBLISH_INTERVAL) as fleet,
    ):
        time.sleep(2.0)
        pid = victim.pid()
        assert pid is not None
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        acked_at_kill = fleet.total_acked
        time.sleep(15)
        acked_while_down = fleet.total_acked - acked_at_kill
        fed.start_node(victim.name)
        time.sleep(3.0)
    stall = writes.longest_stall_after(killed_at)
    assert acked_while_down > 0, "devices kept publishing while the broker was down"
    got = read_back(ep["kafka"]["bootstrap"], fleet.acked, timeout=120)
    check(
        fleet,
        got,
        spark_federation=fed,
        max_duplicates=0,
        device_prefix=f"hak-{uid}-",
        killed=victim.name,
        led_partitions=sum(v == victim_id for v in leaders.values()),
        acked_while_down=acked_while_down,
        longest_kafka_stall_s=stall,
    )
    assert stall < 15, f"records stopped reaching Kafka for {stall} s: the other brokers did not take over"


def test_a_frozen_partition_leader_loses_nothing_and_a_stalled_router_is_started_again(
    ha_federation, ha_endpoints, uid
):
    """SIGSTOP the broker leading most telemetry partitions -- frozen, not dead: its sockets stay
    open and the routers' requests to it get no answer -- while devices publish QoS 1; keep it
    frozen 45 s; resume it.  The controller fences it and moves its partitions; a producer
    follows within seconds, or waits on its unanswered requests.  Both were seen (2026-11-29):
    records flowed again within 7.3 s; and, in a full run, router-1's oldest record waited 20 s
    while Kafka answered, so its stall guard (router/kafka.py, kafka_stall_s in ROUTER_TABLE)
    failed it, its supervisor started it again a second later, and the other router carried its
    shards meanwhile.  Either way nothing is lost, and every router routes at the end."""
    fed, ep = ha_federation, ha_endpoints
    leaders, victim_id, victim = _leading_broker(fed, ep)
    routers = [fed.node(name) for name in ep["routers"]]
    logged = {r.name: r.log_file.stat().st_size for r in routers}
    frozen = processes.marked_pids(victim.marker)
    assert frozen, f"{victim.name} runs"
    with (
        KafkaWrites(ep) as writes,
        Fleet.on_both_gateways(ep, f"haf-{uid}", per_region=2, interval=HA_PUBLISH_INTERVAL) as fleet,
    ):
        time.sleep(2.0)
        frozen_at = time.monotonic()
        processes.signal_pids(frozen, signal.SIGSTOP)
        try:
            acked_at_freeze = fleet.total_acked
            time.sleep(45)
            acked_while_frozen = fleet.total_acked - acked_at_freeze
        finally:
            processes.signal_pids(frozen, signal.SIGCONT)
        wait_until(lambda: all(r.ready() for r in routers), 90, 0.5)
        time.sleep(3.0)
    stall = writes.longest_stall_after(frozen_at)

    def said() -> dict[str, str]:
        return {r.name: r.log_file.read_bytes()[logged[r.name] :].decode(errors="replace") for r in routers}

    # a router may find its stall as late as kafka_stall_s after the broker's resume: its restart
    # is then under way while the devices stop, and is waited for here
    stalled: list[str] = []
    restarted: list[str] = []

    def settled() -> bool:
        nonlocal stalled, restarted
        text = said()
        stalled = sorted(n for n, t in text.items() if "Kafka producer stalled" in t)
        restarted = sorted(n for n, t in text.items() if "starting it again" in t)
        return stalled == restarted and all(r.ready() for r in routers)

    wait_until(settled, 60, 0.5)
    assert acked_while_frozen > 0, "devices kept publishing while the broker was frozen"
    got = read_back(ep["kafka"]["bootstrap"], fleet.acked, timeout=120)
    check(
        fleet,
        got,
        spark_federation=fed,
        # a router failed as stalled hands its unacked window back, sent again by the other
        max_duplicates=resend_bound(fleet, routers=len(stalled)),
        device_prefix=f"haf-{uid}-",
        frozen=victim.name,
        led_partitions=sum(v == victim_id for v in leaders.values()),
        acked_while_frozen=acked_while_frozen,
        routers_stalled=len(stalled),
        longest_kafka_stall_s=stall,
    )
    assert stalled == restarted, f"each router failed as stalled was started again: {stalled} {restarted}"
    assert all(r.ready() for r in routers), "every router routes at the end"


def test_the_backend_is_a_cluster_of_three_and_every_quorum_queue_has_a_replica_on_each(ha_federation):
    admin = ha_federation.backend().admin()
    nodes = {n["name"] for n in admin.get("nodes") if n.get("running")}
    assert len(nodes) == 3, nodes
    quorum = [q for q in admin.get("queues") if q.get("type") == "quorum"]
    names = {q["name"] for q in quorum}
    shards = {c.uplink_shard_queue(i) for i in range(c.UPLINK_SHARDS)}
    assert shards <= names and c.COMMANDS_QUEUE in names, names
    assert any(n.startswith("federation: fedgate.downlink.") for n in names), "the downlink's queues"
    routers = [n.name for n in ha_federation.nodes() if n.spec.role == "router"]
    assert {c.router_presence_queue(r) for r in routers} <= names, "each router's presence events"
    for q in quorum:
        assert set(q.get("members") or []) == nodes, f"{q['name']}: replicas on {q.get('members')}"


def _presence_consumers(fed: LocalFederation, url: str) -> dict[str, int]:
    """Each router's presence queue's consumers, asked over AMQP of the backend node at `url`
    (empty when it cannot tell within 3 s).  Not `rabbitmqctl list_queues`: while quorum
    queues elect new leaders it waited on each of them and took over 60 s."""
    routers = [n.name for n in fed.nodes() if n.spec.role == "router"]

    async def ask() -> dict[str, int]:
        async with await aio_pika.connect(url, timeout=3) as conn:
            channel = await conn.channel()
            out = {}
            for r in routers:
                queue = await channel.declare_queue(c.router_presence_queue(r), passive=True)
                out[r] = queue.declaration_result.consumer_count
            return out

    try:
        return asyncio.run(asyncio.wait_for(ask(), 3))
    except (TimeoutError, OSError, aio_pika.exceptions.AMQPException):
        return {}


def _per_router(endpoints: dict, metric: str) -> dict[str, float]:
    """A counter of every router that answers (all its labels summed), by router name."""
    out = {}
    for name, url in endpoints["routers"].items():
        try:
            m = _metrics(url)
        except OSError:
            continue  # a router being restarted
        out[name] = sum(v for k, v in m.items() if k.startswith(metric))
    return out


def _repairs(endpoints: dict) -> float:
    """Federation link repairs so far, summed over the routers (router/link_keeper.py)."""
    return sum(_per_router(endpoints, "fedgate_router_federation_link_repairs_total").values())


@pytest.mark.parametrize("which", ["running-links", "lost-records"])
def test_a_backend_node_killed_while_devices_publish_and_get_commands_loses_nothing(
    ha_federation, ha_endpoints, uid, which
):
    """SIGKILL a backend node; keep it down 15 s while devices publish QoS 1 and get a command
    every 0.25 s; start it again.  running-links: the node (not the first) that runs most of
    the uplink's federation links.  lost-records: the node that runs them, after RabbitMQ lost
    the links' records as 4.0.5 does when a node restarts before it sees its peers (no node
    takes the links over: the leading router's watch applies their policies anew).  first:
    `backend`, the node the routers, their lease connections, the command sender and the
    gateways' downlink links dial first -- each must move to another node."""
    fed, ep = ha_federation, ha_endpoints
    backends = [n for n in fed.nodes() if n.spec.role == "backend"]
    link_nodes = [lk.get("node", "") for lk in fed.backend().admin().federation_links()]
    if which == "first":
        victim = fed.backend()
    elif which == "lost-records":
        victim = max(backends, key=lambda n: link_nodes.count(n.erlang_node))
    else:
        others = [n for n in backends if n.name != "backend"]
        victim = max(others, key=lambda n: link_nodes.count(n.erlang_node))
    repairs_before = _repairs(ep)
    cmd_ids = [f"hab-cmd-{uid}-{r}" for r in ("local-eu", "local-us")]
    receivers = [device(ep, r, d) for r, d in zip(("local-eu", "local-us"), cmd_ids, strict=True)]
    try:
        for d in receivers:
            d.subscribe(c.device_command_topic(d.device_id, "#"))
        for d, r in zip(receivers, ("local-eu", "local-us"), strict=True):
            wait_present(ep, d.device_id, r)
        with (
            KafkaWrites(ep) as writes,
            Fleet.on_both_gateways(ep, f"hab-{uid}", per_region=2, interval=HA_PUBLISH_INTERVAL) as fleet,
            CommandSender(ep["backend"]["urls"], cmd_ids) as commands,
        ):
            time.sleep(2.0)
            if which == "lost-records":
                rabbitmq_eval(fed, victim.name, LOSE_EXCHANGE_LINK_RECORDS)
            killed_at = time.monotonic()
            victim.kill()
            acked_at_kill = fleet.total_acked
            # The routers follow presence all along: each one's queue lives on and is read
            # again within seconds.  (Before, a classic queue on the first node was down with
            # it, and the routers' backend connections came back only after it: 20-90 s.)
            up = next(n for n in backends if n.name != victim.name)
            up_url = next(u for u in ep["backend"]["urls"] if f":{up.spec.ports['amqp']}/" in u)
            seen: dict[str, int] = {}

            def each_router_reads() -> bool:
                seen.update(_presence_consumers(fed, up_url))
                return bool(seen) and all(seen.values())

            followed = wait_until(each_router_reads, timeout=10, interval=1.0)
            assert followed, f"a router stopped reading its presence events: consumers {seen}"
            time.sleep(max(0.0, 15 - (time.monotonic() - killed_at)))
            acked_while_down = fleet.total_acked - acked_at_kill
            fed.start_node(victim.name)
            fed.wait_for_links(timeout=60)
            time.sleep(2.0)
        stall = writes.longest_stall_after(killed_at)
        delivered = commands.delivered(receivers)
    finally:
        for d in receivers:
            d.close()
    assert acked_while_down > 0, "devices kept publishing while the node was down"
    got = read_back(ep["kafka"]["bootstrap"], fleet.acked, timeout=120)
    record_counts(
        killed=victim.name,
        link_repairs=_repairs(ep) - repairs_before,
        commands_sent=sum(len(v) for v in commands.sent.values()),
        commands_refused_at_send=commands.refused,
        commands_lost=delivered.lost,
        commands_twice=delivered.twice,
    )
    check(
        fleet,
        got,
        spark_federation=fed,
        # the node ran the uplink links and held routers' connections: each resends its window
        max_duplicates=resend_bound(fleet, links=2, routers=2),
        device_prefix=f"hab-{uid}-",
        killed=victim.name,
        acked_while_down=acked_while_down,
        longest_kafka_stall_s=stall,
    )
    assert delivered.lost == 0, (
        f"{delivered.lost} confirmed commands never reached their device:\n"
        + commands.lost_story(delivered, ep["kafka"]["bootstrap"])
    )
    if which == "lost-records":
        assert _repairs(ep) > repairs_before, (
            "no node took the links over: the leader applied their policies anew"
        )


def test_each_region_is_a_gateway_cluster_of_three_and_the_backends_links_reach_every_node(ha_federation):
    """A region's gateway is three nodes; the backend's upstream for it names all three, and
    the uplink's queues on the gateway are quorum queues with a replica on each node."""
    for region in ("local-eu", "local-us"):
        members = [g for g in ha_federation.gateways() if g.spec.region == region]
        assert len(members) == 3, [g.name for g in members]
        admin = members[0].admin()
        running = {n["name"] for n in admin.get("nodes") if n.get("running")}
        assert running == {g.erlang_node for g in members}
        link_queues = [q for q in admin.queues() if q["name"].startswith("federation: ")]
        assert link_queues, "the backend's links read the gateway through federation queues"
        for q in link_queues:
            assert q.get("type") == "quorum" and set(q.get("members") or []) == running, q
    for cl in ha_federation.clusters():  # what `fedgate status` shows under its node table
        assert cl.running == cl.members and len(cl.members) == 3 and cl.under_replicated == 0, cl
    upstream = (
        ha_federation.backend()
        .admin()
        .get(f"parameters/federation-upstream/%2F/{c.gateway_upstream_name('local-eu')}")
    )
    assert isinstance(upstream["value"]["uri"], list) and len(upstream["value"]["uri"]) == 3


def test_a_gateway_node_killed_its_devices_move_to_the_others_and_nothing_is_lost(
    ha_federation, ha_endpoints, uid
):
    """SIGKILL the first node of local-eu's gateway cluster -- the one its definitions were
    applied through, and the one the router asks first -- while devices on each of its nodes
    publish QoS 1 and get a command every 0.25 s; keep it down 15 s; start it again.  Its
    devices move to the region's other nodes (they know them all, as a load balancer
    would); nothing they were acknowledged is lost, and no command sent to them is lost."""
    fed, ep = ha_federation, ha_endpoints
    region = "local-eu"
    members = sorted((g for g in fed.gateways() if g.spec.region == region), key=lambda g: len(g.name))
    victim = members[0]
    cmd_ids = [f"hag-cmd-{uid}-{i}" for i in range(3)]
    receivers = [device(ep, region, d, node=i) for i, d in enumerate(cmd_ids)]
    try:
        for d in receivers:
            d.subscribe(c.device_command_topic(d.device_id, "#"))
        for d in receivers:
            wait_present(ep, d.device_id, region)
        present_at = time.monotonic()
        with (
            KafkaWrites(ep) as writes,
            Fleet.on_both_gateways(ep, f"hag-{uid}", per_region=3, interval=HA_PUBLISH_INTERVAL) as fleet,
            CommandSender(ep["backend"]["url"], cmd_ids) as commands,
        ):
            # Sessions as old as a fleet's: past the age at which the router's check of the
            # connection lists ends a session no list shows (LISTING_LAG_S), which then races the
            # moved devices' connect events.  (The every-engine kill below keeps them young.)
            time.sleep(max(2.0, LISTING_LAG_S + 2.0 - (time.monotonic() - present_at)))
            on_victim = [d.device_id for d in [*fleet.devices, *receivers] if d.host == victim.spec.address]
            killed_at, killed_wall = time.monotonic(), time.time()
            victim.kill()
            acked_at_kill = fleet.total_acked
            assert victim.spec.address, "a gateway node is a host of its own"
            moved_after = _all_moved(fleet.devices + receivers, victim.spec.address, killed_at)
            # what `fedgate status` tells the operator meanwhile
            seen_by_status = {cl.name: cl for cl in fed.clusters()}[f"gateways {region}"]
            time.sleep(max(0.0, 15 - (time.monotonic() - killed_at)))
            acked_while_down = fleet.total_acked - acked_at_kill
            fed.start_node(victim.name)
            fed.wait_for_links(timeout=60)
            time.sleep(2.0)
        stall = writes.longest_stall_after(killed_at)
        delivered = commands.delivered(receivers)
    finally:
        for d in receivers:
            d.close()
    assert acked_while_down > 0, "devices kept publishing while the node was down"
    got = read_back(ep["kafka"]["bootstrap"], fleet.acked, timeout=120)
    record_counts(
        killed=victim.name,
        devices_on_it=len(on_victim),
        moved_to_another_node_after_s=moved_after,
        commands_sent=sum(len(v) for v in commands.sent.values()),
        commands_lost=delivered.lost,
        commands_twice=delivered.twice,
    )
    check(
        fleet,
        got,
        spark_federation=fed,
        max_duplicates=resend_bound(fleet, links=1),  # the region's uplink link moves to another node
        device_prefix=f"hag-{uid}-",
        # what the link had taken from the dead node's queue replica comes after what was sent
        # since (docs/reliability.md, Limits): seen once in 6 runs
        in_order=False,
        killed=victim.name,
        acked_while_down=acked_while_down,
        longest_kafka_stall_s=stall,
    )
    assert on_victim, "devices were connected to the node that was killed"
    assert victim.name not in seen_by_status.running and len(seen_by_status.running) == 2
    assert seen_by_status.under_replicated, "status named the quorum queues that lost a replica"
    assert delivered.lost == 0, (
        f"{delivered.lost} confirmed commands never reached their device "
        f"({victim.name} killed at {time.strftime('%H:%M:%S', time.localtime(killed_wall))}."
        f"{int(killed_wall * 1000) % 1000:03d}; on it: {on_victim}):\n"
        + commands.lost_story(delivered, ep["kafka"]["bootstrap"])
    )


def _all_moved(devices, address: str, since: float, timeout: float = 30.0) -> float:
    """Seconds until no device is on the node at `address` and each is connected again."""
    deadline = since + timeout
    while time.monotonic() < deadline:
        if all(d.connected and d.host != address for d in devices):
            return round(time.monotonic() - since, 1)
        time.sleep(0.1)
    stuck = [d.device_id for d in devices if not d.connected or d.host == address]
    raise AssertionError(f"devices never moved off the dead node: {stuck}")


def test_the_router_bridging_most_shards_killed_the_other_takes_them_and_nothing_is_lost(
    ha_federation, ha_endpoints, uid
):
    """SIGKILL the router that bridged the most readings in the last 2 s (the active consumer of
    most uplink shards) while devices publish QoS 1 on both gateways; keep it down 15 s; start
    it again.  The other router, standing by on every shard, takes them at once."""
    fed, ep = ha_federation, ha_endpoints
    with (
        KafkaWrites(ep) as writes,
        Fleet.on_both_gateways(ep, f"har-{uid}", per_region=3, interval=HA_PUBLISH_INTERVAL) as fleet,
    ):
        time.sleep(1.0)
        before = _per_router(ep, "fedgate_router_bridged_total")
        time.sleep(2.0)
        after = _per_router(ep, "fedgate_router_bridged_total")
        name = max(after, key=lambda r: after[r] - before.get(r, 0.0))
        victim = fed.node(name)
        killed_at = time.monotonic()
        victim.kill()
        acked_at_kill = fleet.total_acked
        time.sleep(15)
        acked_while_down = fleet.total_acked - acked_at_kill
        fed.start_node(victim.name)
        time.sleep(3.0)
    stall = writes.longest_stall_after(killed_at)
    assert acked_while_down > 0, "devices kept publishing while the router was down"
    got = read_back(ep["kafka"]["bootstrap"], fleet.acked, timeout=120)
    check(
        fleet,
        got,
        spark_federation=fed,
        max_duplicates=resend_bound(fleet, routers=1),  # what the dead router had not acked goes again
        device_prefix=f"har-{uid}-",
        killed=victim.name,
        its_share_of_the_last_2s=round(
            (after[name] - before.get(name, 0.0)) / max(1.0, sum(after.values()) - sum(before.values())), 2
        ),
        acked_while_down=acked_while_down,
        longest_kafka_stall_s=stall,
    )
    assert stall < 15, (
        f"records stopped reaching Kafka for {stall} s: the other router did not take the shards"
    )


def test_one_node_of_every_engine_killed_at_once_loses_nothing(ha_federation, ha_endpoints, uid):
    """At the same moment SIGKILL the Kafka broker leading most telemetry partitions, the first
    backend node, the first gateway node of local-eu and the router routing commands, while
    devices on every gateway node publish QoS 1 and four devices (one per local-eu node, one in
    local-us) get a command every 0.25 s; keep them down 15 s; start them again."""
    fed, ep = ha_federation, ha_endpoints
    _, _, leading_broker = _leading_broker(fed, ep)
    leading_router = leader_url(ep)
    victims = [
        leading_broker,
        fed.backend(),
        next(g for g in fed.gateways() if g.name == "gw-local-eu"),
        fed.node(next(name for name, url in ep["routers"].items() if url == leading_router)),
    ]
    targets = [("local-eu", 0), ("local-eu", 1), ("local-eu", 2), ("local-us", 0)]
    cmd_ids = [f"haall-cmd-{uid}-{i}" for i in range(len(targets))]
    receivers = [device(ep, r, d, node=i) for (r, i), d in zip(targets, cmd_ids, strict=True)]
    try:
        for d in receivers:
            d.subscribe(c.device_command_topic(d.device_id, "#"))
        for d, (r, _) in zip(receivers, targets, strict=True):
            wait_present(ep, d.device_id, r)
        with (
            KafkaWrites(ep) as writes,
            Fleet.on_both_gateways(ep, f"haall-{uid}", per_region=3, interval=HA_PUBLISH_INTERVAL) as fleet,
            CommandSender(ep["backend"]["urls"], cmd_ids) as commands,
        ):
            time.sleep(2.0)
            killed_at = time.monotonic()
            with ThreadPoolExecutor(len(victims)) as pool:  # at once: each kill waits for its exit
                list(pool.map(lambda v: v.kill(), victims))
            acked_at_kill = fleet.total_acked
            time.sleep(15)
            acked_while_down = fleet.total_acked - acked_at_kill
            for v in victims:  # the router last: it starts once Kafka and the backend answer
                fed.start_node(v.name)
            fed.wait_for_links(timeout=60)
            time.sleep(2.0)
        stall = writes.longest_stall_after(killed_at)
        delivered = commands.delivered(receivers)
    finally:
        for d in receivers:
            d.close()
    assert acked_while_down > 0, "devices kept publishing while the nodes were down"
    got = read_back(ep["kafka"]["bootstrap"], fleet.acked, timeout=120)
    record_counts(
        killed="+".join(v.name for v in victims),
        commands_sent=sum(len(v) for v in commands.sent.values()),
        commands_refused_at_send=commands.refused,
        commands_lost=delivered.lost,
        commands_twice=delivered.twice,
    )
    check(
        fleet,
        got,
        spark_federation=fed,
        # links (both regions' on the backend node, local-eu's on its gateway node) and both routers'
        # connections moving resend what was unconfirmed
        max_duplicates=resend_bound(fleet, links=3, routers=2),
        device_prefix=f"haall-{uid}-",
        in_order=False,  # a gateway node died too (docs/reliability.md, Limits)
        killed="+".join(v.name for v in victims),
        acked_while_down=acked_while_down,
        longest_kafka_stall_s=stall,
    )
    assert delivered.lost == 0, (
        f"{delivered.lost} confirmed commands never reached their device:\n"
        + commands.lost_story(delivered, ep["kafka"]["bootstrap"])
    )
    # The stall is recorded, not asserted: with four engines losing a node at once on two
    # shared cores it ranged 3.2-5.3 s alone and 30.9 s with other federations running beside.


def test_a_fourth_region_joins_as_a_cluster_of_its_own_and_leaves_the_others_majorities_alone(
    ha_federation, ha_endpoints, uid
):
    """`make gateway REGION=local-ap` in the HA profile: three more gateway nodes that form a
    cluster of their own -- the other regions' clusters keep their three members, so no
    majority changes -- and carry a device's reading and command; removed, none is left."""
    fed, region = ha_federation, "local-ap"
    before = {n.name: n.pid() for n in fed.nodes()}
    fed.add_region(region)
    try:
        clusters = {cl.name: cl for cl in fed.clusters()}
        new = clusters[f"gateways {region}"]
        assert len(new.members) == 3 and new.running == new.members and new.under_replicated == 0
        for name in ("gateways local-eu", "gateways local-us", "backend"):
            assert len(clusters[name].members) == 3 and clusters[name].running == clusters[name].members
        assert {n: p for n, p in ((n.name, n.pid()) for n in fed.nodes()) if n in before} == before, (
            "nothing restarted"
        )
        joined = {n["name"] for n in fed.node(f"gw-{region}").admin().get("nodes")}
        assert joined == {g.erlang_node for g in fed.gateways() if g.spec.region == region}
        ep = {**ha_endpoints, **fed.endpoints()}
        dev_id = f"ha-ap-{uid}"
        d = device(ep, region, dev_id, node=2)
        try:
            d.subscribe(c.device_command_topic(dev_id, "#"))
            wait_present(ep, dev_id, region)
            send_command(ep["backend"]["urls"], dev_id, c.device_command_topic(dev_id, "hello"), b"hi")
            assert [r.payload for r in d.wait_for(1)] == [b"hi"], "a routed command reached the new region"
            d.publish(f"devices/{dev_id}/telemetry", {"seq": 1})
        finally:
            d.close()
        got = read_back(ep["kafka"]["bootstrap"], {dev_id: [1]}, timeout=30)
        assert got[dev_id] == [1], "its reading reached Kafka"
    finally:
        fed.remove_region(region)
    assert not any(g.spec.region == region for g in fed.gateways())
    assert processes.marked_pids(processes.marker(fed.state_dir, f"gw-{region}-n2")) == []


#: Runs last: twice (2026-11-24, before router/link_keeper.py) the backend's links were not
#: started anywhere after `backend` died, and stayed down for whatever ran next.
def test_the_first_backend_node_killed_while_devices_publish_and_get_commands_loses_nothing(
    ha_federation, ha_endpoints, uid
):
    """`backend`, the node every router, every router's lease connection, the command sender
    and the gateways' downlink links dial first: each must move to another node."""
    test_a_backend_node_killed_while_devices_publish_and_get_commands_loses_nothing(
        ha_federation, ha_endpoints, uid, "first"
    )
