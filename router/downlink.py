"""Downstream routing: each command only to the gateway that holds the device.

Backend services publish device-bound messages to COMMANDS_EXCHANGE with the
device id and MQTT topic in headers (``fedgate send`` does the same).  The
router:

- sends it to the downlink exchange of the region whose gateway holds the
  device (presence), and to no other;
- parks it (Kafka, with a TTL) when the device is known but offline, and
  delivers parked messages in order once the device has reconnected --
  anywhere -- *and subscribed* to a matching topic (a message sent before
  the subscription exists would be dropped by the gateway);
- for a device never seen: broadcasts to every region or parks (setting);
- keeps a message marked retained as the device's desired state for that
  topic and replays it whenever the device subscribes, in any region;
- closes the older session when a device connects at a second gateway;
- routes again a command that came back from a region whose gateway did
  not take it (contract.DOWNLINK_RETURN_AFTER_MS): the gateway died, and
  the command follows its device or is parked until it reconnects.

Every step that moves a message is confirmed before the input is acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable
from typing import Any
from urllib.parse import quote

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractExchange, AbstractIncomingMessage, AbstractRobustChannel

from backend import contract as c
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from gateways.mqtt_plugin import (
    SUBSCRIPTION_QUEUE_PREFIX,
    client_id_of_queue,
    filter_of_binding_key,
)
from gateways.mqtt_plugin import text as _text
from router.kafka import AsyncProducer
from router.metrics import Metrics
from router.presence import PresenceTable, Session
from router.settings import RouterSettings
from router.stores import DesiredState, Parked, ParkingLot, PresenceStore

log = logging.getLogger(__name__)

#: How long the gateways' management API may take to list a new connection.
LISTING_LAG_S = 10.0
PRESENCE_KEYS = (*c.PRESENCE_EVENT_KEYS, "binding.created")
#: A returned command asks whether its gateway answers; the answer holds this long.
GATEWAY_CHECK_EVERY_S = 5.0
GATEWAY_CHECK_TIMEOUT_S = 3.0
#: How long a shutdown waits on one AMQP call: what is not cancelled or acked in that time
#: RabbitMQ redelivers once the connection closes.
SHUTDOWN_CALL_TIMEOUT_S = 2.0


class RegionMissing(Exception):
    """A region this router was told about has no downlink exchange (it was removed)."""


class BadCommand(ValueError):
    pass


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic filter matching ("+" one level, "#" the rest)."""
    f, t = topic_filter.split("/"), topic.split("/")
    for i, part in enumerate(f):
        if part == "#":
            return True
        if i >= len(t) or (part != "+" and part != t[i]):
            return False
    return len(f) == len(t)


