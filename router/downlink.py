"""Downstream routing: each command only to the gateway that holds the device.

Backend services publish device-bound messages to COMMANDS_EXCHANGE with the device id and
MQTT topic in headers (``fedgate send`` does the same).  For each one the downlink asks
router/routing.py what to do -- send to the device's region only, hold or park it,
broadcast, keep it as desired state, dead-letter it -- and does it:

- parked messages (Kafka, with a TTL) are delivered in order once the device has reconnected
  -- anywhere -- *and subscribed* to a matching topic;
- desired state (a retained command) is replayed whenever the device subscribes, in any region;
- a command that came back from a region whose gateway did not take it
  (contract.DOWNLINK_RETURN_AFTER_MS) is routed again.

Where things live: the decision in routing.py, presence events and the rebuild in
presence_feed.py (gateway nodes that stop: node_watch.py), subscriptions per connection in
subscriptions.py, the gateways' management APIs in gateways.py, what waits for a device
(parked, desired, not yet sendable, expiring) in waiting.py.  Every step that moves a
message is confirmed before the input is acked.

Every router with `downlink` on keeps presence and subscriptions current; only the leader
(router/leadership.py) consumes commands and acknowledgements and delivers what waited.  A
standby notes the devices that connected or subscribed with something waiting, and delivers
to them when it takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractRobustChannel

from backend import contract as c
from gateways.mqtt_plugin import text
from router.commands import BadCommand, check_size, parse_command
from router.gateways import Gateways
from router.kafka import AsyncProducer
from router.lifecycle import Lifecycle, cancel_task
from router.metrics import Metrics
from router.node_watch import NodeWatch
from router.outcomes import CommandOutcomes
from router.parking import ParkingLot
from router.presence import PresenceTable, Session
from router.presence_feed import PRESENCE_KEYS, PresenceFeed
from router.reask import REASK_EVERY_S, REASK_ROUND_S, reask_round
from router.registry import Registry
from router.routing import Action, Command, Decision, View, decide, must_ask_gateway
from router.sending import RegionMissing, RegionSender, RegionUnreachable
from router.settings import RouterSettings
from router.stores import DesiredState, PresenceStore, all_confirmed, confirm_later
from router.subscriptions import Subscriptions
from router.tasks import every, watch
from router.waiting import Waiting

log = logging.getLogger(__name__)

#: How long a shutdown waits on one AMQP call (what is not acked by then RabbitMQ redelivers).
SHUTDOWN_CALL_TIMEOUT_S = 2.0
#: Presence events taken at once (each is acked within PRESENCE_CONFIRM_WAIT_S at most).
PRESENCE_PREFETCH = 100
#: How far back a router taking over delivers to devices that subscribed with something waiting:
#: the old leader handled those before it died, but its death may take a heartbeat to show.
MISSED_WINDOW_S = 60.0


class Downlink(Lifecycle):
    def __init__(
        self,
        settings: RouterSettings,
        presence: PresenceTable,
        parking: ParkingLot,
        desired: DesiredState,
        producer: AsyncProducer,
        metrics: Metrics,
        presence_store: PresenceStore | None = None,
        gateways: Gateways | None = None,
        outcomes: CommandOutcomes | None = None,
    ):
        super().__init__()
        self.settings = settings
        self.presence = presence
        self.parking = parking
        self.desired = desired
        self.producer = producer
        self.metrics = metrics
        self.gateways = gateways or Gateways(Gateways.clients_from_settings(settings), metrics)
        self.registry = Registry(self.gateways)
        #: each step taken with a command, in Kafka (router/outcomes.py)
        self.outcomes = outcomes or CommandOutcomes(producer, metrics, settings)
        #: devices seen connected since this router started, or with parked/desired state
        self.known: set[str] = set()
        self.subscriptions = Subscriptions()
        self._lock = asyncio.Lock()
        #: sends only while this router leads (router/leadership.py)
        self.sender = RegionSender(settings.regions, metrics, self.outcomes)
        self.waiting = Waiting(
            parking,
            desired,
            presence,
            self.subscriptions,
            metrics,
            ack_timeout_s=settings.ack_timeout_s,
            send=self.sender.send,
            deadletter=self.outcomes.deadletter,
            outcomes=self.outcomes,
        )
        self.acks = self.waiting.acks
        self.feed = PresenceFeed(
            presence,
            presence_store,
            self.gateways,
            self.subscriptions,
            self.known,
            self._lock,
            metrics,
            deliver=self._deliver,
            has_pending=self._has_pending,
            ended=self.waiting.session_ended,
            found=self._found,
            node_lost=self.waiting.node_lost,
        )
        self.node_watch = NodeWatch(self.feed, self._lock, self.waiting.node_lost)
        self._checks: set[asyncio.Task[None]] = set()
        self._consumers: list[tuple[aio_pika.abc.AbstractQueue, str]] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._reasker: asyncio.Task[None] | None = None
        self._followers: list[asyncio.Task[None]] = []  # the presence reconcile's, the node watch's
        #: devices that connected or subscribed with something waiting while this router stood by
        self._missed: dict[str, float] = {}

    def set_gateways(self, settings: RouterSettings) -> None:
        """A region was added or removed: route, broadcast and rebuild with the new set."""
        self.settings = settings
        self.gateways.set_clients(Gateways.clients_from_settings(settings))
        self.feed.drop_regions_except(set(settings.regions))
        self.sender.set_regions(settings.regions)

    # --- lifecycle -----------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.sender.leading

    async def _start(self, channel: AbstractRobustChannel) -> None:  # type: ignore[override]
        """Follow presence (every router, leading or not); lead() starts the routing."""
        # per consumer (basic.qos applies to the consumers created after it)
        await channel.set_qos(prefetch_count=PRESENCE_PREFETCH)
        # Presence first, rebuilt before any command is routed.  Per router, quorum: events of
        # a restart wait for it (router/presence_feed.py), and it lives on when a backend node
        # dies; an abandoned one expires in 1 h.
        presence_q = await channel.declare_queue(
            c.router_presence_queue(self.settings.router_id),
            durable=True,
            arguments=c.ROUTER_PRESENCE_QUEUE_ARGS,
        )
        for key in PRESENCE_KEYS:
            await presence_q.bind(c.PRESENCE_EXCHANGE, routing_key=key)
        await self.feed.rebuild()
        self._consumers.append((presence_q, await presence_q.consume(self.feed.on_event)))
        if self.settings.presence_reconcile_s > 0:
            reconciling = self.feed.reconcile_every(self.settings.presence_reconcile_s)
            self._followers = [
                self.spawn(reconciling, "reconcile"),
                self.spawn(self.node_watch.run(), "node-watch"),
            ]

    async def _found(self, session: Session) -> None:
        """A live session no event had given (presence_feed `reconcile`; the lock is held):
        what waits for its device and matches what it subscribes to goes now, as on a
        takeover (everything, when its gateway could not say what it subscribes to)."""
        if not self.waiting.has_pending(session.client_id):
            return
        if self.leading:
            filters = self.subscriptions.filters(session.connection)
            if filters is None or filters:
                await self.waiting.deliver(session, ["#"] if filters is None else filters)
        else:
            self._missed[session.client_id] = time.monotonic()

    async def lead(self, channel: AbstractChannel, connection: AbstractConnection) -> None:
        """This router now routes commands, on `channel` (the lease connection's, with
        confirms and returns): first what waited for devices that connected meanwhile."""
        async with self._lock:
            self.sender.use(channel, connection)
            recent = time.monotonic() - MISSED_WINDOW_S
            waiting = {d for d, at in self._missed.items() if at > recent} | set(self.parking.all_devices())
            self._missed.clear()
            for device in sorted(waiting):
                session = self.presence.get(device)
                if session is None:
                    continue  # its next session gets what waits
                # a session seen opening without a subscription since may be a persistent one
                # whose subscriptions predate it: ask its gateway, as the leader does at connect
                if self.subscriptions.filters(session.connection) == [] and self._ask_filters_soon(session):
                    continue
                self.waiting.retry_later(device)  # the first sweep, at once, sends what matches
        await channel.set_qos(prefetch_count=self.settings.command_prefetch)
        for name, handler in ((c.COMMANDS_QUEUE, self.on_command), (c.ACKS_QUEUE, self.on_ack)):
            queue = await channel.get_queue(name, ensure=True)
            self._consumers.append((queue, await queue.consume(handler)))
        self._sweeper = self.spawn(self.waiting.run_sweeper(self._lock, first_after=0.0), "sweeper")

        async def reask() -> None:
            reask_round(self.parking, self.presence, self.subscriptions, self._ask_filters_soon)

        failed = "asking again for held sessions' subscriptions failed"
        self._reasker = self.spawn(
            every(REASK_ROUND_S, reask, failed, logger=log, traceback=True), "reask-held"
        )

    async def stand_by(self) -> None:
        """The lease is lost (its connection with it): stop what only the leader does."""
        self.sender.use(None)
        for task in (self._sweeper, self._reasker):
            await cancel_task(task)  # ended, not only cancelled: a stand-by router sends nothing
        for check in list(self._checks):
            check.cancel()
        self._consumers = [
            (q, tag) for q, tag in self._consumers if q.name not in (c.COMMANDS_QUEUE, c.ACKS_QUEUE)
        ]

    def _has_pending(self, device: str) -> bool:
        """For the presence feed: whether to ask a new session's subscriptions now."""
        if not self.waiting.has_pending(device):
            return False
        if not self.leading:
            self._missed[device] = time.monotonic()
        return self.leading

    async def _deliver(self, session: Session, filters: list[str]) -> None:
        if self.leading:
            await self.waiting.deliver(session, filters)
        elif self.waiting.has_pending(session.client_id):
            self._missed[session.client_id] = time.monotonic()

    async def _stop(self) -> None:
        """Stop intake: what is not acked by now RabbitMQ redelivers to the next router."""
        for task in (self._sweeper, self._reasker, *self._followers):
            await cancel_task(task)
        for check in list(self._checks):
            check.cancel()
        self.gateways.stop()
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

    # --- commands ----------------------------------------------------------------------

    async def on_command(self, message: AbstractIncomingMessage) -> None:
        # Acked only after the message is confirmed at its next hop (downlink
        # exchange, Kafka parking or dead-letter); an exception requeues it.
        # Parking writes are confirmed after the lock (stores.confirm_later): the next
        # command does not wait for this one's Kafka round trip.
        async with message.process(requeue=True):
            device = text((message.headers or {}).get(c.DEVICE_HEADER, ""))
            if device and device not in self.known:
                await self.registry.look_up(device)  # off the lock: only this command waits for it
            async with confirm_later() as pending, self._lock:
                try:
                    cmd = parse_command(message.headers, message.content_type, message.correlation_id)
                    check_size(cmd, message.body)
                except BadCommand as e:
                    # an oversized one keeps its first bytes: Kafka would refuse the whole
                    await self.outcomes.deadletter(
                        str(e), e.device, e.topic, message.body[: c.MAX_COMMAND_BYTES]
                    )
                    return
                await self.handle(cmd, message.body)
            await all_confirmed(pending)

    async def on_ack(self, message: AbstractIncomingMessage) -> None:
        """A device's acknowledgement of commands (router/acks.py); acked once settled in Kafka."""
        async with message.process(requeue=True):
            async with confirm_later() as pending, self._lock:
                await self.acks.on_ack(message.routing_key or "", message.body)
            await all_confirmed(pending)

    async def route(self, device: str, topic: str, payload: bytes, *, retain: bool = False) -> str:
        """Send, park or broadcast one new command; returns what was done."""
        return await self.handle(Command(device, topic, retain=retain), payload)

    async def handle(self, cmd: Command, payload: bytes) -> str:
        """Decide and carry out; the caller holds the lock.  Returns what was done."""
        if cmd.returned_from is None:
            self.outcomes.of(cmd.device, cmd.topic, payload, "accepted")
        else:
            self.metrics.inc("fedgate_router_returned_total", region=cmd.returned_from)
            self.outcomes.of(cmd.device, cmd.topic, payload, "returned", region=cmd.returned_from)
        decision = decide(cmd, await self._view(cmd))
        try:
            return await self._carry_out(cmd, decision, payload)
        except RegionMissing as e:
            # its region is gone or cannot take it now: as if the device were offline
            view = dataclasses.replace(await self._view(cmd), session=None)
            again = dataclasses.replace(decide(cmd, view), store_desired=False, end_session=None)
            outcome = await self._carry_out(cmd, again, payload)
            if isinstance(e, RegionUnreachable) and self.presence.get(cmd.device) is not None:
                self.waiting.retry_later(cmd.device)  # parked; sent once the link is back
            return outcome

    async def _view(self, cmd: Command) -> View:
        session = self.presence.get(cmd.device)
        answers = True
        if must_ask_gateway(cmd, session):
            assert cmd.returned_from is not None
            answers = await self.gateways.answers(cmd.returned_from)
        return View(
            session,
            subscribed=session is None or self.subscriptions.covers(session.connection, cmd.topic),
            known=cmd.device in self.known,
            registered=self.registry.says(cmd.device),
            unknown_device=self.settings.unknown_device,
            gateway_answers=answers,
            now=time.time(),
        )

    async def _carry_out(self, cmd: Command, d: Decision, payload: bytes) -> str:
        if d.end_session is not None:
            log.warning(
                "a command for %s came back from %s, whose gateway does not answer: "
                "the session ended with it, the command waits for the device",
                cmd.device,
                cmd.returned_from,
            )
            await self.feed.end(d.end_session)
        if d.store_desired:
            await self.desired.set(cmd.device, cmd.topic, payload)
            self.known.add(cmd.device)
            self.outcomes.of(cmd.device, cmd.topic, payload, "desired")
            self.metrics.inc("fedgate_router_desired_stored_total")
        if d.action is Action.DEADLETTER:
            log.warning("dead-lettering a command for %r: %s", cmd.device, d.reason)
            await self.outcomes.deadletter(d.reason, cmd.device, cmd.topic, payload)
        elif d.action is Action.SEND:
            assert d.region is not None
            session = self.presence.get(cmd.device)
            how = self.subscriptions.delivery(session.connection, cmd.topic) if session else ""
            await self.sender.send(d.region, cmd, payload, delivery=how)
            if session is not None and not cmd.retain:
                await self.waiting.sent(session, cmd, payload)
            if cmd.retain and session is not None:
                self.subscriptions.mark_replayed(session.connection, cmd.topic)
            self.metrics.inc("fedgate_router_routed_total", region=d.region)
        elif d.action is Action.HOLD:
            # held until the device subscribes: parked, and sent when the subscription shows
            # (binding event, or the check of a persistent session's subscriptions); never
            # subscribing, it expires into the dead-letter topic with the reason
            await self.parking.park_command(cmd, payload)
            self.outcomes.of(cmd.device, cmd.topic, payload, "held", region=d.region or "")
            self.metrics.inc("fedgate_router_held_total", region=d.region or "")
            session = self.presence.get(cmd.device)
            if session is not None:
                self._ask_filters_soon(session)
        elif d.action is Action.PARK:
            await self.parking.park_command(cmd, payload)
            self.outcomes.of(cmd.device, cmd.topic, payload, "parked")
            self.metrics.inc("fedgate_router_parked_total")
        elif d.action is Action.BROADCAST:
            for region in self.settings.regions:
                with contextlib.suppress(RegionMissing):  # logged and counted; the others still get it
                    await self.sender.send(region, cmd, payload, broadcast=True)
            self.outcomes.of(cmd.device, cmd.topic, payload, "broadcast")
            self.metrics.inc("fedgate_router_broadcast_total")
        return d.outcome()

    # --- delivering what waited -----------------------------------------------------------

    def _ask_filters_soon(self, session: Session) -> bool:
        """Ask a connection's gateway for subscriptions the router has not seen being made (a
        persistent session's; a clean session's whose binding event was lost), off the lock,
        and deliver what they match; False when it was asked less than REASK_EVERY_S ago."""
        if not self.subscriptions.ask_due(session.connection, REASK_EVERY_S):
            return False

        async def ask() -> None:
            filters = await self.gateways.kept_filters(session)
            async with self._lock:
                if self.presence.get(session.client_id) != session:
                    return  # the session ended meanwhile; its commands stay parked
                if not await self.feed.use_filters(session, filters):
                    # the held commands go out as they did before subscriptions were tracked
                    await self.waiting.deliver(session, ["#"])

        task = asyncio.create_task(ask())
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)
        watch(task, "checking a session's subscriptions failed: %r", logger=log)
        return True
