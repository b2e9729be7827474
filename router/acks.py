"""Commands that their device acknowledges itself: sent again until it does.

A device that subscribes to its commands at QoS 0 costs its gateway a
third to a half of the memory of a QoS 1 subscription (docs/router.md, "Which QoS
for commands"), but MQTT then delivers at most once: a command on its way
when the connection drops, or dropped by a gateway under overload, is gone,
and nothing tells the router.  So such a device acknowledges each command
itself, on devices/<id>/acks ({"acks": [<command id>, ...]}, the id being
contract.message_id of the command's topic and payload), and the router
keeps every command it sent to a QoS 0 subscription in the parking lot,
marked as sent, until that acknowledgement arrives:

- the device's next session gets it again as soon as it subscribes (the
  parked commands are delivered then, as for a device that was offline);
- the same session gets it again when `ack_timeout_s` passes without one;
- when its expiry or parking's TTL passes, it is dead-lettered with the
  number of attempts.

A device may so receive a command more than once (at least once); it
recognises a repeat by the command id.  Devices subscribed at QoS 1 rely on
MQTT's own acknowledgement and are not tracked.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from backend import contract as c
from router.metrics import Metrics
from router.outcomes import CommandOutcomes
from router.parking import Parked, ParkingLot
from router.presence import PresenceTable, Session
from router.routing import Command
from router.subscriptions import Subscriptions

log = logging.getLogger(__name__)


class CommandAcks:
    def __init__(
        self,
        parking: ParkingLot,
        presence: PresenceTable,
        subscriptions: Subscriptions,
        metrics: Metrics,
        ack_timeout_s: float,
        send: Callable[[Session, Parked], Awaitable[None]],
        outcomes: CommandOutcomes | None = None,
    ):
        self.parking = parking
        self.presence = presence
        self.subscriptions = subscriptions
        self.metrics = metrics
        self.ack_timeout_s = ack_timeout_s
        self._send = send
        self.outcomes = outcomes

    def tracks(self, session: Session, topic: str) -> bool:
        """Whether a command on `topic` to this session waits for the device's acknowledgement."""
        return self.subscriptions.only_qos0(session.connection, topic)

    async def sent(self, session: Session, cmd: Command, payload: bytes) -> None:
        """A new command went to the session: on record until acknowledged, if the device acks."""
        if self.tracks(session, cmd.topic):
            await self.parking.park_command(cmd, payload, sent_to=session.connection)

    async def on_ack(self, routing_key: str, payload: bytes) -> int:
        """Take an acknowledgement published on devices/<id>/acks (the caller holds the
        downlink's lock, so the command it acknowledges is already on record); returns how
        many commands it settled."""
        parts = c.routing_key_to_mqtt_topic(routing_key).split("/")
        if len(parts) != 3 or parts[0] != "devices" or parts[2] != "acks":
            return 0  # not an acknowledgement topic: the queue's binding lets none through
        device = parts[1]
        try:
            ids = c.parse_acks(payload)
        except ValueError as e:
            # the record is in Kafka anyway (telemetry.acks, bridged like any device message)
            log.warning("acknowledgement from %s refused: %s", device, e)
            self.metrics.inc("fedgate_router_acks_refused_total")
            return 0
        waiting = [p for p in self.parking.for_device(device) if p.sent_to is not None]
        settled = 0
        for command_id in ids:
            match = next((p for p in waiting if p.command_id == command_id), None)
            if self.outcomes is not None:
                # on record for every command the device says it got, tracked or not
                self.outcomes.record(command_id, device, match.topic if match else "", "acknowledged")
            if match is None:
                continue  # a repeat, or a command sent to a QoS 1 subscription: nothing waits
            waiting.remove(match)
            await self.parking.remove(match)
            settled += 1
        self.metrics.inc("fedgate_router_acked_total", settled)
        return settled

    async def resend_if_due(self, p: Parked, now: float) -> None:
        """Send a command again if it waited `ack_timeout_s` for its acknowledgement and its
        device is connected and subscribed now (one that is away gets it on its next
        subscription).  Called by the downlink's sweep over the lot, expired records left out.
        One sent as a gateway node of its region died (`settles_at`) goes again once that
        time is past, unless the device acknowledged it meanwhile."""
        if p.sent_to is None:
            return
        due = p.sent_at + self.ack_timeout_s if p.settles_at is None else p.settles_at
        if now < due:
            return
        session = self.presence.get(p.device)
        if session is None or not self.subscriptions.covers(session.connection, p.topic):
            return
        if p.settles_at is None:
            log.info("%s: command %s not acknowledged; sending it again", p.device, p.command_id)
        else:
            log.info("%s: command %s sent as a node died; sending it again", p.device, p.command_id)
        await self._send(session, p)
        if p.settles_at is None:
            self.metrics.inc("fedgate_router_resent_total")
        else:
            self.metrics.inc("fedgate_router_resent_after_node_loss_total")
