"""What waits for a device (router/waiting.py): a region that cannot take a message leaves it
waiting and tried again, in order, and one record's trouble never stops the sweep."""

from __future__ import annotations

import asyncio
import time

from router.metrics import Metrics
from router.parking import ParkingLot
from router.presence import PresenceTable, Session
from router.routing import Command
from router.sending import RegionUnreachable
from router.stores import DesiredState, KafkaTable
from router.subscriptions import Subscriptions
from router.waiting import Waiting


class _StoredAtOnce:
    """A producer whose every write Kafka has confirmed."""

    def send_soon(self, topic, value, key):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def _table(name: str) -> KafkaTable:
    return KafkaTable("127.0.0.1:1", name, _StoredAtOnce(), "unit")  # type: ignore[arg-type]  # never started


class _Region:
    """The send path: records what went out, or raises while the region's link is down."""

    def __init__(self):
        self.link_up = False
        self.sent: list[tuple[str, str, bytes]] = []
        #: how each send's session takes it (Subscriptions.delivery), in order
        self.delivery: list[str] = []
        self.deadlettered: list[tuple[str, str]] = []

    async def send(self, region: str, cmd: Command, payload: bytes, *, delivery: str = "") -> None:
        if not self.link_up:
            raise RegionUnreachable(region)
        self.sent.append((region, cmd.topic, payload))
        self.delivery.append(delivery)

    async def deadletter(self, reason: str, device: str, topic: str, payload: bytes) -> None:
        self.deadlettered.append((device, reason))


def _world() -> tuple[_Region, PresenceTable, Subscriptions, Waiting]:
    """The region's send path, presence, subscriptions, and what waits, wired together."""
    region, presence, subs = _Region(), PresenceTable(), Subscriptions()
    w = Waiting(
        ParkingLot(_table("parked"), ttl_s=60),
        DesiredState(_table("desired")),
        presence,
        subs,
        Metrics(),
        ack_timeout_s=30,
        send=region.send,
        deadletter=region.deadletter,
    )
    return region, presence, subs, w


def test_commands_a_region_could_not_take_wait_and_go_out_in_order_once_it_can():
    async def scenario():
        region, presence, subs, w = _world()
        session = Session("d1", "local-us", "rabbit@us", "conn-1", time.time())
        presence.connected(session)
        subs.opened(session.connection)
        subs.add(session.connection, ["devices/d1/commands/#"], qos=1)
        for n in (1, 2, 3):
            await w.parking.park_command(Command("d1", f"devices/d1/commands/c{n}"), b"%d" % n)

        await w.deliver(session, ["devices/d1/commands/#"])
        assert region.sent == [] and len(w.parking.for_device("d1")) == 3, "nothing lost while it cannot"
        await w.sweep(time.time())
        assert region.sent == [] and len(w.parking.for_device("d1")) == 3

        region.link_up = True
        await w.sweep(time.time())
        assert [p for _, _, p in region.sent] == [b"1", b"2", b"3"], "in parking order"
        assert w.parking.for_device("d1") == [], "sent to a QoS 1 subscription: done"
        await w.sweep(time.time())
        assert len(region.sent) == 3, "sent once"

    asyncio.run(scenario())


def test_each_send_says_how_the_session_takes_the_command_qos1_qos0_or_unknown():
    """The `routed` step's `delivery` (router/outcomes.py): what `fedgate send --wait` reads to
    know whether MQTT carries the command on (QoS 1) or the device's acknowledgement is next."""

    async def scenario():
        region, presence, subs, w = _world()
        region.link_up = True
        sessions = {
            "qos1": Session("d1", "local-us", "rabbit@us", "conn-1", time.time()),
            "qos0": Session("d2", "local-us", "rabbit@us", "conn-2", time.time()),
            "": Session("d3", "local-us", "rabbit@us", "conn-3", time.time()),
        }
        for qos, session in sessions.items():
            presence.connected(session)
            if qos:  # d3's filters unknown: its gateway could not say
                subs.opened(session.connection)
                subs.add(session.connection, [f"devices/{session.client_id}/commands/#"], qos=int(qos[-1]))
            device = session.client_id
            await w.parking.park_command(Command(device, f"devices/{device}/commands/c"), b"x")
            await w.deliver(session, ["#"])
        assert region.delivery == ["qos1", "qos0", ""]

    asyncio.run(scenario())


