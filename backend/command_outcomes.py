"""Following a command: what the router did with it, read back from Kafka.

The router records each step it takes with a command on the Kafka topic
`contract.KAFKA_COMMAND_OUTCOMES_TOPIC`, keyed by the command's id
(router/outcomes.py).  `fedgate send` prints the id; `fedgate command <id>`
and `send --wait` read the steps back here, from the one partition that
holds the id (the router's producer partitions by key: librdkafka's
default partitioner, CRC-32 of the key modulo the partition count).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from backend import contract as c
from backend.amqp import Reply, ReplyWait
from backend.kafka_read import not_yet, partitions, throwaway_consumer

TOPIC = c.KAFKA_COMMAND_OUTCOMES_TOPIC
#: Outcomes after which the router does nothing more with the command.
FINAL = ("acknowledged", "deadlettered")
#: A command routed to a QoS 1 subscription is the session's once this long passed with no
#: later step: a connection that ended as it was sent has it parked again (router/waiting.py,
#: within 1 s of the gateway's close), and the close event reaches the router within this.
QOS1_SETTLED_S = 3.0


@dataclass(frozen=True)
class Outcome:
    outcome: str
    at_ms: int
    region: str = ""
    reason: str = ""
    router: str = ""
    delivery: str = ""

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.at_ms / 1000)) + f".{self.at_ms % 1000:03d}"
        where = f" at {self.region}" if self.region else ""
        how = f" ({self.delivery} subscription)" if self.delivery else ""
        why = f": {self.reason}" if self.reason else ""
        return f"{when}  {self.outcome}{where}{how}{why}  ({self.router})"


def outcome_of(record: dict[str, Any]) -> Outcome:
    return Outcome(
        str(record.get("outcome", "")),
        int(record.get("at", 0)),
        str(record.get("region", "")),
        str(record.get("reason", "")),
        str(record.get("router", "")),
        str(record.get("delivery", "")),
    )


def partition_of(command_id: str, partition_count: int) -> int:
    """The partition the router's producer writes the id's records to (librdkafka's
    `consistent_random` partitioner for keyed records: CRC-32 of the key)."""
    return zlib.crc32(command_id.encode()) % partition_count


def final_outcome(steps: list[Outcome], now_ms: int) -> str | None:
    """How the command ended, from its steps so far (oldest first); None while it may go on.

    "acknowledged" and "deadlettered" end it; a command routed to a QoS 1 subscription is
    "delivered" (MQTT carries it on from the session) once QOS1_SETTLED_S passed with no
    later step."""
    if not steps:
        return None
    last = steps[-1]
    if last.outcome in FINAL:
        return last.outcome
    if last.outcome == "routed" and last.delivery == "qos1" and now_ms - last.at_ms >= QOS1_SETTLED_S * 1000:
        return "delivered"
    return None


class OutcomeFollower:
    """The steps on record for one command, as they come (a context manager)."""

    def __init__(self, bootstrap: str, command_id: str, *, since_ms: int | None = None):
        self.command_id = command_id
        self.key = command_id.encode()
        self.steps: list[Outcome] = []
        self._consumer: Consumer = throwaway_consumer(bootstrap, "outcomes")
        self._since_ms = since_ms
        self._end = 0
        self._read = 0
        self._assigned = False

    def __enter__(self) -> OutcomeFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self._consumer.close()

    def _assign(self) -> bool:
        """Assign the id's partition (from `since_ms`, else its start); False while the topic
        does not exist yet (no router started)."""
        try:
            count = len(partitions(self._consumer, TOPIC, timeout=5))
        except (RuntimeError, KafkaException):
            return False
        tp = TopicPartition(TOPIC, partition_of(self.command_id, count), OFFSET_BEGINNING)
        try:
            low, self._end = self._consumer.get_watermark_offsets(tp, timeout=10)
            found = (
                self._consumer.offsets_for_times([TopicPartition(TOPIC, tp.partition, self._since_ms)], 10)
                if self._since_ms is not None
                else None
            )
        except KafkaException as e:
            # A topic just created, or a partition whose leader moves, answers "not leader"
            # for a moment: not yet, like a topic that does not exist yet.
            if not_yet(e):
                return False
            raise
        self._read = low
        if found:
            # -1: nothing written at or after that time: from what is written next
            tp.offset = self._read = found[0].offset if found[0].offset >= 0 else self._end
        self._consumer.assign([tp])
        self._assigned = True
        return True

    @property
    def assigned(self) -> bool:
        return self._assigned

    @property
    def caught_up(self) -> bool:
        """Everything on record when the partition was first looked at has been read."""
        return self._assigned and self._read >= self._end

    def poll(self, timeout: float) -> list[Outcome]:
        """The command's steps that arrived within `timeout` seconds, oldest first."""
        deadline = time.monotonic() + timeout
        if not self._assigned and not self._assign():
            time.sleep(max(0.0, deadline - time.monotonic()))
            return []
        new: list[Outcome] = []
        while (left := deadline - time.monotonic()) > 0:
            msg = self._consumer.poll(min(left, 0.2))
            if msg is None:
                if new or self.caught_up:
                    break
                continue
            if msg.error():
                continue
            self._read = msg.offset() + 1
            if msg.key() != self.key:
                continue
            try:
                new.append(outcome_of(json.loads(msg.value())))
            except (ValueError, TypeError):
                continue  # not a record of the router's
        self.steps.extend(new)
        return new

    def final(self) -> str | None:
        return final_outcome(self.steps, int(time.time() * 1000)) if self.caught_up else None


