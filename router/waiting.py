"""What waits for a device, and getting it there: parked commands, desired state,
commands that could not be sent, and expiry.

The downlink (router/downlink.py) decides what to do with each new command;
what it cannot hand to the device's gateway at once waits here:

- parked commands (Kafka, with a TTL) and desired state go out when the
  device has a session *and subscribes* to a matching topic (`deliver`,
  called by the presence feed);
- a send that fails because the region cannot take it -- its downlink
  exchange is gone (RegionMissing) or the backend returned the command
  because no link to the gateway is bound (RegionUnreachable: the gateway
  never linked, or its link is down while its events still arrive) -- leaves
  the command parked, and the sweep tries the device again every
  SWEEP_EVERY_S while it is connected;
- commands sent to QoS 0 subscriptions wait for the device's acknowledgement
  (router/acks.py) and are sent again when it does not come;
- a command sent to a session that opened just after a gateway node of its region
  died may vanish with the dead node's queues (NODE_LOSS_SETTLE_S): it is kept in the
  parking lot, marked as sent there, and sent once more when that time is past -- in
  Kafka, so a router that takes over from a dead one sends it too;
- what outlives its expiry or parking's TTL is dead-lettered with the reason;
- a command sent to a connection that ended moments later may never have
  reached the device: the router learns of a disconnect only after it
  happened, and a clean MQTT session keeps nothing, so the gateway drops
  what arrives for it.  Commands sent within DELIVERED_AFTER_S of the end
  (the gateway's time) are parked again for the device's next session (at
  least once: the device may have had them) -- once: what was parked again
  is not, so a device that always leaves at once gets each command twice at
  most, not in a loop.

One record's failure never stops the others: the sweep goes on to the next.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from router.acks import CommandAcks
from router.metrics import Metrics
from router.outcomes import CommandOutcomes
from router.parking import Parked, ParkingLot
from router.presence import PresenceTable, Session
from router.routing import Command, topic_matches
from router.sending import RegionMissing
from router.stores import DesiredState, all_confirmed, confirm_later
from router.subscriptions import Subscriptions
from router.tasks import every, watch

log = logging.getLogger(__name__)

#: How often expired records are dead-lettered, due resends made and failed sends tried again.
SWEEP_EVERY_S = 5.0
#: How long a sweep waits for Kafka to confirm its writes before the next round goes on.
KAFKA_WAIT_S = 30.0
#: A command sent to a connection this long before the connection ended is taken as delivered
#: (it had the time to reach the session); one sent later is parked again, once, for the
#: device's next session.
DELIVERED_AFTER_S = 1.0
#: How long the commands sent to a connection are remembered for that.
REMEMBER_SENT_S = 30.0
#: After a gateway node dies, the other nodes of its cluster delete its clean sessions' queues
#: in batches, for seconds (RabbitMQ 4.0.5: up to ~20 s under load, 2026-12-06), and a queue of
#: the same name that a moved device declares on another node meanwhile can be deleted with
#: them, or its binding (rabbitmq-server issue #6271): what is routed to it then vanishes,
#: though the router saw the subscription made.  So what goes to a session that opened in the
#: region after a session of it ended unseen (its node died), within this many seconds of the
#: router seeing it, is parked again, once, when they are past (at least once: the device may
#: have had it).  500 devices, a node of three killed: 13-86 commands lost in 6 of 8 runs.
NODE_LOSS_SETTLE_S = 30.0


class Send(Protocol):
    """Publish a command to a region (RegionSender.send)."""

    def __call__(
        self, region: str, cmd: Command, payload: bytes, *, delivery: str = ""
    ) -> Awaitable[None]: ...


DeadLetter = Callable[[str, str, str, bytes], Awaitable[None]]


class Waiting:
    def __init__(
        self,
        parking: ParkingLot,
        desired: DesiredState,
        presence: PresenceTable,
        subscriptions: Subscriptions,
        metrics: Metrics,
        *,
        ack_timeout_s: float,
        send: Send,
        deadletter: DeadLetter,
        outcomes: CommandOutcomes | None = None,
    ):
        self.parking = parking
        self.desired = desired
        self.presence = presence
        self.subscriptions = subscriptions
        self.metrics = metrics
        self._send = send
        self._deadletter = deadletter
        self.outcomes = outcomes
        self.acks = CommandAcks(
            parking, presence, subscriptions, metrics, ack_timeout_s, self.send_parked, outcomes
        )
        #: devices with something a region could not take: tried again at each sweep
        self._retry: set[str] = set()
        #: connection -> (sent at, command, payload) of the last REMEMBER_SENT_S seconds
        self._sent: dict[str, collections.deque[tuple[float, Command, bytes]]] = {}
        #: region -> (when a session of it was last alive before it ended unseen, until when
        #: its new sessions count as settling): see NODE_LOSS_SETTLE_S
        self._node_lost: dict[str, tuple[float, float]] = {}

    def has_pending(self, device: str) -> bool:
        return bool(self.parking.for_device(device) or self.desired.for_device(device))

    def retry_later(self, device: str) -> None:
        self._retry.add(device)

    async def deliver(self, session: Session, filters: list[str]) -> None:
        """Send what waited for this session and matches `filters`: parked commands in
        order, then desired state not yet replayed to this connection.  The caller holds
        the downlink's lock."""
        if not filters:
            return
        device = session.client_id
        now = time.time()
        parked = [
            p for p in self.parking.for_device(device) if any(topic_matches(f, p.topic) for f in filters)
        ]
        for p in parked:  # sorted by parking order
            if p.expires_at < now:
                await self.expire(p)
                continue
            if p.sent_to == session.connection and (p.settles_at is None or p.settles_at > now):
                continue  # sent to this very connection: waits for its acknowledgement, or settles
            if not await self._try(device, self.send_parked(session, p)):
                return  # in order: what was parked after it must not overtake it
            self.metrics.inc("fedgate_router_unparked_total", region=session.region)
        for topic, payload in self.desired.for_device(device):
            if self.subscriptions.replayed(session.connection, topic):
                continue
            if any(topic_matches(f, topic) for f in filters):
                how = self.subscriptions.delivery(session.connection, topic)
                command = Command(device, topic, retain=True)
                if not await self._try(device, self._send(session.region, command, payload, delivery=how)):
                    return
                self.subscriptions.mark_replayed(session.connection, topic)
                self.metrics.inc("fedgate_router_desired_replayed_total", region=session.region)

    async def send_parked(self, session: Session, p: Parked) -> None:
        """Send a parked command; it stays until acknowledged if the device acks (router/acks.py)."""
        how = self.subscriptions.delivery(session.connection, p.topic)
        await self._send(session.region, p.command(), p.payload, delivery=how)
        if self.acks.tracks(session, p.topic):
            await self.parking.mark_sent(p, session.connection)
        else:
            await self.parking.remove(p)
            if not p.again:
                await self._remember(session, p.command(), p.payload)
            else:  # parked again already, so not again as its connection ends; but a node's loss
                await self._settle(session, p.command(), p.payload)

    async def sent(self, session: Session, cmd: Command, payload: bytes) -> None:
        """A new command went to the session: on record until acknowledged if the device acks,
        else remembered for a while in case the connection was ending."""
        if self.acks.tracks(session, cmd.topic):
            await self.acks.sent(session, cmd, payload)
        else:
            await self._remember(session, cmd, payload)

    async def _remember(self, session: Session, cmd: Command, payload: bytes) -> None:
        sent = self._sent.setdefault(session.connection, collections.deque())
        now = time.time()
        sent.append((now, cmd, payload))
        while sent[0][0] < now - REMEMBER_SENT_S:
            sent.popleft()
        await self._settle(session, cmd, payload)

    def node_lost(self, region: str, last_alive: float) -> None:
        """A session of `region` ended unseen, last alive at `last_alive` (epoch s): its
        gateway node may have died, and the sessions that open in the region after it settle
        for NODE_LOSS_SETTLE_S (what is sent to them is sent again after that)."""
        since, _ = self._node_lost.get(region, (last_alive, 0.0))
        self._node_lost[region] = (min(since, last_alive), time.time() + NODE_LOSS_SETTLE_S)

    async def _settle(self, session: Session, cmd: Command, payload: bytes) -> None:
        lost = self._node_lost.get(session.region)
        now = time.time()
        if lost is None or now >= lost[1] or session.connected_at / 1000 < lost[0]:
            return  # no node lost lately, or a session from before the loss
        kept = (cmd.topic, payload, session.connection)
        if any(
            p.settles_at and (p.topic, p.payload, p.sent_to) == kept
            for p in self.parking.for_device(cmd.device)
        ):
            return  # sent again after its region returned it: on record already
        # kept in Kafka before the command is acked: the leader's memory would die with it
        await self.parking.park_command(
            cmd, payload, sent_to=session.connection, again=True, settles_at=lost[1]
        )

    async def session_ended(self, session: Session, ended_at: float) -> None:
        """The connection ended at `ended_at` (epoch s, the gateway's clock): what was sent to it
        shortly before waits for the device's next session.  The caller holds the lock."""
        sent = self._sent.pop(session.connection, ())
        # once each: a command the region returned and the router sent again is on record twice
        late = list(
            {
                (cmd.topic, payload): (cmd, payload)
                for at, cmd, payload in sent
                if at > ended_at - DELIVERED_AFTER_S
            }.values()
        )
        for cmd, payload in late:
            await self.parking.park_command(cmd, payload, again=True)
            if self.outcomes is not None:
                why = "its connection ended as it was sent: for the device's next session"
                self.outcomes.of(cmd.device, cmd.topic, payload, "parked", reason=why)
        if late:
            log.info(
                "%s: %d command(s) sent as its connection ended parked again for its next session",
                session.client_id,
                len(late),
            )
            self.metrics.inc("fedgate_router_reparked_total", len(late))
            if self.presence.get(session.client_id) is not None:
                self.retry_later(session.client_id)  # already connected elsewhere

    async def expire(self, p: Parked) -> None:
        await self._deadletter(p.expired_reason(self.parking.ttl_s), p.device, p.topic, p.payload)
        await self.parking.remove(p)
        self.metrics.inc("fedgate_router_expired_total")

    async def _try(self, device: str, sending: Awaitable[None]) -> bool:
        """Await one send; a region that cannot take it leaves the record waiting, retried later."""
        try:
            await sending
        except RegionMissing as e:
            log.warning(
                "%s: %s could not take a waiting message; trying again in %.0f s", device, e, SWEEP_EVERY_S
            )
            self.retry_later(device)
            return False
        return True

    async def sweep(self, now: float) -> None:
        """One round: dead-letter what expired, send again what waits too long for its
        acknowledgement, and try again what a region could not take.  The caller holds
        the downlink's lock."""
        for device in self.parking.all_devices():
            for p in self.parking.for_device(device):
                try:
                    if p.expires_at < now:
                        await self.expire(p)
                    else:
                        await self._try(device, self.acks.resend_if_due(p, now))
                except Exception as e:  # one record's trouble (Kafka) must not stop the others
                    log.error("%s: a parked message could not be swept: %r", device, e)
        self._node_lost = {r: lost for r, lost in self._node_lost.items() if lost[1] > now}
        for connection in list(self._sent):
            sent = self._sent[connection]
            while sent and sent[0][0] < now - REMEMBER_SENT_S:
                sent.popleft()
            if not sent:
                del self._sent[connection]
        for device in sorted(self._retry):
            self._retry.discard(device)
            session = self.presence.get(device)
            if session is None:
                continue  # its next session gets what waits, as for any device away
            filters = self.subscriptions.filters(session.connection)
            # unknown filters (a session found by the rebuild) count as everything, as in routing
            await self.deliver(session, ["#"] if filters is None else filters)

    async def run_sweeper(self, lock: asyncio.Lock, first_after: float = SWEEP_EVERY_S) -> None:
        async def round_() -> None:
            confirming: asyncio.Future[None] | None = None
            try:
                # Kafka's confirmations of the round's writes are awaited after the lock: with
                # Kafka away, routing goes on, and the next round waits for this one's
                async with confirm_later() as pending, lock:
                    await self.sweep(time.time())
                confirming = asyncio.ensure_future(all_confirmed(pending))
                # shielded: a write given up on would be taken back from the view while the
                # producer still sends it; it stays queued there until Kafka is back
                await asyncio.wait_for(asyncio.shield(confirming), KAFKA_WAIT_S)
            except TimeoutError:
                log.warning("Kafka has not confirmed a sweep's writes in %.0f s; sweeping on", KAFKA_WAIT_S)
                if confirming is not None:
                    watch(confirming, "a sweep's write was refused by Kafka: %r", logger=log)

        # a round that fails otherwise is logged; the next round retries
        await every(
            SWEEP_EVERY_S, round_, "sweeping parked messages failed", first_after=first_after, logger=log
        )
