"""The parking lot: commands waiting for their device, in a compacted Kafka topic.

``fedgate.router.parked`` (a stores.KafkaTable): key ``<device> NUL <parked
id>``, value JSON {topic, payload (base64), parked_at, expires_at, and when
the command had them: its own expiry ``command_expires_at`` and its MQTT 5
``properties``; once sent to a device that acknowledges itself, ``sent_to``,
``attempts``, ``sent_at``; sent to a session as a gateway node of its region
died, ``settles_at``}.  Delivered in parking order when the device
subscribes to a matching topic, then tombstoned -- a command for a device
subscribed at QoS 0 only when the device acknowledged it (router/acks.py).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass

from backend import contract as c
from gateways.mqtt_plugin import NO_PROPERTIES, Mqtt5Properties
from router.routing import Command
from router.stores import SEP, KafkaTable


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
    #: parked again because its connection ended as it was sent (router/waiting.py): the
    #: next send is the last, so a device that always leaves at once does not loop on it
    again: bool = False
    #: sent to a session that opened as a gateway node of its region died (router/waiting.py,
    #: NODE_LOSS_SETTLE_S): waits at `sent_to` until then, and is sent once more after
    settles_at: float | None = None

    def command(self) -> Command:
        """The command as it was parked, to be sent on."""
        return Command(
            self.device, self.topic, expires_at=self.command_expires_at, properties=self.properties
        )

    @property
    def command_id(self) -> str:
        """The id its device acknowledges it by (contract.message_id of topic and payload)."""
        return c.message_id(self.topic, self.payload)

    def expired_reason(self, ttl_s: float) -> str:
        if self.settles_at is not None:
            return (
                "sent as a gateway node of its region died (it may have arrived), and the device "
                "was not back to have it again before it expired"
            )
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
        again: bool = False,
        settles_at: float | None = None,
    ) -> Parked:
        """Park a command; with `sent_to`, one just sent there that waits for its acknowledgement
        or, with `settles_at`, for that time to be sent again; `again`: one sent as its
        connection ended."""
        now = time.time()
        self._seq += 1
        # sortable id: parking order survives a restart
        pid = f"{int(now * 1e6):020d}-{self._seq:06d}-{uuid.uuid4().hex[:6]}"
        # one kept to be sent again when its settling is over lives parking's TTL from then:
        # expired before, it would go to the dead-letter topic instead of to the device
        start = now if settles_at is None else max(now, settles_at)
        until = (
            start + self.ttl_s if command_expires_at is None else min(start + self.ttl_s, command_expires_at)
        )
        rec = Parked(
            f"{device}{SEP}{pid}", device, topic, payload, now, until, command_expires_at, properties
        )
        if sent_to is not None:
            rec = dataclasses.replace(rec, sent_to=sent_to, attempts=1, sent_at=now)
        if again:
            rec = dataclasses.replace(rec, again=True)
        if settles_at is not None:
            rec = dataclasses.replace(rec, settles_at=settles_at)
        await self.table.put(rec.key, self._value(rec))
        return rec

    async def park_command(
        self,
        cmd: Command,
        payload: bytes,
        sent_to: str | None = None,
        again: bool = False,
        settles_at: float | None = None,
    ) -> Parked:
        return await self.park(
            cmd.device,
            cmd.topic,
            payload,
            command_expires_at=cmd.expires_at,
            properties=cmd.properties,
            sent_to=sent_to,
            again=again,
            settles_at=settles_at,
        )

    async def mark_sent(self, rec: Parked, connection: str) -> Parked:
        """It went to `connection` (once more), and waits there for its acknowledgement."""
        sent = dataclasses.replace(
            rec, sent_to=connection, attempts=rec.attempts + 1, sent_at=time.time(), settles_at=None
        )
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
        if rec.again:
            record["again"] = True
        if rec.settles_at is not None:
            record["settles_at"] = rec.settles_at
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
                    bool(d.get("again", False)),
                    d.get("settles_at"),
                )
            )
        return out

    def all_devices(self) -> list[str]:
        with self.table._lock:
            return list(self.table.by_device)

    async def remove(self, rec: Parked) -> None:
        await self.table.put(rec.key, None)
