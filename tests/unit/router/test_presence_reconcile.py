"""Presence checked against the gateways' connection lists (router/presence_feed.py `reconcile`):
what no event says -- a session the router ended while its gateway was frozen, a close lost with
a dead gateway -- the next list puts right, and a list never undoes a newer event."""

from __future__ import annotations

import asyncio
import time

from backend.rabbitmq_admin import AdminError
from router import presence_feed
from router.gateways import Gateways
from router.metrics import Metrics
from router.parking import ParkingLot
from router.presence import PresenceTable, Session
from router.presence_feed import LISTING_LAG_S, PresenceFeed
from router.routing import Command
from router.stores import DesiredState
from router.subscriptions import Subscriptions
from router.waiting import Waiting
from tests.unit.router.test_presence import created
from tests.unit.router.test_waiting import _table

NODE = "fedgate-gw-local-us@localhost"


class _Admin:
    """A gateway's management API as the router's client sees it: a tracked connection list."""

    def __init__(
        self, connections: list[dict[str, str]] | None, bindings: list[dict[str, str]] | None = None
    ):
        self.listing = connections
        #: the bindings of its amq.topic: what each MQTT session subscribes to
        self.bindings = bindings or []

    def get(self, path: str) -> list[dict[str, str]]:
        if self.listing is None:
            raise AdminError(f"GET {path}: connection refused", retriable=True)
        assert path == "exchanges/%2F/amq.topic/bindings/source", path
        return list(self.bindings)

    def connections(self) -> list[dict[str, str]]:
        if self.listing is None:
            raise AdminError("connection refused", retriable=True)
        return list(self.listing)

    def request_with_headers(self, method: str, path: str, headers: dict, body: object = None, **kw: object):
        if self.listing is None:
            raise AdminError(f"{method} {path}: connection refused", retriable=True)
        return {}


def _conn(user: str, name: str) -> dict[str, str]:
    return {"name": name, "vhost": "/", "user": user, "node": NODE}


class _Event:
    def __init__(self, key: str, headers: dict[str, object]):
        self.routing_key = key
        self.headers = headers


def _feed(
    listing: list[dict[str, str]] | None, bindings: list[dict[str, str]] | None = None
) -> tuple[PresenceFeed, PresenceTable, list[Session], Metrics]:
    presence, metrics, found = PresenceTable(), Metrics(), []

    async def found_one(session: Session) -> None:
        found.append(session)

    feed = PresenceFeed(
        presence,
        None,
        Gateways({"local-us": _Admin(listing, bindings)}, metrics),  # type: ignore[dict-item]
        Subscriptions(),
        set(),
        asyncio.Lock(),
        metrics,
        deliver=_nothing,
        has_pending=lambda device: False,
        found=found_one,
    )
    return feed, presence, found, metrics


async def _nothing(session: Session, filters: list[str]) -> None:
    return None


def _ago(seconds: float) -> int:
    return int((time.time() - seconds) * 1000)


def test_a_session_ended_while_its_gateway_was_silent_is_taken_back_when_it_lists_it():
    feed, presence, found, metrics = _feed([_conn("pump-1", "p:1 -> g:1883")])
    asyncio.run(feed.reconcile())
    session = presence.get("pump-1")
    assert session is not None and (session.region, session.connection) == ("local-us", "p:1 -> g:1883")
    assert found == [session], "the downlink is told, so what waits for pump-1 goes out"
    assert "pump-1" in feed.known
    assert metrics.get("fedgate_router_presence_reconciled_total", change="found") == 1


def test_a_session_no_list_shows_is_dropped_once_older_than_the_lists_lag_and_alive_ones_stay():
    feed, presence, found, metrics = _feed([_conn("fedgate-admin", "tool -> g:1883")])
    presence.connected(Session("gone", "local-us", NODE, "p:1 -> g:1883", _ago(LISTING_LAG_S + 5)))
    presence.connected(Session("just-came", "local-us", NODE, "p:2 -> g:1883", _ago(1)))
    # an operator's tool logged in as fedgate-admin: listed without a client id, alive all the same
    presence.connected(Session("monitor", "local-us", NODE, "tool -> g:1883", _ago(600)))
    asyncio.run(feed.reconcile())
    assert presence.get("gone") is None
    assert presence.get("just-came") is not None, "its connection may be younger than the list"
    assert presence.get("monitor") is not None
    assert metrics.get("fedgate_router_presence_reconciled_total", change="ended") == 1
    assert found == []


