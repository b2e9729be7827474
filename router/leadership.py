"""Which router routes commands: one at a time, and another at once when it dies.

Every router with `downlink` on keeps presence and the waiting tables
current (its own presence queue, the compacted Kafka topics it tails), but
only one of them -- the leader -- consumes the commands and acknowledgements
queues and does what must happen once: delivering parked commands and desired
state, resending unacknowledged ones, expiring.  Two routers doing that
would deliver a parked command twice.

The leader is chosen by RabbitMQ, with nothing of fedgate's own to get
wrong: every candidate consumes `contract.LEADER_QUEUE`, a quorum queue
with single active consumer, which holds a token message.  Only the active
consumer ever receives the token; it holds it unacked for as long as it
leads.  When its connection dies -- a killed router, a SIGTERM, a partition
once the 5 s heartbeat gives up -- RabbitMQ returns the token and hands it to the
next consumer, which then leads.  The lease rides on a connection of its own,
not the robust one the rest of the router uses: a robust connection would
quietly re-register the commands consumer after a reconnect, while another
router already leads.  Losing this connection is losing the lead.

Tokens: a candidate that finds none ready puts one in, so the queue keeps a
spare beside the held one (a queue with none would elect nobody).  Extra
tokens are harmless: they reach the active consumer only, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence

import aio_pika
import aio_pika.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from backend import contract as c
from router.failover import NodeCycle
from router.lifecycle import Lifecycle, cancel_task
from router.metrics import Metrics

log = logging.getLogger(__name__)

#: How often a candidate checks that a spare token is there.
SPARE_CHECK_S = 10.0
#: The lease connection's AMQP heartbeat (s).
LEASE_HEARTBEAT_S = 5
#: Sleeps after each round of attempts to reach the backend, growing (the lease connection
#: only; router/failover.py).  A lease connection that ends counts as a failed attempt: the
#: candidate stands again after the first of them (with one node) or at once at the next node.
RECONNECT_S = (0.5, 1.0, 2.0, 5.0)

Elected = Callable[[AbstractChannel, AbstractConnection], Awaitable[None]]
Deposed = Callable[[], Awaitable[None]]


class Leadership(Lifecycle):
    def __init__(
        self, amqp_urls: Sequence[str], router_id: str, metrics: Metrics, elected: Elected, deposed: Deposed
    ):
        super().__init__()
        #: every backend node's URL: a lease connection that ends (or is refused) tries the next
        self.urls = list(amqp_urls)
        self.nodes = NodeCycle(self.urls, RECONNECT_S)
        self.router_id = router_id
        self.metrics = metrics
        self._elected = elected
        self._deposed = deposed
        self.leading = False
        #: when this router last became leader (monotonic), for logs and /health
        self.since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._connection: aio_pika.abc.AbstractConnection | None = None
        metrics.gauge("fedgate_router_leading", lambda: {(): 1.0 if self.leading else 0.0})

    async def _start(self) -> None:
        self._task = self.spawn(self._run(), "leadership")

    async def _stop(self) -> None:
        """Give up the lead: closing the connection hands the token to the next router."""
        await cancel_task(self._task)
        await self._step_down()

    async def _run(self) -> None:
        while True:
            try:
                await self._candidate()
                self.nodes.succeeded()  # it stood until the connection ended: the backoff restarts
            except asyncio.CancelledError:
                raise
            except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as e:
                log.warning("leadership: backend connection lost or refused (%r)", e)
            except Exception:  # a bug in taking over must not end candidacy for good
                log.exception("leadership: taking over failed")
            await self._step_down()
            await asyncio.sleep(self.nodes.failed())

    async def _candidate(self) -> None:
        """Stand as a candidate on a connection of its own until that connection ends."""
        # A short heartbeat: a leader cut off from the backend (a partition) loses the lead,
        # and the next router takes it, within about three heartbeats rather than minutes.
        query = urllib.parse.urlencode({"heartbeat": LEASE_HEARTBEAT_S, "name": f"{self.router_id} lease"})
        node = self.nodes.next()  # the next attempt, after this connection ends or is refused, the next node
        url = f"{node}{'&' if '?' in node else '?'}{query}"
        connection = await aio_pika.connect(url, timeout=10)
        self._connection = connection
        token = asyncio.Event()
        waiting = asyncio.ensure_future(token.wait())
        closed = asyncio.ensure_future(connection.closed())
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=1)  # one token at a time

            async def on_token(message: AbstractIncomingMessage) -> None:
                token.set()  # never acked: held for as long as this router leads

            queue = await channel.get_queue(c.LEADER_QUEUE, ensure=True)
            await queue.consume(on_token)
            log.info("%s: standing by to route commands", self.router_id)
            while not token.is_set():
                await self._keep_a_spare(channel)
                await asyncio.wait(
                    {waiting, closed}, timeout=SPARE_CHECK_S, return_when=asyncio.FIRST_COMPLETED
                )
                if closed.done():
                    return
            work = await connection.channel(publisher_confirms=True, on_return_raises=True)
            # The leader's channel carries the commands consumer: if the backend closes it
            # (a publish to an exchange deleted meanwhile), lead again from scratch, or let
            # the next router lead, rather than hold the lease and route nothing.
            work.close_callbacks.add(lambda *_: _close_soon(connection))
            self.leading, self.since = True, time.monotonic()
            self.metrics.inc("fedgate_router_elected_total")
            log.info("%s: leading: routing commands", self.router_id)
            await self._elected(work, connection)
            await self._keep_a_spare(channel)
            await closed
        finally:
            waiting.cancel()
            closed.cancel()
            self._connection = None
            if not connection.is_closed:
                await connection.close()

    async def _keep_a_spare(self, channel: AbstractChannel) -> None:
        queue = await channel.declare_queue(c.LEADER_QUEUE, passive=True)
        if queue.declaration_result.message_count == 0:
            exchange = await channel.get_exchange(c.LEADER_EXCHANGE, ensure=False)
            await exchange.publish(
                aio_pika.Message(b"lead", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=""
            )

    async def _step_down(self) -> None:
        if self._connection is not None and not self._connection.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._connection.close(), 2.0)
        if self.leading:
            self.leading = False
            log.warning("%s: no longer leading: commands go to the next router", self.router_id)
            await self._deposed()


def _close_soon(connection: AbstractConnection) -> None:
    if not connection.is_closed:
        asyncio.ensure_future(connection.close())
