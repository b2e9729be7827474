"""Gateway nodes that stop: their sessions end within seconds, not at the next connection list.

A gateway node that dies (SIGKILL, a machine lost) takes its devices' connections with it
and says nothing: no close events.  The events of those devices connecting again at the
region's other nodes can be lost with it too, when it led the queue of the region's presence
link (the broker's event exchange publishes without confirms).  Until the router learns of
it -- the devices' return, or its next connection list, every `presence_reconcile_s` (30 s)
-- it goes on sending to their dead sessions: what reaches no queue comes back from the
gateway and is sent again, every ~0.1-0.2 s per command; what a queue of the dead node had
taken is booked in the router's memory only (router/waiting.py: sent as a connection ends,
parked again when the end shows), and a leading router that dies meanwhile takes that with
it.

So each router asks every region's cluster which of its nodes run, every NODE_WATCH_S (one
management call: /api/nodes, two columns).  The sessions of a node that does not run end
then, as the list would end them: what was sent to them since the node was last seen running
is parked again for the devices' next sessions (in Kafka, before the next check), what comes
for them is parked rather than bounced, and the region's new sessions settle
(router/waiting.py, NODE_LOSS_SETTLE_S).  A node that runs again is left to the events and
the lists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from backend.rabbitmq_admin import AdminError
from router.presence_feed import PresenceFeed
from router.stores import all_confirmed, confirm_later
from router.tasks import every

log = logging.getLogger(__name__)

#: How often each region's cluster is asked which of its nodes run.
NODE_WATCH_S = 2.0
#: How often a region whose gateway is one node is asked (whether it became a cluster): its
#: node's death is its gateway's, which the gateway checks treat (router/gateways.py).
ONE_NODE_EVERY_S = 60.0


class NodeWatch:
    def __init__(self, feed: PresenceFeed, lock: asyncio.Lock, node_lost: Callable[[str, float], None]):
        """`feed`'s presence and gateways are the ones watched; `lock` is the downlink's."""
        self.gateways = feed.gateways
        self.presence = feed.presence
        self.feed = feed
        self._lock = lock
        self._node_lost = node_lost
        #: (region, node) -> when it was last seen running (epoch s)
        self._running_at: dict[tuple[str, str], float] = {}
        #: (region, node) of the nodes seen stopped, logged once per stop
        self._stopped: set[tuple[str, str]] = set()
        #: region -> (when last asked, monotonic; how many nodes it listed)
        self._asked: dict[str, tuple[float, int]] = {}

    async def check(self) -> int:
        """One round over the regions; returns how many sessions it ended."""
        ended = 0
        for region in list(self.gateways.regions):
            if not self.gateways.allows(region, "nodes"):
                continue
            asked_at, listed = self._asked.get(region, (0.0, 0))
            if listed == 1 and time.monotonic() - asked_at < ONE_NODE_EVERY_S:
                continue
            try:
                nodes = await self.gateways.nodes(region)
            except AdminError:
                continue  # a region that does not answer: the gateway checks treat it
            self._asked[region] = (time.monotonic(), len(nodes))
            now = time.time()
            for node, running in nodes.items():
                key = (region, node)
                if running:
                    self._running_at[key] = now
                    self._stopped.discard(key)
                    continue
                last_running = self._running_at.get(key)
                if key not in self._stopped:
                    self._stopped.add(key)
                    log.warning(
                        "gateway node %s of %s is not running: its sessions end now%s",
                        node,
                        region,
                        ""
                        if last_running is None
                        else f" (last seen running {now - last_running:.1f} s ago)",
                    )
                    if last_running is not None:
                        self._node_lost(region, last_running)
                ended += await self._end_sessions_of(region, node, last_running)
        return ended

    async def _end_sessions_of(self, region: str, node: str, last_running: float | None) -> int:
        async with confirm_later() as pending, self._lock:
            on_it = [s for s in self.presence.sessions() if s.region == region and s.node == node]
            for s in on_it:
                await self.feed.end(s, last_running)
        if pending:
            await all_confirmed(pending)
        return len(on_it)

    async def run(self) -> None:
        """Check every NODE_WATCH_S; a round that fails is logged, the next one tries again."""
        await every(NODE_WATCH_S, self.check, "watching the gateways' nodes failed", logger=log)
