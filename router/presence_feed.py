"""Keeping presence current: the rebuild at start and the gateways' events after it.

The router's presence table (router/presence.py) is fed from two places:

- at start, `rebuild`: the table saved in Kafka by the previous run, corrected by each
  gateway's connection list;
- then the gateways' `connection.created` / `connection.closed` / `binding.created` events,
  federated to the backend's presence exchange and read from this router's own durable queue
  (bound before the rebuild, so nothing that happens meanwhile is missed);
- and every `presence_reconcile_s`, `reconcile`: each answering gateway's connection list
  against the table.  Events cannot say everything: a session the router ended because its
  gateway stopped answering (a frozen or partitioned node, router/routing.py) comes back to
  life with no event when the gateway does, and a close event lost with a gateway that died
  leaves a session that is no longer there.

What an event means for commands waiting on a device (a connect with something parked, a subscription
that matches a held command) is the downlink's: it hands in `deliver` (send what matches these filters
now) and `has_pending` (anything parked or desired?); each change runs under the downlink's lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from backend import contract as c
from backend.rabbitmq_admin import AdminError
from gateways import mqtt_plugin
from router.gateways import Gateways
from router.metrics import Metrics
from router.presence import Change, PresenceTable, Session, sessions_from_management
from router.stores import PresenceStore, all_confirmed, confirm_later, confirmed_later
from router.subscriptions import Subscriptions
from router.tasks import every, watch

log = logging.getLogger(__name__)

#: How long the gateways' management API may take to list a new connection.
LISTING_LAG_S = 10.0
#: How long a presence event waits for Kafka to confirm its change before it is acked anyway.
PRESENCE_CONFIRM_WAIT_S = 5.0
PRESENCE_KEYS = (*c.PRESENCE_EVENT_KEYS, "binding.created")

Deliver = Callable[[Session, list[str]], Awaitable[None]]
#: a session ended at (epoch s, the gateway's clock)
Ended = Callable[[Session, float], Awaitable[None]]
#: a live session the events had not given (the downlink delivers what waits for it)
Found = Callable[[Session], Awaitable[None]]
#: How long a close applied from an event is remembered (a list made before it must not bring
#: the session back), and a list that showed a connection.
CLOSES_REMEMBERED_S = 120.0
#: How often the connection lists are asked while a region's gateway is suspect.
SUSPECT_RECHECK_S = 2.0


class PresenceFeed:
    def __init__(
        self,
        presence: PresenceTable,
        store: PresenceStore | None,
        gateways: Gateways,
        subscriptions: Subscriptions,
        known: set[str],
        lock: asyncio.Lock,
        metrics: Metrics,
        *,
        deliver: Deliver,
        has_pending: Callable[[str], bool],
        ended: Ended | None = None,
        found: Found | None = None,
        node_lost: Callable[[str, float], None] | None = None,
    ):
        self.presence = presence
        self.store = store
        self.gateways = gateways
        self.subscriptions = subscriptions
        #: devices seen connected since this router started, or with parked/desired state
        self.known = known
        self._lock = lock
        self.metrics = metrics
        self._deliver = deliver
        self._has_pending = has_pending
        self._ended = ended
        self._found = found
        self._node_lost = node_lost  # (region, last alive) of a session that ended unseen
        #: (node, connection) -> when a close event for it was applied (time.time())
        self._closed_at: dict[tuple[str, str], float] = {}
        #: (node, connection) -> when the last list that showed it was asked: a session that
        #: ends unseen ended after that (or after its connect, if no list ever showed it)
        self._seen_at: dict[tuple[str, str], float] = {}

    # --- at start -----------------------------------------------------------------------

    async def rebuild(self) -> None:
        """Presence at start: the last saved table, corrected by the gateways' connection lists.

        Called after this router's presence queue is bound: connections made
        from now on arrive as events (kept in the durable queue).  The saved
        table (Kafka) holds what the previous run knew up to its stop; the
        gateways' lists add what it never saw and drop sessions that ended
        unseen.  A list made from the management plugin's statistics (3.10
        gateways) lags new connections by seconds, so a saved session younger
        than that is kept even when a list does not show it yet; 4.0 gateways
        list from connection tracking, current at once.
        """
        saved = self.store.load() if self.store else []
        self.presence.replace_all(saved)
        listed: dict[str, set[str]] = {}
        sessions: list[Session] = []
        for region in self.gateways.regions:
            try:
                conns = await self.gateways.connections(region)
            except AdminError as e:
                log.error(
                    "presence rebuild: gateway %s unreachable (%s); its devices are unknown until they "
                    "reconnect",
                    region,
                    e,
                )
                continue
            region_sessions = sessions_from_management(region, conns)
            sessions += region_sessions
            listed[region] = {s.client_id for s in region_sessions}
        for s in sessions:
            self.presence.connected(s)
        now_ms = time.time() * 1000
        regions = set(self.gateways.regions)
        for s in self.presence.sessions():
            if s.region not in regions:  # saved by a run that still had this region
                self.presence.closed(s.node, s.connection)
                continue
            gone = s.region in listed and s.client_id not in listed[s.region]
            if gone and now_ms - s.connected_at > LISTING_LAG_S * 1000:
                self.presence.closed(s.node, s.connection)
        if self.store is not None:
            current = {s.client_id: s for s in self.presence.sessions()}
            for s in saved:
                if current.get(s.client_id) != s:
                    await self.store.offline(s.client_id)
            for s in current.values():
                await self.store.save(s)
        self.known.update(s.client_id for s in self.presence.sessions())
        if self.store is not None:
            # devices offline now were seen before: their commands are parked, not broadcast
            self.known.update(self.store.seen())
        log.info(
            "presence rebuilt: %d devices %s (%d saved, %d listed by the gateways)",
            len(self.presence),
            dict(self.presence.per_region()),
            len(saved),
            len(sessions),
        )

    # --- reconciling with the gateways' lists ----------------------------------------------

    async def reconcile_every(self, seconds: float) -> None:
        """Every `seconds`; every SUSPECT_RECHECK_S while a region is suspect (its gateway
        went silent), so that a healed partition gets what waited at once."""
        last = time.monotonic()

        async def due() -> None:
            nonlocal last
            if not self.gateways.suspect and time.monotonic() - last < seconds:
                return
            last = time.monotonic()
            await self.reconcile()  # Kafka refused a write, say: the next round tries again

        await every(min(seconds, SUSPECT_RECHECK_S), due, "presence reconcile failed", logger=log)

    async def reconcile(self) -> None:
        """One round: each answering gateway's connection list against the table.

        A listed session the table lacks is taken in (unless a close event for
        it came after the list was asked); a session of the region that the
        list lacks is ended once it is older than LISTING_LAG_S (the gateway's
        list and its events run on their own clocks and paths).  A gateway
        that does not answer is left as it is: routing already treats it.
        """
        for region in list(self.gateways.regions):
            asked_at = time.time()
            try:
                conns = await self.gateways.connections(region)
            except AdminError as e:
                log.debug("presence reconcile: %s does not answer (%s)", region, e)
                continue
            listed = sessions_from_management(region, conns, int(asked_at * 1000))
            # every connection, a device's or not: an operator's MQTT tool logged in as
            # fedgate-admin is listed without its client id, and is alive all the same
            alive = {(str(conn.get("node") or ""), str(conn.get("name") or "")) for conn in conns}
            # Sessions the table lacks get what their gateway binds for them (see below):
            # asked here, off the lock, and only when the list has such a session.
            subscribed = None
            if any(self.presence.get(s.client_id) is None for s in listed):
                subscribed = await self.gateways.subscribed(region)
            async with confirm_later() as pending, self._lock:
                if region in self.gateways.regions:
                    await self._reconcile_region(region, listed, alive, asked_at, subscribed)
            if pending:
                await _wait_bounded(all_confirmed(pending), self.metrics)
        horizon = time.time() - CLOSES_REMEMBERED_S
        self._closed_at = {k: at for k, at in self._closed_at.items() if at > horizon}
        self._seen_at = {k: at for k, at in self._seen_at.items() if at > horizon}

    async def _reconcile_region(
        self,
        region: str,
        listed: list[Session],
        alive: set[tuple[str, str]],
        asked_at: float,
        subscribed: dict[str, dict[str, int]] | None,
    ) -> None:
        old = (asked_at - LISTING_LAG_S) * 1000
        self._seen_at.update(dict.fromkeys(alive, asked_at))
        for s in self.presence.sessions():
            if s.region != region or s.connected_at > old or (s.node, s.connection) in alive:
                continue
            log.warning(
                "presence reconcile: %s's session at %s is gone; no event said so", s.client_id, region
            )
            # Ended unseen (its node died), maybe with commands: when is known only as "after the
            # last list that showed *it*" -- not the region's last list, which may have lacked it
            # while it was young (a command routed 0.2 s after its node was killed was lost so)
            await self._end_unseen(s, self._last_alive(s))
            if self.store is not None:
                await confirmed_later(self.store.offline_soon(s.client_id))
            self.metrics.inc("fedgate_router_presence_reconciled_total", change="ended")
        for s in listed:
            if self.presence.get(s.client_id) is not None:
                continue  # the table's session, wherever it is, came from an event or is newer
            if self._closed_at.get((s.node, s.connection), 0.0) >= asked_at - 1.0:
                continue  # closed after the list was made
            log.warning("presence reconcile: %s is connected at %s; no event said so", s.client_id, region)
            self.presence.connected(s)
            self.known.add(s.client_id)
            if subscribed is not None:
                # What it subscribes to now, and nothing more: a device whose events lag
                # behind (a connect wave) has often not subscribed yet, and a command sent
                # to it now would be dropped by MQTT unseen.  Held instead, it goes out with
                # the binding event that follows.  (A gateway that cannot say, or a session
                # gone from the table after the bindings were asked: subscribed to everything.)
                self.subscriptions.opened(s.connection)
                for topic_filter, qos in subscribed.get(s.client_id, {}).items():
                    self.subscriptions.add(s.connection, [topic_filter], qos)
            if self.store is not None:
                await confirmed_later(self.store.save_soon(s))
            self.metrics.inc("fedgate_router_presence_reconciled_total", change="found")
            if self._found is not None:
                await self._found(s)

    def drop_regions_except(self, regions: set[str]) -> None:
        """Regions were removed: their gateways are gone, and so are their sessions."""
        for s in self.presence.sessions():
            if s.region not in regions:
                self._forget(s)
                if self.store is not None:
                    self.gateways.in_background(self.store.offline(s.client_id))

    async def end(self, s: Session, alive_at: float | None = None) -> None:
        """A session that ended unseen (its gateway, or its node, died; `alive_at`: when it was
        last known alive, epoch s): forgotten, what was sent to it since sent to its next
        session, and saved before returning.  The caller holds the lock."""
        await self._end_unseen(s, max(self._last_alive(s), alive_at or 0.0))
        if self.store is not None:
            await self.store.offline(s.client_id)

    def _last_alive(self, s: Session) -> float:
        return max(self._seen_at.get((s.node, s.connection), 0.0), s.connected_at / 1000)

    async def _end_unseen(self, s: Session, ended_at: float) -> None:
        self._forget(s)
        if self._node_lost is not None:
            self._node_lost(s.region, ended_at)
        if self._ended is not None:
            await self._ended(s, ended_at)

    def _forget(self, s: Session) -> None:
        self._seen_at.pop((s.node, s.connection), None)
        self.presence.closed(s.node, s.connection)
        self.subscriptions.forget(s.connection)

    # --- events ---------------------------------------------------------------------------

    async def on_event(self, message: AbstractIncomingMessage) -> None:
        async with message.process(requeue=True):
            # what ending a session parks again (router/waiting.py) is confirmed with the event
            async with confirm_later() as pending:
                write = await self._apply(message)
            if write is not None:
                pending.append(write)
            written = all_confirmed(pending) if pending else None
            if written is not None:
                # The event is acked once Kafka has the change (a restarted router starts from
                # it), but that wait is outside the lock: the next events and the commands go on
                # meanwhile (a reconnect wave of thousands used to hold every command behind one
                # Kafka round trip per connect).  And it is bounded: with Kafka away, the write
                # stays queued in the producer and the event is acked all the same; what a
                # restart could then miss, its rebuild from the gateways' listings gives back.
                await _wait_bounded(written, self.metrics)

    async def _apply(self, message: AbstractIncomingMessage) -> Awaitable[None] | None:
        """Apply one event under the lock; returns its write to Kafka, already produced (so
        the writes keep the events' order), for the caller to await."""
        async with self._lock:
            key = message.routing_key or ""
            headers = dict(message.headers or {})
            if key == "binding.created":
                await self._on_binding(headers)
                return None
            change = self.presence.apply_event(key, headers)
            if change.refused:
                log.warning("presence: %s (region %s)", change.ignored, c.region_from_headers(headers))
                self.metrics.inc("fedgate_router_presence_refused_total")
            elif change.malformed:
                log.warning("presence: %s: %s; acked and dropped", key, change.ignored)
                self.metrics.inc("fedgate_router_presence_malformed_total")
            written = self._write(key, change)
            closed_at = _event_time(headers)
            if key == "connection.closed" and not change.malformed:
                node, name = (mqtt_plugin.text(headers.get(k, "")) for k in ("node", "name"))
                self._closed_at[(node, name)] = time.time()
            for ended in (change.session if key == "connection.closed" else None, change.displaced):
                if ended is not None:
                    self.subscriptions.forget(ended.connection)
                    if self._ended is not None and not change.ignored:
                        # a displaced session (another node's, no close seen) may have died with
                        # its node, before the router knew: what was sent since the last list
                        # that showed it goes to the new session, as when a list ends it
                        at = closed_at if ended is change.session else self._last_alive(ended)
                        moved = change.session if ended is change.displaced else None
                        if moved and moved.region == ended.region and self._node_lost:
                            self._node_lost(ended.region, at)  # moved within its cluster (#6271)
                        await self._ended(ended, at)
            if change.displaced is not None:
                self.gateways.close_soon(change.displaced, self.presence)
            if key == "connection.created" and change.session is not None and not change.ignored:
                device = change.session.client_id
                self.known.add(device)
                self.subscriptions.opened(change.session.connection)
                # A persistent session may already have its subscriptions; asking the
                # gateway costs a management call under the lock, so only when there
                # is something to deliver (a reconnect wave would otherwise queue
                # every command behind thousands of calls).
                if self._has_pending(device):
                    await self.use_filters(change.session, await self.gateways.kept_filters(change.session))
            return written

    def _write(self, key: str, change: Change) -> Awaitable[None] | None:
        """Produce a presence change to Kafka now; the event is acked after it is confirmed."""
        if self.store is None or change.session is None or change.ignored:
            return None
        if key == "connection.created":
            return self.store.save_soon(change.session)
        if key == "connection.closed":
            return self.store.offline_soon(change.session.client_id)
        return None

    async def _on_binding(self, headers: dict[str, Any]) -> None:
        made = mqtt_plugin.subscription_from_event(headers)
        if made is None:
            return
        session = self.presence.get(made.client_id)
        if session is None or session.region != made.region:
            return
        self.subscriptions.add(session.connection, [made.topic_filter], made.qos)
        await self._deliver(session, [made.topic_filter])

    async def use_filters(self, session: Session, filters: list[str] | None) -> bool:
        """Take what the gateway said about a session's subscriptions and deliver what they
        match; False when it could not say (the session then counts as subscribed)."""
        self.subscriptions.mark_asked(session.connection)
        if filters is None:
            self.subscriptions.unknown(session.connection)
            return False
        self.subscriptions.add(session.connection, filters)
        await self._deliver(session, filters)
        return True


async def _wait_bounded(written: Awaitable[None], metrics: Metrics) -> None:
    """Wait for Kafka to confirm presence writes, PRESENCE_CONFIRM_WAIT_S at most: the write
    stays queued in the producer and is sent once Kafka is back."""
    confirming = asyncio.ensure_future(written)
    try:
        await asyncio.wait_for(asyncio.shield(confirming), PRESENCE_CONFIRM_WAIT_S)
    except TimeoutError:
        metrics.inc("fedgate_router_presence_unconfirmed_total")
        watch(confirming, "a presence change acked unconfirmed was refused by Kafka: %r", logger=log)


def _event_time(headers: dict[str, Any]) -> float:
    """When the gateway says the event happened (epoch s), or now."""
    try:
        return int(headers["timestamp_in_ms"]) / 1000
    except (KeyError, TypeError, ValueError):
        return time.time()
