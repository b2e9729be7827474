"""Following a command: what the router did with it, read back from Kafka.

The router records each step it takes with a command on the Kafka topic
`contract.KAFKA_COMMAND_OUTCOMES_TOPIC`, keyed by the command's id
(router/outcomes.py).  `fedgate send` prints the id; `fedgate command <id>`
and `send --wait` read the steps back here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException

from backend import contract as c
from backend.kafka_read import assign_from_start, end_offsets, throwaway_consumer

#: Outcomes after which the router does nothing more with the command.
FINAL = ("acknowledged", "deadlettered")


@dataclass(frozen=True)
class Outcome:
    outcome: str
    at_ms: int
    region: str = ""
    reason: str = ""
    router: str = ""

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.at_ms / 1000)) + f".{self.at_ms % 1000:03d}"
        where = f" at {self.region}" if self.region else ""
        why = f": {self.reason}" if self.reason else ""
        return f"{when}  {self.outcome}{where}{why}  ({self.router})"


def outcome_of(record: dict[str, Any]) -> Outcome:
    return Outcome(
        str(record.get("outcome", "")),
        int(record.get("at", 0)),
        str(record.get("region", "")),
        str(record.get("reason", "")),
        str(record.get("router", "")),
    )


def read_outcomes(bootstrap: str, command_id: str, *, wait_s: float = 0.0) -> list[Outcome]:
    """The steps on record for the command, oldest first: what the topic holds now, and with
    `wait_s`, what comes until a final outcome (FINAL) or that many seconds."""
    consumer = throwaway_consumer(bootstrap, "outcomes")
    try:
        try:
            assign_from_start(consumer, c.KAFKA_COMMAND_OUTCOMES_TOPIC)
            ends = end_offsets(consumer, c.KAFKA_COMMAND_OUTCOMES_TOPIC)
        except (RuntimeError, KafkaException):
            return []  # no router has started yet: nothing on record
        out: list[Outcome] = []
        read: dict[int, int] = dict.fromkeys(ends, 0)
        deadline = time.monotonic() + wait_s
        while True:
            caught_up = all(read[p] >= end for p, end in ends.items())
            if caught_up and (time.monotonic() >= deadline or (out and out[-1].outcome in FINAL)):
                break
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                if caught_up and time.monotonic() >= deadline:
                    break
                continue
            read[msg.partition()] = msg.offset() + 1
            if msg.key() != command_id.encode():
                continue
            try:
                out.append(outcome_of(json.loads(msg.value())))
            except (ValueError, TypeError):
                continue  # not a record of the router's
        return sorted(out, key=lambda o: o.at_ms)
    finally:
        consumer.close()