def test_a_close_event_applied_after_the_list_was_asked_is_not_undone():
    feed, presence, found, _ = _feed([_conn("pump-1", "p:1 -> g:1883")])
    listing = feed.gateways.connections

    async def list_then_close(region: str) -> list[dict[str, object]]:
        conns = await listing(region)
        # the device leaves while the list is on its way back to the router
        await feed._apply(
            _Event(
                "connection.closed",
                {"x-received-from": [{"cluster-name": "local-us"}], "node": NODE, "name": "p:1 -> g:1883"},
            )  # type: ignore[arg-type]
        )
        return conns

    feed.gateways.connections = list_then_close  # type: ignore[method-assign]
    asyncio.run(feed.reconcile())
    assert presence.get("pump-1") is None and found == []


def test_a_gateway_that_does_not_answer_changes_nothing():
    feed, presence, found, _ = _feed(None)
    presence.connected(Session("pump-1", "local-us", NODE, "p:1 -> g:1883", _ago(600)))
    asyncio.run(feed.reconcile())
    assert presence.get("pump-1") is not None and found == []


def test_a_gateway_that_stopped_answering_is_suspect_until_its_list_comes_back():
    feed, presence, _, metrics = _feed(None)
    assert asyncio.run(feed.gateways.answers("local-us")) is False
    assert feed.gateways.suspect == {"local-us"}
    assert 'fedgate_router_region_suspect{region="local-us"} 1' in metrics.render()
    feed.gateways.clients["local-us"].listing = [_conn("pump-1", "p:1 -> g:1883")]  # type: ignore[attr-defined]
    asyncio.run(feed.reconcile())
    assert feed.gateways.suspect == set() and presence.get("pump-1") is not None


def test_a_session_found_before_its_events_arrive_is_taken_as_subscribed_to_what_its_gateway_binds():
    """A connect wave outruns the router's events: the list shows connections whose
    connection.created has not been read yet.  Before, such a session counted as subscribed to
    everything, and a command sent before the device subscribed was dropped by MQTT unseen
    (196 of 2,001 in an army run on the HA profile).  Now it subscribes to what its gateway's
    amq.topic binds for it: nothing yet (the command is held for the binding event), or the
    filters it has, with their QoS."""
    bindings = [
        {
            "source": "amq.topic",
            "destination": "mqtt-subscription-pump-2qos0",
            "destination_type": "queue",
            "routing_key": "devices.pump-2.commands.#",
        }
    ]
    listing = [_conn("pump-1", "p:1 -> g:1883"), _conn("pump-2", "p:2 -> g:1883")]
    feed, presence, found, metrics = _feed(listing, bindings)
    asyncio.run(feed.reconcile())
    subs = feed.subscriptions
    assert subs.filters("p:1 -> g:1883") == [], "not subscribed yet: commands wait for its binding event"
    assert not subs.covers("p:1 -> g:1883", "devices/pump-1/commands/reboot")
    assert subs.filters("p:2 -> g:1883") == ["devices/pump-2/commands/#"]
    assert subs.delivery("p:2 -> g:1883", "devices/pump-2/commands/reboot") == "qos0", "the device acks it"


def test_a_session_found_while_its_gateway_cannot_list_subscriptions_counts_as_subscribed():
    feed, presence, found, metrics = _feed([_conn("pump-1", "p:1 -> g:1883")])
    feed.gateways.clients["local-us"].get = _refuse  # type: ignore[attr-defined]
    asyncio.run(feed.reconcile())
    assert presence.get("pump-1") is not None
    assert feed.subscriptions.filters("p:1 -> g:1883") is None, "unknown: taken as subscribed to all"


def _refuse(path: str) -> list[dict[str, str]]:
    raise AdminError(f"GET {path}: connection refused", retriable=True)


def _waiting_feed(listing: list[dict[str, str]]) -> tuple[PresenceFeed, PresenceTable, Waiting]:
    """A feed whose ended sessions go to the downlink's waiting room, as in the router."""
    presence, metrics, subs = PresenceTable(), Metrics(), Subscriptions()

    async def send(region: str, cmd: Command, payload: bytes, *, delivery: str = "") -> None:
        return None

    async def deadletter(reason: str, device: str, topic: str, payload: bytes) -> None:
        return None

    waiting = Waiting(
        ParkingLot(_table("parked"), ttl_s=60),
        DesiredState(_table("desired")),
        presence,
        subs,
        metrics,
        ack_timeout_s=30,
        send=send,
        deadletter=deadletter,
    )
    feed = PresenceFeed(
        presence,
        None,
        Gateways({"local-us": _Admin(listing)}, metrics),  # type: ignore[dict-item]
        subs,
        set(),
        asyncio.Lock(),
        metrics,
        deliver=_nothing,
        has_pending=lambda device: False,
        ended=waiting.session_ended,
        node_lost=waiting.node_lost,
    )
    return feed, presence, waiting