def test_a_device_that_left_is_not_tried_again_its_next_session_gets_what_waits():
    async def scenario():
        region, presence, subs, w = _world()
        session = Session("d1", "local-us", "rabbit@us", "conn-1", time.time())
        await w.parking.park_command(Command("d1", "devices/d1/commands/c"), b"x")
        await w.deliver(session, ["#"])
        region.link_up = True
        await w.sweep(time.time())  # d1 has no session in the presence table
        assert region.sent == [] and len(w.parking.for_device("d1")) == 1

    asyncio.run(scenario())


def test_a_connection_not_subscribed_yet_is_not_sent_what_waits():
    async def scenario():
        region, presence, subs, w = _world()
        session = Session("d1", "local-us", "rabbit@us", "conn-1", time.time())
        presence.connected(session)
        subs.opened(session.connection)  # seen open, no subscription yet
        await w.parking.park_command(Command("d1", "devices/d1/commands/c"), b"x")
        w.retry_later("d1")
        region.link_up = True
        await w.sweep(time.time())
        assert region.sent == [], "MQTT would drop it: it waits for the subscription"

    asyncio.run(scenario())


def test_an_expired_record_is_dead_lettered_even_when_a_region_cannot_take_the_others():
    async def scenario():
        region, presence, subs, w = _world()
        await w.parking.park("d1", "devices/d1/commands/old", b"o", command_expires_at=time.time() - 1)
        session = Session("d2", "local-us", "rabbit@us", "conn-2", time.time())
        presence.connected(session)
        await w.parking.park_command(Command("d2", "devices/d2/commands/c"), b"x")
        w.retry_later("d2")
        await w.sweep(time.time())
        assert [d for d, _ in region.deadlettered] == ["d1"]
        assert len(w.parking.for_device("d2")) == 1

    asyncio.run(scenario())


def test_commands_sent_as_their_connection_ended_wait_for_the_next_session_once(monkeypatch):
    """The router learns of a disconnect after it happened, and a clean session keeps nothing:
    what it sent in the last second before the gateway's close time is parked again.  What it
    sent earlier counts as delivered, and what was parked again is not parked a third time."""
    import types

    import router.waiting

    clock = [1_000_000.0]
    monkeypatch.setattr(router.waiting, "time", types.SimpleNamespace(time=lambda: clock[0]))

    async def scenario():
        region, presence, subs, w = _world()
        region.link_up = True
        first = Session("d1", "local-eu", "rabbit@eu", "conn-1", clock[0])
        presence.connected(first)
        subs.opened(first.connection)
        subs.add(first.connection, ["devices/d1/commands/#"], qos=1)
        await w.sent(first, Command("d1", "devices/d1/commands/early"), b"early")
        clock[0] += 5.0
        await w.sent(first, Command("d1", "devices/d1/commands/late"), b"late")
        presence.closed(first.node, first.connection)
        await w.session_ended(first, clock[0] + 0.5)  # the gateway closed it 0.5 s after "late"
        again = w.parking.for_device("d1")
        assert [(p.payload, p.again) for p in again] == [(b"late", True)]

        second = Session("d1", "local-us", "rabbit@us", "conn-2", clock[0])
        presence.connected(second)
        subs.opened(second.connection)
        await w.deliver(second, ["devices/d1/commands/#"])
        assert region.sent[-1] == ("local-us", "devices/d1/commands/late", b"late")
        assert w.parking.for_device("d1") == []
        presence.closed(second.node, second.connection)
        await w.session_ended(second, clock[0])  # it left at once again: no loop
        assert w.parking.for_device("d1") == []

    asyncio.run(scenario())


