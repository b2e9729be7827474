"""The router's state, kept in compacted Kafka topics: desired state, presence, parked commands.

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
- ``fedgate.router.parked``: the parking lot (router/parking.py).

Writes made while the caller collects confirmations (confirm_later) are seen
at once and confirmed by Kafka after the caller's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from backend.kafka_read import not_yet
from router.kafka import AsyncProducer, KafkaClient, client_config
from router.lifecycle import Lifecycle
from router.presence import Session

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
    except BaseException:
        # what was collected will not be awaited (the input is requeued and handled again):
        # closed, rather than left to warn "never awaited" (a backend node's death did so)
        for confirmation in pending:
            if inspect.iscoroutine(confirmation):
                confirmation.close()
        raise
    finally:
        _CONFIRM_LATER.reset(token)


async def confirmed_later(delivered: Awaitable[Any]) -> None:
    """A write that is not a table's (a dead letter): its confirmation joins the collected
    ones when the caller collects them (confirm_later), so no Kafka round trip is waited
    for under the caller's lock; otherwise it is awaited here."""
    pending = _CONFIRM_LATER.get()
    if pending is None:
        await delivered
    else:
        pending.append(delivered)


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

    def __init__(self, client: KafkaClient, topic: str, producer: AsyncProducer, name: str):
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
                **client_config(client),
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
        leader yet (NOT_LEADER_FOR_PARTITION, "coordinator load in progress"): retried; any
        other error (a refused authorization) is raised at once."""
        deadline = time.monotonic() + timeout
        ends = {}
        for tp in parts:
            while True:
                try:
                    _, ends[tp.partition] = self._consumer.get_watermark_offsets(tp, timeout=10)
                    break
                except KafkaException as e:
                    if not not_yet(e) or time.monotonic() > deadline:
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

    def _partitions(self, timeout: float = 45.0) -> list[TopicPartition]:
        """The topic's partitions, from the beginning.  Right after the topic was created the
        metadata can list none: a view assigned none then tails nothing, ever -- a standby
        router so never saw what the leader parked, and lost it on taking over (2026-12-06).
        So an empty list is asked again, as a leader not known yet is."""
        deadline = time.monotonic() + timeout
        while True:
            md = self._consumer.list_topics(self.topic, timeout=10)
            meta = md.topics.get(self.topic)
            if meta is not None and meta.error is None and meta.partitions:
                return [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)]
            why = "not in the metadata" if meta is None else (meta.error or "no partitions listed")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.topic}: {why} after {timeout:.0f}s")
            log.info("%s has no partitions to read yet (%s); retrying", self.topic, why)
            time.sleep(0.5)

    def _follow(self) -> None:
        parts = self._partitions()
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


class PresenceStore:
    """The presence table, written through to a compacted topic, one record per device.

    A device that goes offline keeps a record that says so, not a tombstone:
    a restarted router must still know the device exists, or it would take it
    for one never seen and broadcast its commands (which every gateway drops,
    nobody being subscribed) instead of parking them until it comes back.
    """

    def __init__(self, table: KafkaTable):
        self.table = table

    async def save(self, session: Session) -> None:
        await self.save_soon(session)

    async def offline(self, client_id: str) -> None:
        await self.offline_soon(client_id)

    def save_soon(self, session: Session) -> Awaitable[None]:
        """Produced now (see KafkaTable.put_soon); await for Kafka's confirmation."""
        return self.table.put_soon(session.client_id, json.dumps(dataclasses.asdict(session)).encode())

    def offline_soon(self, client_id: str) -> Awaitable[None]:
        return self.table.put_soon(client_id, json.dumps({OFFLINE: True}).encode())

    def _records(self) -> dict[str, dict[str, Any]]:
        with self.table._lock:
            items = list(self.table.data.items())
        return {k: json.loads(v) for k, v in items}

    def load(self) -> list[Session]:
        """The sessions live when they were last written."""
        return [Session(**r) for r in self._records().values() if not r.get(OFFLINE)]

    def seen(self) -> set[str]:
        """Every device ever seen connected, online or not."""
        return set(self._records())


#: A presence record of a device that went offline.
OFFLINE = "offline"
