"""Which backend node to dial next, and how long to wait first: one policy for every
connection the router keeps (router/backend_connection.py, router/uplink_connection.py,
router/leadership.py).

The nodes are tried in turn, each once, without a pause between them: the next node has
no reason to be down too.  Only when a whole round has failed does the caller sleep, once,
before the next round; the sleeps grow along `intervals` (the last one repeats) and start
again from the first after a success -- kombu's failover strategies work the same way.
With one node, every failed attempt ends a round.

    cycle = NodeCycle(urls, intervals=(1.0,))
    while True:
        url = cycle.next()
        try:
            connection = await connect(url)
        except CONNECTION_ERRORS:
            await asyncio.sleep(cycle.failed())
            continue
        cycle.succeeded()
        break

What a connection that is lost after a success counts as is the caller's to say: the
uplink and the backend connection start a fresh round at the next node (it is not a failed
attempt), the lease connection counts it as one (it waits before standing again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class NodeCycle(Generic[T]):
    def __init__(self, nodes: Sequence[T], intervals: Sequence[float] = (1.0,)):
        if not nodes:
            raise ValueError("NodeCycle: no node")
        if not intervals or min(intervals) < 0:
            raise ValueError("NodeCycle: intervals must be one or more seconds >= 0")
        self.nodes = list(nodes)
        self.intervals = tuple(intervals)
        #: index of the node next() returns
        self._next = 0
        #: failed attempts since the last success
        self._failures = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def next(self) -> T:
        """The node to try now: the one after the node tried last, round and round."""
        node = self.nodes[self._next % len(self.nodes)]
        self._next += 1
        return node

    def failed(self) -> float:
        """An attempt failed: seconds to sleep before the next one (0 within a round)."""
        self._failures += 1
        rounds, within = divmod(self._failures, len(self.nodes))
        if within:
            return 0.0
        return self.intervals[min(rounds, len(self.intervals)) - 1]

    def succeeded(self) -> None:
        """An attempt succeeded: the next failure starts a new round, at the first interval."""
        self._failures = 0
