"""What became of each command, step by step, in Kafka: its sender and analysts follow it there.

Every command has an id: contract.message_id of its MQTT topic and payload,
the id its device acknowledges (router/acks.py) and `fedgate send` prints.
Each step the router takes with it is one JSON record on the topic
OUTCOMES_TOPIC, keyed by that id (so a command's steps stay in order in
one partition):

    {"command_id": "...", "device": "pump-1", "topic": "devices/pump-1/commands/open",
     "outcome": "routed", "region": "local-eu", "reason": "", "at": 1795514237716,
     "router": "router-0"}

Outcomes, in the order a command can meet them:

- ``accepted``: the router took it from `fedgate.commands` (a command sent
  again by its sender, or redelivered after a router died, is accepted again);
- ``returned``: it came back from a region whose gateway did not take it;
- ``held`` (connected, not subscribed yet), ``parked`` (away; reason says
  why when it is parked again), ``desired`` (kept as desired state),
  ``broadcast`` (the registry could not say, every region got it);
- ``routed``: the region's downlink exchange on the backend took it, for
  the gateway's link to pass to the device's session (again after a park);
  ``delivery`` says how that session takes it: ``qos1`` (the session's queue
  holds it and MQTT delivers it at least once: the last step unless the
  connection ended as it was sent, which parks it again), ``qos0`` (at most
  once: ``acknowledged`` follows, or it is sent again), or empty when the
  router does not know the connection's subscriptions;
- ``acknowledged``: the device said it got it (devices that acknowledge);
- ``deadlettered``: refused, expired or never acknowledged -- the reason
  says which; the command itself is in the dead-letter topic.

A record is produced the moment the step is taken and not waited for: a
command is never held up by its record, and the producer keeps records
queued while Kafka is away (it sends them once Kafka is back), up to
MAX_QUEUED records in all; past that, outcome records are dropped and
counted.  A router that dies with records queued loses them; the commands
themselves are redelivered, so their steps are recorded again.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict

from backend import contract as c
from router.kafka import AsyncProducer
from router.metrics import Metrics
from router.settings import RouterSettings
from router.stores import confirmed_later
from router.tasks import watch

log = logging.getLogger(__name__)

OUTCOMES_TOPIC = c.KAFKA_COMMAND_OUTCOMES_TOPIC
#: Records queued in the producer (Kafka away) above which a new outcome record is dropped and
#: counted: commands to connected devices flow on while Kafka is away, and their records must
#: not fill the producer's queue (librdkafka's default holds 100,000), whose writes for parked
#: commands and device messages must always find room.
MAX_QUEUED = 50_000
#: Commands whose acceptance time is kept for fedgate_router_command_seconds: the oldest is
#: forgotten past this many (commands parked for days, acknowledgements that never come).
MAX_TIMED = 100_000
#: The outcomes fedgate_router_command_seconds times, from `accepted`.
TIMED_OUTCOMES = ("routed", "acknowledged", "deadlettered")
OUTCOMES = (
    "accepted",
    "returned",
    "held",
    "parked",
    "desired",
    "broadcast",
    "routed",
    "acknowledged",
    "deadlettered",
)


class CommandOutcomes:
    def __init__(self, producer: AsyncProducer, metrics: Metrics, settings: RouterSettings):
        self.producer = producer
        self.metrics = metrics
        self.router_id = settings.router_id
        self.deadletter_topic = settings.deadletter_topic
        self.topic = OUTCOMES_TOPIC
        #: command id -> when this router accepted it (monotonic), until its last outcome
        self._accepted: OrderedDict[str, float] = OrderedDict()

    async def deadletter(self, reason: str, device: str, topic: str, payload: bytes) -> None:
        """The command to the dead-letter topic with the reason, and its last outcome on record."""
        # produced now (in order), confirmed after the caller's lock when it collects
        # confirmations: Kafka being slow or away must not hold up routing
        await confirmed_later(
            self.producer.send_soon(
                self.deadletter_topic,
                payload,
                device or None,
                [
                    (c.KAFKA_DEADLETTER_REASON_HEADER, reason.encode()),
                    (c.KAFKA_DEVICE_HEADER, device.encode()),
                    (c.KAFKA_MQTT_TOPIC_HEADER, topic.encode()),
                ],
            )
        )
        self.metrics.inc("fedgate_router_deadlettered_total", topic=self.deadletter_topic)
        self.of(device, topic, payload, "deadlettered", reason=reason)

    def record(
        self,
        command_id: str,
        device: str,
        topic: str,
        outcome: str,
        *,
        region: str = "",
        reason: str = "",
        delivery: str = "",
    ) -> None:
        assert outcome in OUTCOMES, outcome
        self._time(command_id, outcome, delivery)
        if len(self.producer) > MAX_QUEUED:
            self.metrics.inc("fedgate_router_outcomes_dropped_total")
            return
        value = {
            "command_id": command_id,
            "device": device,
            "topic": topic,
            "outcome": outcome,
            "region": region,
            "reason": reason,
            **({"delivery": delivery} if delivery else {}),
            "at": int(time.time() * 1000),
            "router": self.router_id,
        }
        written = self.producer.send_soon(self.topic, json.dumps(value).encode(), command_id)
        watch(
            written, "a command outcome record was refused by Kafka: %r", logger=log, on_failure=self._failed
        )
        self.metrics.inc("fedgate_router_outcomes_total", outcome=outcome)

    def _time(self, command_id: str, outcome: str, delivery: str) -> None:
        """fedgate_router_command_seconds: from the command's acceptance here to `outcome`.
        A command accepted by another router (it died, or this one took over) is not timed."""
        if outcome == "accepted":
            self._accepted[command_id] = time.monotonic()
            self._accepted.move_to_end(command_id)
            if len(self._accepted) > MAX_TIMED:
                self._accepted.popitem(last=False)
            return
        if outcome not in TIMED_OUTCOMES:
            return
        # routed over QoS 1 is the command's last step; over QoS 0 an acknowledgement follows
        last = outcome != "routed" or delivery == "qos1"
        accepted = self._accepted.pop(command_id, None) if last else self._accepted.get(command_id)
        if accepted is not None:
            self.metrics.observe(
                "fedgate_router_command_seconds", time.monotonic() - accepted, outcome=outcome
            )

    def of(self, device: str, topic: str, payload: bytes, outcome: str, **kw: str) -> None:
        """Record a step of the command `payload` on `topic` (its id computed here)."""
        self.record(c.message_id(topic, payload), device, topic, outcome, **kw)

    def _failed(self, e: BaseException) -> None:
        self.metrics.inc("fedgate_router_outcomes_failed_total")