async def _sent_after_the_last_list() -> tuple[PresenceFeed, PresenceTable, Waiting, Command]:
    """A session of a node that then dies unseen: the region's list showed it, and a command
    was sent to it after that list."""
    old = Session("pump-1", "local-us", NODE, "p:1 -> a:1883", _ago(600))
    feed, presence, waiting = _waiting_feed([_conn("pump-1", "p:1 -> a:1883")])
    presence.connected(old)
    await feed.reconcile()  # the list shows the session: it was alive then
    cmd = Command("pump-1", "devices/pump-1/commands/set")
    await waiting.sent(old, cmd, b'{"n": 7}')  # on its way when the node dies
    return feed, presence, waiting, cmd


def _taken_in_and_parked_again(presence: PresenceTable, waiting: Waiting, cmd: Command) -> None:
    new = presence.get("pump-1")
    assert new is not None and new.connection == "p:9 -> b:1883", "the new session taken in"
    parked = waiting.parking.for_device("pump-1")
    assert [(p.topic, p.payload) for p in parked] == [(cmd.topic, b'{"n": 7}')], (
        "the command sent to the dead node's session waits for the device's next one"
    )


def test_commands_sent_to_a_session_whose_node_died_unseen_go_to_the_devices_next_session():
    """A node of a gateway cluster is SIGKILLed: its devices' sessions end with no close event,
    and they reconnect at another node of the region.  When the router's check of the region's
    connection list runs before the new session's event arrives, the old session is found gone
    by the list, not displaced by an event.  What was sent to it since the last list that showed
    it may have died with the node, and goes to the device's next session.  (Before, only an
    event's end did that: the HA profile's gateway-node-kill test lost 1 of 153 confirmed
    commands once.)"""

    async def scenario() -> None:
        feed, presence, waiting, cmd = await _sent_after_the_last_list()
        # the node is gone: the region's list shows the device at another node, no event yet
        feed.gateways.clients["local-us"].listing = [  # type: ignore[attr-defined]
            {**_conn("pump-1", "p:9 -> b:1883"), "node": "rabbit@gw-b"}
        ]
        await feed.reconcile()
        _taken_in_and_parked_again(presence, waiting, cmd)

    asyncio.run(scenario())


def test_a_session_gone_unseen_gives_back_only_what_was_sent_after_the_last_list_that_showed_it():
    async def scenario() -> None:
        old = Session("pump-1", "local-us", NODE, "p:1 -> g:1883", _ago(600))
        feed, presence, waiting = _waiting_feed([_conn("pump-1", "p:1 -> g:1883")])
        presence.connected(old)
        before = Command("pump-1", "devices/pump-1/commands/early")
        await waiting.sent(old, before, b"early")
        waiting._sent[old.connection][0] = (time.time() - 20, before, b"early")  # sent 20 s ago
        await feed.reconcile()  # alive now: what was sent 20 s ago had the time to arrive
        late = Command("pump-1", "devices/pump-1/commands/late")
        await waiting.sent(old, late, b"late")
        feed.gateways.clients["local-us"].listing = []  # type: ignore[attr-defined]
        await feed.reconcile()
        assert presence.get("pump-1") is None
        assert [p.payload for p in waiting.parking.for_device("pump-1")] == [b"late"]

    asyncio.run(scenario())


def test_commands_sent_to_a_session_its_device_left_for_another_node_unseen_go_to_the_new_one():
    """The other way a node's death shows: the device's connect at another node (an event)
    displaces its old session before any list runs.  A loaded run (r13) lost one command
    routed 0.56 s after the node died, the device back 2.2 s after it: only what was sent
    in the 1 s before the new connect went to it.  Now everything sent since the last list
    that showed the old session does, as when a list ends it."""

    async def scenario() -> None:
        feed, presence, waiting, cmd = await _sent_after_the_last_list()
        # the device connects at another node of the region 3 s later; no close ever came
        new_at = int(time.time() * 1000) + 3000
        event = created("pump-1", "local-us", "p:9 -> b:1883", new_at, node="rabbit@gw-b")
        await feed._apply(_Event("connection.created", event))  # type: ignore[arg-type]
        _taken_in_and_parked_again(presence, waiting, cmd)

    asyncio.run(scenario())


