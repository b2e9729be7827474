"""Acks for the uplink bridge, coalesced: one frame covers many messages.

One ack frame per message costs more than bridging the message.  Kafka's
delivery reports arrive out of order across partitions, so acks are
coalesced: once every delivery tag up to N is settled, a single
basic.ack(N, multiple=True) covers them all; a message Kafka refused is
nacked back to RabbitMQ first, in tag order.  A message is still acked only
after its own record is in Kafka.  One writer sends the frames, in order.

Tags belong to one channel.  After a connection loss the uplink's new channel
(router/uplink_connection.py) starts its tags again at 1 while records of the
old channel may still be on their way to Kafka.  Their reports must not
settle the new channel's messages of the same tag: a later multiple ack would
then ack a message whose record Kafka had not stored, and a shard handed to
another router on that ack has two producers on its partition.  So the old
channel's reports are ignored: RabbitMQ redelivers its unacked messages, and
what the old records wrote are duplicates.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from aiormq.abc import DeliveredMessage

from router.backend_connection import CONNECTION_ERRORS
from router.tasks import watch

log = logging.getLogger(__name__)


class CoalescedAcks:
    def __init__(self) -> None:
        # delivery tags in arrival order, and those whose Kafka record is settled, of one channel
        self._channel: object | None = None
        self._outstanding: collections.deque[int] = collections.deque()
        self._done: dict[int, tuple[DeliveredMessage, bool]] = {}
        self._flush_scheduled = False
        self._ops: collections.deque[tuple[str, DeliveredMessage]] = collections.deque()
        self._writer: asyncio.Future[None] | None = None

    def track(self, channel: object, delivery_tag: int | None) -> int:
        """Note a delivery of `channel`, the one deliveries now come on; its tag."""
        if channel is not self._channel:
            self._channel = channel
            self._outstanding.clear()
            self._done.clear()
            # acks for the lost channel mean nothing now; a writer still waiting for that
            # channel's connection to send one would wait for ever and hold back the new
            # channel's acks, and with them its deliveries (the prefetch fills up)
            self._ops.clear()
            if self._writer is not None and not self._writer.done():
                self._writer.cancel()
        tag = delivery_tag or 0  # always set: the bridge consumes with acks
        self._outstanding.append(tag)
        return tag

    def settled(self, channel: object, tag: int, message: DeliveredMessage, *, ok: bool) -> None:
        """The delivery's record is in Kafka (ok) or goes back to RabbitMQ (not ok)."""
        if channel is not self._channel:
            return  # a closed channel's message: RabbitMQ has redelivered it
        self._done[tag] = (message, ok)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        last_ok: DeliveredMessage | None = None
        while self._outstanding and self._outstanding[0] in self._done:
            msg, ok = self._done.pop(self._outstanding.popleft())
            if ok:
                last_ok = msg
                continue
            if last_ok is not None:
                self._ops.append(("ack", last_ok))
                last_ok = None
            self._ops.append(("nack", msg))
        if last_ok is not None:
            self._ops.append(("ack", last_ok))
        if self._ops and (self._writer is None or self._writer.done()):
            self._writer = watch(asyncio.ensure_future(self._write()), "ack/nack failed: %s", logger=log)

    async def _write(self) -> None:
        while self._ops:
            op, msg = self._ops.popleft()
            channel = msg.channel  # the current one: track drops a lost channel's ops
            if channel.is_closed:
                continue  # gone with its connection: RabbitMQ redelivers what it had not acked
            try:
                if op == "ack":
                    await channel.basic_ack(msg.delivery_tag or 0, multiple=True)
                else:
                    await channel.basic_nack(msg.delivery_tag or 0, requeue=True)
            except (*CONNECTION_ERRORS, RuntimeError) as e:
                # the channel is gone: RabbitMQ redelivers whatever was not acked
                log.warning("could not %s up to delivery tag %s: %s", op, msg.delivery_tag, e)

    async def drain(self, timeout_s: float) -> None:
        """Send the acks still queued (shutdown), waiting at most timeout_s."""
        self._flush()
        if self._writer is not None:
            try:
                # bounded: with the backend gone the acks cannot be sent (RabbitMQ redelivers)
                await asyncio.wait_for(asyncio.shield(self._writer), timeout_s)
            except TimeoutError:
                log.warning("acks not confirmed sent within %.0f s; RabbitMQ redelivers those", timeout_s)