class Downlink:
    def __init__(
        self,
        settings: RouterSettings,
        presence: PresenceTable,
        parking: ParkingLot,
        desired: DesiredState,
        producer: AsyncProducer,
        metrics: Metrics,
        presence_store: PresenceStore | None = None,
    ):
        self.settings = settings
        self.presence_store = presence_store
        self.presence = presence
        self.parking = parking
        self.desired = desired
        self.producer = producer
        self.metrics = metrics
        self.admins = {g.region: RabbitAdmin(g.management_url, g.user, g.password) for g in settings.gateways}
        #: devices seen connected since this router started or parked/desired state exists
        self.known: set[str] = set()
        #: desired-state topics already replayed to each live connection; dropped when it ends
        self._replayed: dict[str, set[str]] = {}
        #: subscription filters of the connections this router saw open, by connection: a
        #: command for such a device waits (parked) until a filter matches it.  MQTT drops a
        #: message for a topic nobody subscribes to, and a device subscribes only after its
        #: connect, which this router learns of first.  Sessions it did not see open (from
        #: the rebuild at start) are taken as subscribed.
        self._filters: dict[str, set[str]] = {}
        #: connections whose existing subscriptions (a persistent session's) were asked for
        self._filters_asked: set[str] = set()
        self._checks: set[asyncio.Task[None]] = set()
        self._exchanges: dict[str, AbstractExchange] = {}
        self._channel: AbstractRobustChannel | None = None
        self._consumers: list[tuple[aio_pika.abc.AbstractQueue, str]] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closers: set[asyncio.Task[None]] = set()
        #: region -> (monotonic time, whether its gateway answered then)
        self._answers: dict[str, tuple[float, bool]] = {}

    def set_gateways(self, settings: RouterSettings) -> None:
        """A region was added or removed: route, broadcast and rebuild with the new set."""
        self.settings = settings
        self.admins = {g.region: RabbitAdmin(g.management_url, g.user, g.password) for g in settings.gateways}
        regions = set(settings.regions)
        for s in self.presence.sessions():
            if s.region not in regions:  # its gateway is gone, and so is the session
                self.presence.closed(s.node, s.connection)
                if self.presence_store is not None:
                    task = asyncio.ensure_future(self.presence_store.delete(s.client_id))
                    self._closers.add(task)
                    task.add_done_callback(self._closers.discard)
        for region in list(self._exchanges):
            if region not in regions:
                del self._exchanges[region]

    # --- lifecycle -----------------------------------------------------------------

    async def start(self, channel: AbstractRobustChannel) -> None:
        self._channel = channel
        await channel.set_qos(prefetch_count=100)
        # Presence first, and rebuilt from the gateways before any command is routed.
        # Durable, per router: events that happen while this router restarts
        # wait for it and are applied on top of the rebuilt snapshot (the
        # management API lists a new connection only after its next
        # statistics round, ~5 s).  A router that never comes back leaves a
        # queue that expires after an hour; presence can always be rebuilt.
        presence_q = await channel.declare_queue(
            f"fedgate.router.presence.{self.settings.router_id}",
            durable=True,
            arguments={"x-expires": 3_600_000, "x-max-length": 1_000_000, "x-overflow": "drop-head"},
        )
        for key in PRESENCE_KEYS:
            await presence_q.bind(c.PRESENCE_EXCHANGE, routing_key=key)
        await self.rebuild_presence()
        self._consumers.append((presence_q, await presence_q.consume(self.on_presence_event)))
        commands = await channel.get_queue(c.COMMANDS_QUEUE, ensure=True)
        self._consumers.append((commands, await commands.consume(self.on_command)))
        self._sweeper = asyncio.create_task(self._sweep_expired())

    async def stop_intake(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for check in list(self._checks):
            check.cancel()
        for task in list(self._closers):
            task.cancel()
        # bounded: with the backend gone, a robust channel would wait for it to come back
        outcomes = await asyncio.gather(
            *(asyncio.wait_for(q.cancel(tag), SHUTDOWN_CALL_TIMEOUT_S) for q, tag in self._consumers),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, aio_pika.exceptions.AMQPError | TimeoutError):
                log.debug("cancel consumer: %r", outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
        self._consumers.clear()

    async def rebuild_presence(self) -> None:
        """Presence at start: the last saved table, corrected by the gateways' connection lists.

        Called after this router's presence queue is bound: connections made
        from now on arrive as events (kept in the durable queue).  The saved
        table (Kafka) holds what the previous run knew up to its stop; the
        gateways' lists add what it never saw and drop sessions that ended
        unseen.  The lists lag new connections by seconds, so a saved session
        younger than that is kept even when a list does not show it yet.
        """
        from router.presence import sessions_from_management

        loop = asyncio.get_running_loop()
        saved = self.presence_store.load() if self.presence_store else []
        self.presence.replace_all(saved)
        listed: dict[str, set[str]] = {}
        sessions: list[Session] = []
        for region, admin in self.admins.items():
            try:
                conns = await loop.run_in_executor(None, admin.connections)
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
        for s in self.presence.sessions():
            if s.region not in self.admins:  # saved by a run that still had this region
                self.presence.closed(s.node, s.connection)
                continue
            gone = s.region in listed and s.client_id not in listed[s.region]
            if gone and now_ms - s.connected_at > LISTING_LAG_S * 1000:
                self.presence.closed(s.node, s.connection)
        if self.presence_store is not None:
            current = {s.client_id: s for s in self.presence.sessions()}
            for s in saved:
                if current.get(s.client_id) != s:
                    await self.presence_store.delete(s.client_id)
            for s in current.values():
                await self.presence_store.save(s)
        self.known.update(s.client_id for s in self.presence.sessions())
        log.info(
            "presence rebuilt: %d devices %s (%d saved, %d listed by the gateways)",
            len(self.presence),
            dict(self.presence.per_region()),
            len(saved),
            len(sessions),
        )

    # --- sending -----------------------------------------------------------------------

    async def _exchange(self, region: str) -> AbstractExchange:
        if region not in self._exchanges:
            assert self._channel is not None
            # Passive (it must exist) and not robust: a robust channel re-declares
            # what it declared on every reconnect, and one region removed since
            # would then fail every reconnect (NOT_FOUND) and keep the router off
            # the backend for good.
            self._exchanges[region] = await self._channel.declare_exchange(
                c.downlink_exchange(region), passive=True, robust=False
            )
        return self._exchanges[region]

    async def _send(
        self,
        region: str,
        device: str,
        topic: str,
        payload: bytes,
        *,
        retain: bool = False,
        broadcast: bool = False,
    ) -> None:
        """Publish to a region's downlink and wait for the backend's confirm.

        Raises RegionMissing when the region's downlink exchange does not exist
        (a region removed while this router still knew it): retrying could
        never succeed, and requeueing would block the command queue.
        """
        if region not in self.settings.regions:
            raise RegionMissing(region)
        try:
            ex = await self._exchange(region)
        except aiormq.exceptions.ChannelNotFoundEntity as e:
            self._exchanges.pop(region, None)
            log.error("region %s: no downlink exchange on the backend (%s)", region, e)
            self.metrics.inc("fedgate_router_region_missing_total", region=region)
            raise RegionMissing(region) from e
        # Device and topic travel along (MQTT does not pass them on) so that a
        # command the region does not take can come back and be routed again.
        headers: dict[str, Any] = {c.DEVICE_HEADER: device, c.TOPIC_HEADER: topic}
        if retain:
            headers[c.RETAIN_HEADER] = True
        if broadcast:
            headers[c.BROADCAST_HEADER] = True
        await ex.publish(
            aio_pika.Message(payload, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers=headers),
            routing_key=c.mqtt_topic_to_routing_key(topic),
            mandatory=True,
        )

    async def _deadletter(self, reason: str, device: str, topic: str, payload: bytes) -> None:
        await self.producer.send(
            self.settings.deadletter_topic,
            payload,
            device or None,
            [
                (c.KAFKA_DEADLETTER_REASON_HEADER, reason.encode()),
                (c.KAFKA_DEVICE_HEADER, device.encode()),
                (c.KAFKA_MQTT_TOPIC_HEADER, topic.encode()),
            ],
        )

    # --- commands ----------------------------------------------------------------------

    async def on_command(self, message: AbstractIncomingMessage) -> None:
        # Acked only after the message is confirmed at its next hop (downlink
        # exchange, Kafka parking or dead-letter); an exception requeues it.
        async with message.process(requeue=True), self._lock:
            headers = dict(message.headers or {})
            device = _text(headers.get(c.DEVICE_HEADER, ""))
            topic = _text(headers.get(c.TOPIC_HEADER, ""))
            retain = bool(headers.get(c.RETAIN_HEADER, False))
            try:
                self._validate(device, topic)
            except BadCommand as e:
                log.warning("dead-lettering a command: %s", e)
                await self._deadletter(str(e), device, topic, message.body)
                self.metrics.inc("fedgate_router_deadlettered_total", topic=self.settings.deadletter_topic)
                return
            returned_from = c.region_of_returned(headers)
            if returned_from is not None:
                await self.route_returned(
                    returned_from,
                    device,
                    topic,
                    message.body,
                    retain=retain,
                    broadcast=bool(headers.get(c.BROADCAST_HEADER, False)),
                )
            else:
                await self.route(device, topic, message.body, retain=retain)

    @staticmethod
    def _validate(device: str, topic: str) -> None:
        if not device:
            raise BadCommand(f"command without the {c.DEVICE_HEADER} header")
        if not topic:
            raise BadCommand(f"command without the {c.TOPIC_HEADER} header")
        if any(ch in topic for ch in "+#") or "\x00" in topic:
            raise BadCommand(f"topic {topic!r} is a filter, not a topic")

    async def route(self, device: str, topic: str, payload: bytes, *, retain: bool = False) -> str:
        """Send, park or broadcast one command; returns what was done."""
        if retain:
            await self.desired.set(device, topic, payload)
            self.known.add(device)
        session = self.presence.get(device)
        if session is not None and not retain and not self._subscribed(session, topic):
            # held until the device subscribes: parked, and sent by _on_binding (or by the
            # check of a persistent session's subscriptions); never subscribing, it expires
            # into the dead-letter topic with the reason, instead of being dropped unseen
            await self.parking.park(device, topic, payload)
            self.metrics.inc("fedgate_router_held_total", region=session.region)
            self._ask_filters_soon(session)
            return f"held:{session.region}"
        if session is not None:
            try:
                await self._send(session.region, device, topic, payload, retain=retain)
            except RegionMissing:
                session = None  # its region is gone: as if the device were offline
            else:
                if retain:
                    self._replayed.setdefault(session.connection, set()).add(topic)
                self.metrics.inc("fedgate_router_routed_total", region=session.region)
                return f"routed:{session.region}"
        if retain:
            # desired state is replayed when the device connects: parking it too would deliver twice
            return "desired"
        if device in self.known or self.settings.unknown_device == "park":
            await self.parking.park(device, topic, payload)
            self.metrics.inc("fedgate_router_parked_total")
            return "parked"
        for region in self.settings.regions:
            with contextlib.suppress(RegionMissing):  # logged and counted; the others still get it
                await self._send(region, device, topic, payload, broadcast=True)
        self.metrics.inc("fedgate_router_broadcast_total")
        return "broadcast"

    async def route_returned(
        self, region: str, device: str, topic: str, payload: bytes, *, retain: bool, broadcast: bool
    ) -> str:
        """A command `region`'s gateway did not take in time: route it again; returns what was done.

        If presence still has the device there and the gateway does not
        answer either, the session died with the gateway (a killed gateway
        reports no disconnect): it is closed, so the command is parked and
        follows the device wherever it reconnects.  A gateway that answers is
        only slow: the command goes back to it.
        """
        self.metrics.inc("fedgate_router_returned_total", region=region)
        session = self.presence.get(device)
        if session is not None and session.region == region and not await self._gateway_answers(region):
            log.warning(
                "a command for %s came back from %s, whose gateway does not answer: "
                "the session ended with it, the command waits for the device",
                device,
                region,
            )
            self.presence.closed(session.node, session.connection)
            self._forget_connection(session.connection)
            if self.presence_store is not None:
                await self.presence_store.delete(device)
            session = None
        if broadcast and session is None:
            # the other regions had their copies; a device nobody has seen gets no second round
            await self._deadletter(
                f"broadcast copy not taken by region {region} within "
                f"{c.DOWNLINK_RETURN_AFTER_MS // 1000}s (its gateway is down)",
                device,
                topic,
                payload,
            )
            self.metrics.inc("fedgate_router_deadlettered_total", topic=self.settings.deadletter_topic)
            return "deadlettered"
        if retain:
            if session is not None and session.region == region:
                await self._send(region, device, topic, payload, retain=True)
                return f"routed:{region}"
            # desired state is kept, and replayed on the device's next subscription anywhere
            return "desired"
        return await self.route(device, topic, payload)

    async def _gateway_answers(self, region: str) -> bool:
        """Whether the region's management API answers, asked at most every few seconds:
        a dead gateway sends back every command it was sent, and each would
        otherwise wait out the timeout while routing holds the lock."""
        now = time.monotonic()
        cached = self._answers.get(region)
        if cached is not None and now - cached[0] < GATEWAY_CHECK_EVERY_S:
            return cached[1]
        admin = self.admins.get(region)
        answers = False
        if admin is not None:
            # a short timeout and no retries: a gateway that does not answer at once counts as down
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None,
                    functools.partial(
                        admin.request_with_headers, "GET", "overview", {}, timeout=GATEWAY_CHECK_TIMEOUT_S
                    ),
                )
                answers = True
            except AdminError:
                pass
        self._answers[region] = (now, answers)
        return answers

    # --- presence events ------------------------------------------------------------------

    async def on_presence_event(self, message: AbstractIncomingMessage) -> None:
        async with message.process(requeue=True):
            written = await self._apply_presence_event(message)
            if written is not None:
                # The event is acked only once Kafka has the change (a restarted router
                # rebuilds from it), but that wait is outside the lock: the next events and
                # the commands go on meanwhile.  A reconnect wave of thousands of devices
                # used to hold every command behind one Kafka round trip per connect.
                await written

    async def _apply_presence_event(self, message: AbstractIncomingMessage) -> Awaitable[None] | None:
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
            written = self._write_presence(key, change)
            for ended in (change.session if key == "connection.closed" else None, change.displaced):
                if ended is not None:
                    self._forget_connection(ended.connection)
            if change.displaced is not None:
                await self._close_session(change.displaced)
            if key == "connection.created" and change.session is not None and not change.ignored:
                device = change.session.client_id
                self.known.add(device)
                self._filters[change.session.connection] = set()
                # A persistent session may already have its subscriptions; asking the
                # gateway costs a management call under the lock, so only when there
                # is something to deliver (a reconnect wave would otherwise queue
                # every command behind thousands of calls).
                if self.parking.for_device(device) or self.desired.for_device(device):
                    await self._use_filters(change.session, await self._existing_filters(change.session))
            return written

    def _write_presence(self, key: str, change: Any) -> Awaitable[None] | None:
        """Produce a presence change to Kafka now; the event is acked after it is confirmed."""
        if self.presence_store is None or change.session is None or change.ignored:
            return None
        if key == "connection.created":
            return self.presence_store.save_soon(change.session)
        if key == "connection.closed":
            return self.presence_store.delete_soon(change.session.client_id)
        return None

    async def _on_binding(self, headers: dict[str, Any]) -> None:
        if _text(headers.get("source_name", "")) != c.MQTT_EXCHANGE:
            return
        cid = client_id_of_queue(_text(headers.get("destination_name", "")))
        if cid is None:
            return
        session = self.presence.get(cid)
        region = c.region_from_headers(headers)
        if session is None or session.region != region:
            return
        topic_filter = filter_of_binding_key(_text(headers.get("routing_key", "")))
        if session.connection in self._filters:
            self._filters[session.connection].add(topic_filter)
        await self._deliver_pending(session, [topic_filter])

    async def _existing_filters(self, session: Session) -> list[str] | None:
        """The subscriptions a persistent session kept on its gateway across connections;
        None when the gateway could not be asked."""
        admin = self.admins.get(session.region)
        if admin is None:
            return None
        loop = asyncio.get_running_loop()
        filters = []
        for qos in (0, 1):
            queue = f"{SUBSCRIPTION_QUEUE_PREFIX}{session.client_id}qos{qos}"
            try:
                info = await loop.run_in_executor(None, admin.get, f"queues/%2F/{queue}")
                if info.get("auto_delete"):
                    # a clean session's queue: it may still be the previous connection's, on its
                    # way out; this connection's own subscriptions arrive as binding events
                    continue
                bindings = await loop.run_in_executor(None, admin.get, f"queues/%2F/{queue}/bindings")
            except AdminError as e:
                if e.status == 404:
                    continue  # no such queue: a clean session subscribes after connecting
                log.warning("subscriptions of %s on %s: %s", session.client_id, session.region, e)
                return None
            filters += [filter_of_binding_key(b["routing_key"]) for b in bindings if b.get("source")]
        return filters

    def _subscribed(self, session: Session, topic: str) -> bool:
        """Whether a command on `topic` reaches the device now (see _filters)."""
        filters = self._filters.get(session.connection)
        return filters is None or any(topic_matches(f, topic) for f in filters)

    def _ask_filters_soon(self, session: Session) -> None:
        """Once per connection, ask its gateway for subscriptions the router has not seen
        being made (a persistent session's), off the lock, and deliver what they match."""
        if session.connection in self._filters_asked:
            return
        self._filters_asked.add(session.connection)

        async def ask() -> None:
            filters = await self._existing_filters(session)
            async with self._lock:
                if self.presence.get(session.client_id) != session:
                    return  # the session ended meanwhile; its commands stay parked
                if not await self._use_filters(session, filters):
                    # the held commands go out as they did before subscriptions were tracked
                    await self._deliver_pending(session, ["#"])

        task = asyncio.create_task(ask())
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)
        task.add_done_callback(_log_check_error)

    async def _use_filters(self, session: Session, filters: list[str] | None) -> bool:
        """Take what the gateway said about a session's subscriptions and deliver what they
        match; False when it could not say (the session then counts as subscribed)."""
        self._filters_asked.add(session.connection)
        if filters is None:
            self._filters.pop(session.connection, None)
            return False
        if session.connection in self._filters:
            self._filters[session.connection].update(filters)
        await self._deliver_pending(session, filters)
        return True

    def _forget_connection(self, connection: str) -> None:
        self._replayed.pop(connection, None)
        self._filters.pop(connection, None)
        self._filters_asked.discard(connection)

    async def _deliver_pending(self, session: Session, filters: list[str]) -> None:
        if not filters:
            return
        device = session.client_id
        now = time.time()
        parked: list[Parked] = [
            p for p in self.parking.for_device(device) if any(topic_matches(f, p.topic) for f in filters)
        ]
        for p in parked:  # sorted by parking order
            if p.expires_at < now:
                await self._expire(p)
                continue
            await self._send(session.region, device, p.topic, p.payload)
            await self.parking.remove(p)
            self.metrics.inc("fedgate_router_unparked_total", region=session.region)
        for topic, payload in self.desired.for_device(device):
            if topic in self._replayed.get(session.connection, ()):
                continue
            if any(topic_matches(f, topic) for f in filters):
                await self._send(session.region, device, topic, payload, retain=True)
                self._replayed.setdefault(session.connection, set()).add(topic)
                self.metrics.inc("fedgate_router_desired_replayed_total", region=session.region)

    async def _expire(self, p: Parked) -> None:
        await self._deadletter(
            f"parked for {self.parking.ttl_s:g}s without the device coming back", p.device, p.topic, p.payload
        )
        await self.parking.remove(p)
        self.metrics.inc("fedgate_router_expired_total")

    async def _sweep_expired(self) -> None:
        while True:
            await asyncio.sleep(5)
            try:
                async with self._lock:
                    now = time.time()
                    for device in self.parking.all_devices():
                        for p in self.parking.for_device(device):
                            if p.expires_at < now:
                                await self._expire(p)
            except Exception as e:  # keep sweeping; the next round retries
                log.error("expiring parked messages failed: %s", e)

    async def _close_session(self, s: Session) -> None:
        """One live session per client id: close the older connection at its gateway.

        Runs in the background: the gateway's management API learns of a new
        connection only with its next statistics round (~5 s), so the close is
        retried until the connection is known there or has gone by itself.
        """
        task = asyncio.create_task(self._close_when_known(s))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _close_when_known(self, s: Session, patience_s: float = 30.0) -> None:
        admin = self.admins.get(s.region)
        if admin is None:
            return
        loop = asyncio.get_running_loop()
        path = f"connections/{quote(s.connection, safe='')}"
        deadline = time.monotonic() + patience_s
        while True:
            if self.presence.get(s.client_id) == s:
                return  # it became the current session again (a newer connect was undone)
            try:
                await loop.run_in_executor(None, admin.request, "DELETE", path)
            except AdminError as e:
                if e.status == 404 and time.monotonic() < deadline:
                    await asyncio.sleep(1.0)
                    continue
                if e.status != 404:
                    log.error("could not close the older session of %s at %s: %s", s.client_id, s.region, e)
                return
            self.metrics.inc("fedgate_router_sessions_closed_total", region=s.region)
            log.info("closed the older session of %s at %s (%s)", s.client_id, s.region, s.connection)
            return


def _log_check_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("checking a session's subscriptions failed: %r", task.exception())