def test_a_young_session_gone_unseen_gives_back_what_was_sent_since_it_was_last_listed(monkeypatch):
    """A device connects and its node is killed before any list showed the session.  Lists that
    lack it keep it for LISTING_LAG_S (a list may lag a new connection), and the one that ends
    it must not take "the region's last list" as when it was alive: that list lacked it.  The
    HA profile lost a confirmed command so (routed 0.2 s after the kill, the session ended
    unseen ~9 s later, two lists after).  What was sent since its connect goes to its next
    session."""

    async def scenario() -> None:
        young = Session("pump-1", "local-us", NODE, "p:1 -> g:1883", _ago(8))
        feed, presence, waiting = _waiting_feed([])  # its node is dead: no list shows it
        presence.connected(young)
        cmd = Command("pump-1", "devices/pump-1/commands/set")
        await waiting.sent(young, cmd, b'{"n": 7}')
        waiting._sent[young.connection][0] = (time.time() - 5, cmd, b'{"n": 7}')  # 3 s after connect
        await feed.reconcile()
        assert presence.get("pump-1") is not None, "8 s old: younger than a list's lag, kept"
        monkeypatch.setattr(presence_feed, "LISTING_LAG_S", 4.0)  # the next list, seconds later
        await feed.reconcile()
        assert presence.get("pump-1") is None
        assert [p.payload for p in waiting.parking.for_device("pump-1")] == [b'{"n": 7}'], (
            "the command sent to the dead node's session waits for the device's next one"
        )

    asyncio.run(scenario())


def test_a_device_that_moved_within_its_cluster_unseen_gets_what_follows_again_after_the_settling():
    """RabbitMQ's surviving nodes delete a dead node's clean-session queues for seconds, and a
    moved device's new queue of the same name can go with them (rabbitmq-server #6271): what
    is sent to its new session in NODE_LOSS_SETTLE_S is kept in the parking lot (Kafka, so a
    router that takes over has it too) and goes to the device again once they are past.  A
    device that moved to another region (another cluster) is not at risk."""
    import types
    from unittest import mock

    import router.waiting
    from router.waiting import NODE_LOSS_SETTLE_S

    async def scenario() -> None:
        feed, presence, waiting, _ = await _sent_after_the_last_list()
        new_at = int(time.time() * 1000) + 1000
        event = created("pump-1", "local-us", "p:9 -> b:1883", new_at, node="rabbit@gw-b")
        await feed._apply(_Event("connection.created", event))  # type: ignore[arg-type]
        new = presence.get("pump-1")
        assert new is not None
        for p in waiting.parking.for_device("pump-1"):  # the old session's command, delivered
            await waiting.parking.remove(p)
        after = Command("pump-1", "devices/pump-1/commands/after")
        await waiting.sent(new, after, b"after")
        [kept] = waiting.parking.for_device("pump-1")
        assert (kept.payload, kept.sent_to) == (b"after", new.connection) and kept.settles_at, kept
        assert kept.expires_at == kept.settles_at + waiting.parking.ttl_s, (
            "parking's TTL counts from the settling's end: a TTL shorter than it (the tests' 25 s) "
            "dead-lettered such commands instead of sending them again"
        )
        waiting.subscriptions.opened(new.connection)
        waiting.subscriptions.add(new.connection, ["devices/pump-1/commands/#"], qos=1)
        await waiting.deliver(new, ["devices/pump-1/commands/#"])
        await waiting.sweep(time.time())
        assert waiting.parking.for_device("pump-1") == [kept], "not sent again before it settles"

        later = kept.settles_at + 1  # past the settling: sent again, once
        with mock.patch.object(router.waiting, "time", types.SimpleNamespace(time=lambda: later)):
            await waiting.sweep(later)
        assert waiting.parking.for_device("pump-1") == [], "sent again, and gone from the lot"
        assert NODE_LOSS_SETTLE_S - 2 <= kept.settles_at - time.time() <= NODE_LOSS_SETTLE_S

        # the same device moving to another region: its old cluster's queues cannot take its new one
        feed2, presence2, waiting2, _ = await _sent_after_the_last_list()
        away = created("pump-1", "local-eu", "p:9 -> e:1883", new_at, node="rabbit@gw-eu")
        await feed2._apply(_Event("connection.created", away))  # type: ignore[arg-type]
        moved = presence2.get("pump-1")
        assert moved is not None and moved.region == "local-eu"
        await waiting2.sent(moved, after, b"after")
        assert not [p for p in waiting2.parking.for_device("pump-1") if p.settles_at], (
            "no settling for a move to another region"
        )

    asyncio.run(scenario())
