"""Gateway nodes that stop (router/node_watch.py): their sessions end within a check, and what
was sent to them since the node was last seen running waits for the devices' next sessions --
in Kafka, not in the router's memory, which a router dying next would take with it."""

from __future__ import annotations

import asyncio
import time

from backend.rabbitmq_admin import AdminError
from router.node_watch import NodeWatch
from router.presence import Session
from router.routing import Command
from tests.unit.router.test_presence_reconcile import NODE, _ago, _waiting_feed

OTHER = "fedgate-gw-local-us-n2@localhost"


class _Cluster:
    """A gateway cluster's /api/nodes as the router's client sees it."""

    def __init__(self) -> None:
        self.running = {NODE: True, OTHER: True}
        self.answers = True
        self.status: int | None = None

    def get(self, path: str) -> list[dict[str, object]]:
        assert path == "nodes?columns=name,running", path
        if not self.answers:
            raise AdminError(f"GET {path}: connection refused", retriable=True, status=self.status)
        return [{"name": n, "running": r} for n, r in self.running.items()]


def _world():
    feed, presence, waiting = _waiting_feed([])
    cluster = _Cluster()
    feed.gateways.clients["local-us"] = cluster  # type: ignore[assignment]
    watch = NodeWatch(feed, feed._lock, waiting.node_lost)
    on_it = Session("pump-1", "local-us", NODE, "p:1 -> a:1883", _ago(600))
    elsewhere = Session("pump-2", "local-us", OTHER, "p:2 -> b:1883", _ago(600))
    for s in (on_it, elsewhere):
        presence.connected(s)
        feed.subscriptions.opened(s.connection)
    return feed, presence, waiting, cluster, watch, on_it, elsewhere


def test_the_sessions_of_a_node_that_stopped_end_and_what_was_sent_to_them_since_waits_in_kafka():
    async def scenario() -> None:
        _, presence, waiting, cluster, watch, on_it, elsewhere = _world()
        assert await watch.check() == 0, "every node runs: nothing ends"
        seen_running = time.time()
        early = Command("pump-1", "devices/pump-1/commands/early")
        await waiting.sent(on_it, early, b"early")
        waiting._sent[on_it.connection][0] = (seen_running - 20, early, b"early")  # long before
        late = Command("pump-1", "devices/pump-1/commands/late")
        await waiting.sent(on_it, late, b"late")  # after the node was last seen running
        await waiting.sent(elsewhere, Command("pump-2", "devices/pump-2/commands/x"), b"x")

        cluster.running[NODE] = False  # SIGKILLed: no close event, no list yet
        assert await watch.check() == 1
        assert presence.get("pump-1") is None, "its session ended at once"
        assert presence.get("pump-2") == elsewhere, "another node's session is left alone"
        parked = waiting.parking.for_device("pump-1")
        assert [p.payload for p in parked] == [b"late"], (
            "what was sent since the node last ran waits for the device's next session; "
            "what it had the time to deliver does not"
        )
        assert waiting.parking.for_device("pump-2") == []
        assert "local-us" in waiting._node_lost, "the region's new sessions settle"

        assert await watch.check() == 0, "ended once"
        cluster.running[NODE] = True  # started again: the events and the lists take it from here
        assert await watch.check() == 0

    asyncio.run(scenario())


def test_a_cluster_that_does_not_answer_or_refuses_ends_nothing():
    async def scenario() -> None:
        feed, presence, _, cluster, watch, on_it, _ = _world()
        cluster.answers = False
        cluster.running[NODE] = False
        assert await watch.check() == 0 and presence.get("pump-1") == on_it
        cluster.status = 401  # the router's user may not list nodes: asked no more, said once
        assert await watch.check() == 0
        assert not feed.gateways.allows("local-us", "nodes")
        cluster.answers = True
        assert await watch.check() == 0 and presence.get("pump-1") == on_it

    asyncio.run(scenario())


def test_a_gateway_of_one_node_is_asked_once_a_minute_not_every_two_seconds():
    async def scenario() -> None:
        _, _, _, cluster, watch, _, _ = _world()
        del cluster.running[OTHER]
        asked = []
        real_get = cluster.get
        cluster.get = lambda path: asked.append(path) or real_get(path)  # type: ignore[method-assign]
        for _ in range(3):
            await watch.check()
        assert len(asked) == 1, "a one-node gateway's death is its region's: the gateway checks see it"

    asyncio.run(scenario())
