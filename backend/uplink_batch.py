"""Uplink batches: many device readings in one AMQP message across the WAN hop.

Why: what a reading costs the federation is mostly what it wakes on its way
(the backend's federation link, its shard queue, a router, a Kafka request),
not work.  A gateway that packs the readings of a few milliseconds into one
message wakes each of those once per batch (docs/benchmarks.md, "Batching
before the WAN hop").  The gateway's batcher (gateways/uplink_batcher_plugin)
writes this format; the router (router/bridge.py) reads it and bridges each
reading as if it had come alone.

A batch is an AMQP message whose content type is BATCH_CONTENT_TYPE and
whose body is, for each reading in arrival order:

    u16 routing key length, routing key (the MQTT topic as RabbitMQ routes it)
    u32 properties length, the reading's AMQP 0-9-1 basic properties in their wire
        format (16-bit property flags, then the fields the flags name)
    u32 body length, body

all integers big-endian.  The batch's own headers are the hop's
(`x-received-from`, added by the backend's federation link); a reading's
properties are what RabbitMQ's MQTT plugin gave it on the gateway.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pamqp.commands import Basic

from backend.contract import FIRST_READING_AT_HEADER, RECEIVED_FROM_HEADER

BATCH_CONTENT_TYPE = "application/vnd.fedgate.uplink-batch.v1"

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class MalformedBatch(ValueError):
    """A batch body that does not parse: the text says where."""


@dataclass
class Reading:
    """One device message of a batch."""

    routing_key: str
    body: bytes
    properties: Basic.Properties = field(default_factory=Basic.Properties)


def encode(readings: Iterable[Reading]) -> bytes:
    """A batch's body (the gateway's batcher writes the same bytes)."""
    out = bytearray()
    for r in readings:
        key = r.routing_key.encode()
        props = r.properties.marshal()
        out += _U16.pack(len(key)) + key
        out += _U32.pack(len(props)) + props
        out += _U32.pack(len(r.body)) + r.body
    return bytes(out)


def readings(batch_body: bytes, batch_headers: dict[str, Any] | None) -> Iterator[Reading]:
    """The readings of a batch as device messages: each with the batch's hop header
    (`x-received-from`, hence its region) added to its own headers.  Readings whose
    properties were the same bytes share one properties object (decode): read-only."""
    hops = (batch_headers or {}).get(RECEIVED_FROM_HEADER)
    given: set[int] = set()  # the properties objects that have the hop already
    for r in decode(batch_body):
        if hops is not None and id(r.properties) not in given:
            r.properties.headers = {**(r.properties.headers or {}), RECEIVED_FROM_HEADER: hops}
            given.add(id(r.properties))
        yield r


def first_reading_at(batch_headers: dict[str, Any] | None) -> float | None:
    """When the batch's first reading reached its gateway's batcher, in seconds since the epoch
    (its FIRST_READING_AT_HEADER; None without it, as from a gateway older than the header)."""
    at = (batch_headers or {}).get(FIRST_READING_AT_HEADER)
    return at / 1000 if isinstance(at, int) and not isinstance(at, bool) else None


def decode(body: bytes) -> Iterator[Reading]:
    """The readings of a batch's body, in order; MalformedBatch at the first that does not parse."""
    view = memoryview(body)
    at, n = 0, 0
    # a gateway's readings mostly carry the same property bytes (what the MQTT plugin gives
    # every QoS 1 publish): parsed once a batch, not once a reading (a fifth of a router's
    # time a reading went to parsing them, docs/benchmarks.md)
    parsed: dict[bytes, Basic.Properties] = {}
    while at < len(view):
        try:
            (klen,) = _U16.unpack_from(view, at)
            key = bytes(view[at + 2 : at + 2 + klen]).decode()
            at += 2 + klen
            (plen,) = _U32.unpack_from(view, at)
            props = bytes(view[at + 4 : at + 4 + plen])
            at += 4 + plen
            (blen,) = _U32.unpack_from(view, at)
            data = bytes(view[at + 4 : at + 4 + blen])
            at += 4 + blen
            if at > len(view) or len(props) < 2:
                raise MalformedBatch(f"reading {n} runs past the end of the batch ({len(view)} bytes)")
            properties = parsed.get(props)  # type: ignore[assignment]
            if properties is None:
                properties = Basic.Properties()
                properties.unmarshal(_U16.unpack_from(props)[0], props[2:])
                parsed[props] = properties
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            if isinstance(e, MalformedBatch):
                raise
            raise MalformedBatch(f"reading {n} at byte {at} does not parse: {e}") from e
        yield Reading(key, data, properties)
        n += 1
