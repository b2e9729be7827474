"""Parked messages and desired state, kept in compacted Kafka topics.

Neither may live on the backend brokers (no per-device state there), and
both must survive a router restart.  A compacted Kafka topic is a durable,
replicated key-value log: the router writes a record per change, a tombstone
(null value) per removal, and rebuilds its in-memory view by reading the
topic from the beginning at start.  It keeps tailing the topic afterwards,
so a second router sees the same state.

- ``fedgate.router.desired``: key ``<device> NUL <mqtt topic>``, value the
  payload.  The device's last desired state per topic, replayed whenever it
  connects, in any region.
- ``fedgate.router.presence``: key the client id, value JSON of its session.
  The downlink router's presence table, written through on every change, so
  that a restarted router starts from where it stopped (the gateways'
  management API lists new connections only seconds later).
- ``fedgate.router.parked``: key ``<device> NUL <parked id>``, value JSON
  {topic, payload (base64), parked_at, expires_at, and when the command had
  them: its own expiry ``command_expires_at`` and its MQTT 5 ``properties``;
  once sent to a device that acknowledges itself, ``sent_to``, ``attempts``,
  ``sent_at``}.  Delivered in parking order when the device subscribes to a
  matching topic, then tombstoned -- a command for a device subscribed at
  QoS 0 only when the device acknowledged it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from backend import contract as c
from gateways.mqtt_plugin import NO_PROPERTIES, Mqtt5Properties
from router.kafka import AsyncProducer
from router.lifecycle import Lifecycle
from router.presence import Session
from router.routing import Command

log = logging.getLogger(__name__)

#: Kafka delivery reports of parking writes made while this context collects them
#: (confirm_later), to be awaited once the caller released its lock.
_CONFIRM_LATER: contextvars.ContextVar[list[Awaitable[None]] | None] = contextvars.ContextVar(
    "confirm_later", default=None
)


@contextlib.asynccontextmanager
async def confirm_later() -> AsyncIterator[list[Awaitable[None]]]:
    """Collect the Kafka confirmations of the table writes (KafkaTable.put) made inside; the
    caller awaits them (all_confirmed) before it acks its input, outside its lock."""
    pending: list[Awaitable[None]] = []
    token = _CONFIRM_LATER.set(pending)
    try:
        yield pending
    finally:
        _CONFIRM_LATER.reset(token)


async def all_confirmed(pending: list[Awaitable[None]]) -> None:
    """Wait for every collected confirmation; a failure raises (the input is requeued)."""
    outcomes = await asyncio.gather(*pending, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


DESIRED_TOPIC = "fedgate.router.desired"
PRESENCE_TOPIC = "fedgate.router.presence"
PARKED_TOPIC = "fedgate.router.parked"
COMPACTED = {"cleanup.policy": "compact", "min.compaction.lag.ms": "60000"}
SEP = "\x00"


class KafkaTable(Lifecycle):
    """An in-memory dict mirrored from a compacted topic, written through Kafka."""

    def __init__(self, bootstrap: str, topic: str, producer: AsyncProducer, name: str):
        super().__init__()
        self.topic = topic
        self.producer = producer
        self.data: dict[str, bytes] = {}
        self.by_device: dict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()
        self._caught_up = threading.Event()
        self._stop_tailing = threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"fedgate-{name}-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )
        self._thread = threading.Thread(target=self._tail, name=f"tail-{topic}", daemon=True)
        self._error: Exception | None = None

    def _apply(self, key: str, value: bytes | None) -> None:
        device = key.split(SEP, 1)[0]
        with self._lock:
            if value is None:
                self.data.pop(key, None)
                self.by_device[device].discard(key)
                if not self.by_device[device]:
                    self.by_device.pop(device, None)
            else:
                self.data[key] = value
                self.by_device[device].add(key)

    def _end_offsets(self, parts: list[TopicPartition], timeout: float = 45.0) -> dict[int, int]:
        """Each partition's end offset.  A topic created a moment ago may not have its
        leader yet (NOT_LEADER_FOR_PARTITION, "coordinator load in progress"): retried."""
        deadline = time.monotonic() + timeout
        ends = {}
        for tp in parts:
            while True:
                try:
                    _, ends[tp.partition] = self._consumer.get_watermark_offsets(tp, timeout=10)
                    break
                except KafkaException as e:
                    if time.monotonic() > deadline:
                        raise
                    log.info("%s[%d] not readable yet (%s); retrying", self.topic, tp.partition, e)
                    time.sleep(0.5)
        return ends

    def _tail(self) -> None:
        try:
            self._follow()
        except Exception as e:  # start() reports it at once instead of timing out
            self._error = e
            self._caught_up.set()
        finally:
            self._consumer.close()

    def _follow(self) -> None:
        md = self._consumer.list_topics(self.topic, timeout=30)
        parts = [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in md.topics[self.topic].partitions]
        ends = self._end_offsets(parts)
        self._consumer.assign(parts)
        pending = {p for p, high in ends.items() if high > 0}
        if not pending:
            self._caught_up.set()
        while not self._stop_tailing.is_set():
            msg = self._consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("reading %s: %s", self.topic, msg.error())
                continue
            key = (msg.key() or b"").decode()
            self._apply(key, msg.value())
            if msg.partition() in pending and msg.offset() + 1 >= ends[msg.partition()]:
                pending.discard(msg.partition())
                if not pending:
                    self._caught_up.set()

    async def _start(self, timeout: float = 60.0) -> None:  # type: ignore[override]
        self._thread.start()
        ok = await asyncio.get_running_loop().run_in_executor(None, self._caught_up.wait, timeout)
        if self._error is not None:
            raise RuntimeError(f"could not read {self.topic} from Kafka: {self._error}") from self._error
        if not ok:
            raise TimeoutError(f"could not read {self.topic} from Kafka within {timeout}s")
        log.info("%s: %d records loaded", self.topic, len(self.data))

    async def _stop(self) -> None:
        self._stop_tailing.set()
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5)

    async def put(self, key: str, value: bytes | None) -> None:
        """Write through Kafka (waits for the delivery report), then update the view.

        While the caller collects confirmations (confirm_later), the view changes at once and
        the delivery report goes to the caller's list instead: what else happens under the
        caller's lock sees the write and waits for no round trip.  A write Kafka refuses puts
        the view back as it was (the input it came from is requeued and handled again)."""
        pending = _CONFIRM_LATER.get()
        if pending is None:
            await self.put_soon(key, value)
            return
        with self._lock:
            before = self.data.get(key)
        delivered = self.producer.send_soon(self.topic, value, key.encode())
        self._apply(key, value)

        async def confirmed() -> None:
            try:
                await delivered
            except BaseException:
                with self._lock:
                    untouched = self.data.get(key) == value  # no later write of the key since
                if untouched:
                    self._apply(key, before)
                raise

        pending.append(confirmed())

    def put_soon(self, key: str, value: bytes | None) -> Awaitable[None]:
        """Produce the write now, in call order; awaiting the result waits for Kafka's delivery
        report and then updates the view."""
        delivered = self.producer.send_soon(self.topic, value, key.encode())

        async def applied() -> None:
            await delivered
            self._apply(key, value)

        return applied()

    def items_for(self, device: str) -> Iterator[tuple[str, bytes]]:
        with self._lock:
            keys = sorted(self.by_device.get(device, ()))
            return iter([(k, self.data[k]) for k in keys if k in self.data])


class DesiredState:
    def __init__(self, table: KafkaTable):
        self.table = table

    async def set(self, device: str, topic: str, payload: bytes) -> None:
        # An empty retained payload clears it, as in MQTT.
        await self.table.put(f"{device}{SEP}{topic}", payload if payload else None)

    def for_device(self, device: str) -> list[tuple[str, bytes]]:
        return [(k.split(SEP, 1)[1], v) for k, v in self.table.items_for(device)]


@dataclass(frozen=True)
class Parked:
    key: str
    device: str
    topic: str
    payload: bytes
    parked_at: float
    #: when it leaves the lot: parking's TTL, or the command's own expiry if sooner
    expires_at: float
    #: the command's own expiry (x-fedgate-expires-at), epoch seconds
    command_expires_at: float | None = None
    properties: Mqtt5Properties = NO_PROPERTIES
    #: sent, and waiting for the device's acknowledgement: to this connection, how often, when last
    sent_to: str | None = None
    attempts: int = 0
    sent_at: float = 0.0

    @property
    def command_id(self) -> str:
        """The id its device acknowledges it by (contract.message_id of topic and payload)."""
        return c.message_id(self.topic, self.payload)

    def expired_reason(self, ttl_s: float) -> str:
        if self.attempts:
            return (
                f"sent {self.attempts} time(s) to a device subscribed at QoS 0, never acknowledged "
                f"on {c.device_ack_topic(self.device)}"
            )
        if self.command_expires_at is not None and self.command_expires_at <= self.expires_at:
            return "expired while parked, before the device came back (its x-fedgate-expires-at passed)"
        return f"parked for {ttl_s:g}s without the device coming back"


def properties_to_json(p: Mqtt5Properties) -> dict[str, object]:
    out: dict[str, object] = {}
    if p.user_properties:
        out["user_properties"] = [list(kv) for kv in p.user_properties]
    if p.content_type is not None:
        out["content_type"] = p.content_type
    if p.response_topic is not None:
        out["response_topic"] = p.response_topic
    if p.correlation_data is not None:
        out["correlation_data"] = base64.b64encode(p.correlation_data).decode()
    return out


def properties_from_json(d: dict[str, object] | None) -> Mqtt5Properties:
    if not d:
        return Mqtt5Properties()
    corr = d.get("correlation_data")
    return Mqtt5Properties(
        user_properties=tuple((str(k), str(v)) for k, v in d.get("user_properties") or []),  # type: ignore[attr-defined]
        content_type=d.get("content_type"),  # type: ignore[arg-type]
        response_topic=d.get("response_topic"),  # type: ignore[arg-type]
        correlation_data=base64.b64decode(corr) if isinstance(corr, str) else None,
    )


class ParkingLot:
    def __init__(self, table: KafkaTable, ttl_s: float):
        self.table = table
        self.ttl_s = ttl_s
        self._seq = 0

    async def park(
        self,
        device: str,
        topic: str,
        payload: bytes,
        *,
        command_expires_at: float | None = None,
        properties: Mqtt5Properties = NO_PROPERTIES,
        sent_to: str | None = None,
    ) -> Parked:
        """Park a command; with `sent_to`, one just sent there that waits for its acknowledgement."""
        now = time.time()
        self._seq += 1
        # sortable id: parking order survives a restart
        pid = f"{int(now * 1e6):020d}-{self._seq:06d}-{uuid.uuid4().hex[:6]}"
        until = now + self.ttl_s if command_expires_at is None else min(now + self.ttl_s, command_expires_at)
        rec = Parked(
            f"{device}{SEP}{pid}", device, topic, payload, now, until, command_expires_at, properties
        )
        if sent_to is not None:
            rec = dataclasses.replace(rec, sent_to=sent_to, attempts=1, sent_at=now)
        await self.table.put(rec.key, self._value(rec))
        return rec

    async def park_command(self, cmd: Command, payload: bytes, sent_to: str | None = None) -> Parked:
        return await self.park(
            cmd.device,
            cmd.topic,
            payload,
            command_expires_at=cmd.expires_at,
            properties=cmd.properties,
            sent_to=sent_to,
        )

    async def mark_sent(self, rec: Parked, connection: str) -> Parked:
        """It went to `connection` (once more), and waits there for its acknowledgement."""
        sent = dataclasses.replace(rec, sent_to=connection, attempts=rec.attempts + 1, sent_at=time.time())
        await self.table.put(sent.key, self._value(sent))
        return sent

    @staticmethod
    def _value(rec: Parked) -> bytes:
        record: dict[str, object] = {
            "topic": rec.topic,
            "payload": base64.b64encode(rec.payload).decode(),
            "parked_at": rec.parked_at,
            "expires_at": rec.expires_at,
        }
        if rec.command_expires_at is not None:
            record["command_expires_at"] = rec.command_expires_at
        if rec.properties != NO_PROPERTIES:
            record["properties"] = properties_to_json(rec.properties)
        if rec.sent_to is not None:
            record.update(sent_to=rec.sent_to, attempts=rec.attempts, sent_at=rec.sent_at)
        return json.dumps(record).encode()

    def for_device(self, device: str) -> list[Parked]:
        out = []
        for key, value in self.table.items_for(device):
            d = json.loads(value)
            out.append(
                Parked(
                    key,
                    device,
                    d["topic"],
                    base64.b64decode(d["payload"]),
                    d["parked_at"],
                    d["expires_at"],
                    d.get("command_expires_at"),
                    properties_from_json(d.get("properties")),
                    d.get("sent_to"),
                    d.get("attempts", 0),
                    d.get("sent_at", 0.0),
                )
            )
        return out

    def all_devices(self) -> list[str]:
        with self.table._lock:
            return list(self.table.by_device)

    async def remove(self, rec: Parked) -> None:
        await self.table.put(rec.key, None)


class PresenceStore:
    def __init__(self, table: KafkaTable):
        self.table = table

    async def save(self, session: Session) -> None:
        await self.save_soon(session)

    async def delete(self, client_id: str) -> None:
        await self.delete_soon(client_id)

    def save_soon(self, session: Session) -> Awaitable[None]:
        """Produced now (see KafkaTable.put_soon); await for Kafka's confirmation."""
        return self.table.put_soon(session.client_id, json.dumps(dataclasses.asdict(session)).encode())

    def delete_soon(self, client_id: str) -> Awaitable[None]:
        return self.table.put_soon(client_id, None)

    def load(self) -> list[Session]:
        with self.table._lock:
            values = list(self.table.data.values())
        return [Session(**json.loads(v)) for v in values]
