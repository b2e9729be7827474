"""The router's connection to the backend cluster: any of its nodes, the next when one dies.

aio-pika's robust connection reconnects to the one URL it was given; a
router of a backend cluster (the ha profile) must move to another node
when its own dies, as RabbitMQ's own clients do with a list of hosts.
`ClusterConnection` keeps the robust connection's behaviour (channels,
queues and consumers restored after a reconnect: aio-pika's `_on_connected`
does it on every connect) and reconnects itself, on the router's one
node-cycling policy (router/failover.py): when the connection is lost it
dials the next node at once, then the others in turn, sleeping
RECONNECT_INTERVAL_S once per round that failed, so a dead node costs one
failed attempt.  A connection lost within RECONNECT_INTERVAL_S of being
made waits out the rest of it first: no tight loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aio_pika.exceptions
from aio_pika import RobustConnection
from aio_pika.abc import TimeoutType
from aio_pika.connection import Connection
from yarl import URL

from router.failover import NodeCycle
from router.lifecycle import cancel_task
from router.tasks import spawn

log = logging.getLogger(__name__)

#: Seconds between rounds of reconnect attempts (aio-pika waits 5 between attempts): the
#: next attempt goes to another node, which has no reason to be down too.
RECONNECT_INTERVAL_S = 1.0
#: what a node that is down or refuses the router raises at connect
CONNECTION_ERRORS = (OSError, TimeoutError, aio_pika.exceptions.AMQPError)


class ClusterConnection(RobustConnection):
    def __init__(self, urls: Sequence[str], **kwargs: Any):
        if not urls:
            raise ValueError("ClusterConnection: no backend URL")
        nodes = [URL(u) for u in urls]
        super().__init__(nodes[0], **kwargs)
        #: which node to dial next; one sleep of reconnect_interval after a round that failed
        self.nodes = NodeCycle(nodes, (float(self.reconnect_interval),))
        self._timeout: TimeoutType = None
        self._keeper: asyncio.Task[None] | None = None
        self._connected_at = 0.0

    async def connect(self, timeout: TimeoutType = None) -> None:
        """One attempt, at the next node (connect_cluster makes a round of them).  Once
        connected, the connection reconnects by itself until close()."""
        self._timeout = timeout
        await self._dial(self.nodes.next())
        self.nodes.succeeded()

    async def _dial(self, url: URL) -> None:
        self.transport = None
        self.connected.clear()
        self.url = url
        # aio-pika's plain connect; the robust _on_connected it calls restores the channels
        await Connection.connect(self, self._timeout)
        self._connected_at = time.monotonic()

    async def _on_connection_close(self, closing: Any) -> None:
        transport = self.transport
        # the connection in use lost, not an attempt that failed (aio-pika calls this for both)
        lost = transport is not None and transport.connection.closing is closing
        await super()._on_connection_close(closing)
        if not lost or self._close_called or self.is_closed:
            return
        if self._keeper is None or self._keeper.done():
            self._keeper = spawn(
                self._reconnect(), "backend-reconnect", "backend reconnect failed: %r", logger=log
            )

    async def _reconnect(self) -> None:
        interval = float(self.reconnect_interval)
        await asyncio.sleep(max(0.0, self._connected_at + interval - time.monotonic()))
        while not (self._close_called or self.is_closed):
            url = self.nodes.next()
            log.warning("backend connection: trying %s:%s", url.host, url.port)
            try:
                await self._dial(url)
            except Exception as e:  # as aio-pika's own loop: any failure, the next attempt
                log.warning("backend connection: %s:%s failed: %r", url.host, url.port, e)
                await asyncio.sleep(self.nodes.failed())
                continue
            if self.transport is None or self.transport.connection.is_closed:
                # lost again while its channels were being restored: that close was not ours to see
                await asyncio.sleep(self.nodes.failed())
                continue
            self.nodes.succeeded()
            log.info("backend connection: reconnected to %s:%s", url.host, url.port)
            return

    async def reconnect(self) -> None:
        """Drop the connection in use; it reconnects by itself (at the next node)."""
        if self.transport:
            await self.transport.connection.close()

    async def close(self, exc: Any = asyncio.CancelledError) -> None:
        await cancel_task(self._keeper)
        await super().close(exc)


async def connect_cluster(urls: Sequence[str], *, timeout: float = 10.0) -> ClusterConnection:
    """A robust connection to the first node of `urls` that answers (one round, no sleep);
    the error of the last one when none does (a router starting while the whole backend is
    away fails fast, as aio_pika.connect_robust does, for its supervisor to start it again)."""
    connection = ClusterConnection(urls, reconnect_interval=RECONNECT_INTERVAL_S)
    last: BaseException | None = None
    for _ in range(len(connection.nodes)):
        try:
            await connection.connect(timeout=timeout)
            return connection
        except CONNECTION_ERRORS as e:
            last = e
            connection.nodes.failed()
    await connection.close()
    assert last is not None
    raise last


class QuietChannelRestore(logging.Filter):
    """Drops aio-pika's traceback for a channel it tries to reopen before its connection is back.

    When the backend connection dies, each robust channel's close callback reopens it at once,
    finds no transport and logs that at ERROR with a traceback (aio_pika.tools); the reconnect
    then restores every channel anyway.  An operator reading the log after a node's death
    should see the one line that says where the router reconnects, not a traceback per channel."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "No active transport in channel" in str(exc))
