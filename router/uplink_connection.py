"""The uplink's own AMQP connection: aiormq, with a reconnect loop of its own.

The bridge does not consume through aio-pika, which the downlink uses: aio-pika
wraps every delivery in an IncomingMessage (26 attribute writes) and a second
task, a sixth of the router's CPU per bridged message (docs/benchmarks.md,
"Router").  An earlier try consumed on aiormq under aio-pika's robust channel
and re-registered the consumers from its reopen callbacks; after a backend
restart that channel did not always call them, and one router stopped
bridging.  So the uplink owns a plain aiormq connection and keeps it itself:

- `start()` dials the backend's nodes in turn and fails with the last error
  when none answers (a router starting while the backend is away exits, for
  its supervisor to start it again);
- once started, losing the connection or its channel -- a node that dies, a
  channel RabbitMQ closes -- makes it dial the next node at once, and the
  others in turn (router/failover.py: one sleep of RECONNECT_INTERVAL_S after
  each full round that failed) until one answers, and run `setup` on the new
  channel again (qos, consumers).  Deliveries of the lost channel that were
  not acked go back to their queues: RabbitMQ redelivers them.  A connection
  lost within RECONNECT_INTERVAL_S of being made waits that long first: no
  tight loop.

A connection of its own also keeps the uplink's deliveries off the
connection the downlink publishes commands on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import aiormq
import aiormq.abc

# aio-pika's AMQPError is aiormq's: the robust connection's errors are the uplink's too
from router.backend_connection import CONNECTION_ERRORS, RECONNECT_INTERVAL_S
from router.failover import NodeCycle
from router.lifecycle import Lifecycle, cancel_task

log = logging.getLogger(__name__)

Setup = Callable[[aiormq.abc.AbstractChannel], Awaitable[None]]


class UplinkConnection(Lifecycle):
    def __init__(
        self,
        urls: Sequence[str],
        name: str,
        setup: Setup,
        *,
        timeout: float = 10.0,
        setup_timeout: float = 30.0,
        interval: float = RECONNECT_INTERVAL_S,
    ):
        super().__init__()
        if not urls:
            raise ValueError("UplinkConnection: no backend URL")
        self.urls = list(urls)
        #: which node to dial next, and how long to sleep after a round that failed
        self.nodes = NodeCycle(self.urls, (interval,))
        self.name = name
        self.setup = setup
        self.timeout = timeout
        #: the shards' consumes on a node that answered: longer than a connect, since a node
        #: busy delivering a backlog (or on a loaded machine) answers them slowly, and a router
        #: that gives up at its start exits (the quick benchmark's did, 10 s after asking)
        self.setup_timeout = setup_timeout
        self.interval = interval
        #: how many times the connection was lost and made again (the router's metrics)
        self.reconnects = 0
        self._connection: aiormq.abc.AbstractConnection | None = None
        self._channel: aiormq.abc.AbstractChannel | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._closing = False

    async def _start(self) -> None:
        """Connect to the first node that answers (one round: each tried once) and run
        `setup`; then keep the connection up until stop()."""
        last: BaseException | None = None
        for _ in range(len(self.nodes)):
            try:
                await self._connect_once()
                break
            except CONNECTION_ERRORS as e:
                last = e
                self.nodes.failed()
        else:
            assert last is not None
            raise last
        self.nodes.succeeded()
        self._keeper = self.spawn(self._keep(), "uplink-connection")

    async def _connect_once(self) -> None:
        url = self.nodes.next()
        connection = await asyncio.wait_for(
            aiormq.connect(url, client_properties={"connection_name": self.name}), self.timeout
        )
        try:
            channel = await asyncio.wait_for(connection.channel(), self.timeout)
            await asyncio.wait_for(self.setup(channel), self.setup_timeout)
        except BaseException:
            await _close_quietly(connection)
            raise
        self._connection, self._channel = connection, channel

    async def _keep(self) -> None:
        while not self._closing:
            connection, channel = self._connection, self._channel
            assert connection is not None and channel is not None
            # either closing future ends the session; neither is awaited for its result
            since = time.monotonic()
            done, _ = await asyncio.wait(
                {connection.closing, channel.closing}, return_when=asyncio.FIRST_COMPLETED
            )
            for f in done:  # the reason is logged below; retrieved so asyncio does not log it again
                if not f.cancelled():
                    f.exception()
            if self._closing:
                return
            log.warning("%s: lost the backend connection; reconnecting", self.name)
            await _close_quietly(connection)
            self._connection = self._channel = None
            if time.monotonic() - since < self.interval:
                await asyncio.sleep(self.interval)  # lost as soon as made: no tight loop
            while not self._closing:
                try:  # at once: the next node has no reason to be down too
                    await self._connect_once()
                except CONNECTION_ERRORS as e:
                    log.warning("%s: backend unreachable (%s); trying the next node", self.name, e)
                    await asyncio.sleep(self.nodes.failed())  # once a whole round failed
                    continue
                self.nodes.succeeded()
                self.reconnects += 1
                log.info("%s: reconnected", self.name)
                break

    async def _stop(self) -> None:
        """Close the connection; RabbitMQ requeues every delivery not acked."""
        self._closing = True
        await cancel_task(self._keeper)
        if self._connection is not None:
            await _close_quietly(self._connection)
        self._connection = self._channel = None


async def _close_quietly(connection: aiormq.abc.AbstractConnection) -> None:
    with contextlib.suppress(*CONNECTION_ERRORS, asyncio.CancelledError, RuntimeError):
        await asyncio.wait_for(connection.close(), 5.0)