def test_commands_sent_to_a_session_that_opened_as_a_node_of_its_region_died_go_again_once(monkeypatch):
    """A gateway node dies; its devices reconnect at the others, whose deletion of the dead
    node's queues can take a moved device's new queue with them (rabbitmq-server #6271).  What
    is sent to a session that opened after the loss, within NODE_LOSS_SETTLE_S, is kept in the
    parking lot and sent again once that time is past; a session from before the loss, and a
    later one, are left alone."""
    import types

    import router.waiting

    clock = [1_000_000.0]
    monkeypatch.setattr(router.waiting, "time", types.SimpleNamespace(time=lambda: clock[0]))

    async def scenario():
        region, presence, subs, w = _world()
        region.link_up = True
        old = Session("d0", "local-eu", "rabbit@eu-2", "conn-0", (clock[0] - 60) * 1000)
        for s in (old,):
            presence.connected(s)
            subs.opened(s.connection)
            subs.add(s.connection, ["devices/d0/commands/#"], qos=1)
        w.node_lost("local-eu", clock[0] - 1.0)  # a session of the region ended unseen
        moved = Session("d1", "local-eu", "rabbit@eu-2", "conn-1", clock[0] * 1000)
        presence.connected(moved)
        subs.opened(moved.connection)
        subs.add(moved.connection, ["devices/d1/commands/#"], qos=1)
        await w.sent(moved, Command("d1", "devices/d1/commands/a"), b"a")
        await w.sent(moved, Command("d1", "devices/d1/commands/a"), b"a")  # returned, sent again
        await w.sent(old, Command("d0", "devices/d0/commands/b"), b"b")
        await w.sweep(clock[0])
        [kept] = w.parking.for_device("d1")  # in Kafka: a router taking over would have it too
        assert (kept.payload, kept.sent_to) == (b"a", "conn-1") and region.sent == [], (
            "kept, not sent again before the queues settled"
        )

        assert w.parking.for_device("d0") == [], "a session from before the loss is not at risk"

        clock[0] += router.waiting.NODE_LOSS_SETTLE_S + 1
        await w.sent(moved, Command("d1", "devices/d1/commands/c"), b"c")  # after the window
        await w.sweep(clock[0])
        # (w.sent records what the downlink sent; only the sweep's own sends reach the region)
        assert region.sent == [("local-eu", "devices/d1/commands/a", b"a")], "a, sent again; b, c not"
        assert w.parking.for_device("d1") == [] and w.parking.for_device("d0") == []
        assert w.metrics.total("fedgate_router_resent_after_node_loss_total") == 1

        clock[0] += router.waiting.NODE_LOSS_SETTLE_S + 1
        await w.sweep(clock[0])
        assert len(region.sent) == 1, "once, not in a loop"

    asyncio.run(scenario())


def test_a_command_sent_again_after_its_region_returned_it_waits_once_for_the_next_session():
    """A gateway node dies: the region returns each command sent to a device that was on it
    (no queue takes it) and the router sends it again, several times before it learns that
    the session ended.  The next session gets each such command once, not once per send."""

    async def scenario():
        _, presence, subs, w = _world()
        session = Session("d1", "local-eu", "rabbit@eu-1", "conn-1", time.time() * 1000)
        presence.connected(session)
        subs.opened(session.connection)
        subs.add(session.connection, ["devices/d1/commands/#"], qos=1)
        for _ in range(4):  # returned three times, sent again each time
            await w.sent(session, Command("d1", "devices/d1/commands/a"), b"a")
        await w.sent(session, Command("d1", "devices/d1/commands/b"), b"b")
        presence.closed(session.node, session.connection)
        await w.session_ended(session, time.time())
        assert [p.payload for p in w.parking.for_device("d1")] == [b"a", b"b"]

    asyncio.run(scenario())