def read_outcomes(bootstrap: str, command_id: str, *, wait_s: float = 0.0) -> list[Outcome]:
    """The steps on record for the command, oldest first: what the topic holds now, and with
    `wait_s`, what comes until it ends (final_outcome) or that many seconds passed."""
    deadline = time.monotonic() + wait_s
    with OutcomeFollower(bootstrap, command_id) as f:
        while True:
            f.poll(min(0.5, max(deadline - time.monotonic(), 0.05)))
            if f.caught_up and (time.monotonic() >= deadline or f.final() is not None):
                return f.steps
            if not f.assigned and time.monotonic() >= deadline:
                return []


@dataclass(frozen=True)
class CommandEnd:
    """How `follow` saw a command end: `ended` is "answered", "delivered", "acknowledged",
    "deadlettered", or "" when the time ran out first; `steps` all on record by then."""

    command_id: str
    ended: str
    steps: list[Outcome]
    reply: Reply | None = None


def follow(
    url: str,
    bootstrap: str,
    device: str,
    topic: str,
    payload: bytes | str,
    *,
    timeout_s: float,
    expires_in_s: float | None = None,
    want_answer: bool = False,
    on_step: Callable[[Outcome], None] = lambda _: None,
) -> CommandEnd:
    """Send a command (with a response topic: ReplyWait) and follow it until it ends: its
    device's answer, or a final outcome (final_outcome) -- with `want_answer` only the answer
    or its dead-lettering end it.  Each step is passed to `on_step` as it comes."""
    since_ms = int(time.time() * 1000) - 5_000  # the router's clock may run a little behind ours
    deadline = time.monotonic() + timeout_s
    body = payload.encode() if isinstance(payload, str) else payload
    command_id = c.message_id(topic, body)
    with (
        ReplyWait(url, device, topic, body, expires_in_s=expires_in_s) as answer,
        OutcomeFollower(bootstrap, command_id, since_ms=since_ms) as steps,
    ):
        while time.monotonic() < deadline:
            reply = answer.poll(0.1)
            if reply is not None:
                return CommandEnd(command_id, "answered", steps.steps, reply)
            for s in steps.poll(0.2):
                on_step(s)
            ended = steps.final()
            if ended == "deadlettered" or (ended is not None and not want_answer):
                return CommandEnd(command_id, ended, steps.steps)
        return CommandEnd(command_id, "", steps.steps)
