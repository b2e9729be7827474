"""Presence checked against the gateways' connection lists (router/presence_feed.py `reconcile`):
what no event says -- a session the router ended while its gateway was frozen, a close lost with
a dead gateway -- the next list puts right, and a list never undoes a newer event."""

from __future__ import annotations

import asyncio
import time

from backend.rabbitmq_admin import AdminError
from router.gateways import Gateways
from router.metrics import Metrics
from router.presence import PresenceTable, Session
from router.presence_feed import LISTING_LAG_S, PresenceFeed
from router.subscriptions import Subscriptions

NODE = "fedgate-gw-local-us@localhost"


class _Admin:
    """A gateway's management API as the router's client sees it: a tracked connection list."""

    def __init__(self, connections: list[dict[str, str]] | None):
        self.listing = connections

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


def _feed(listing: list[dict[str, str]] | None) -> tuple[PresenceFeed, PresenceTable, list[Session], Metrics]:
    presence, metrics, found = PresenceTable(), Metrics(), []

    async def found_one(session: Session) -> None:
        found.append(session)

    feed = PresenceFeed(
        presence,
        None,
        Gateways({"local-us": _Admin(listing)}, metrics),  # type: ignore[dict-item]
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
