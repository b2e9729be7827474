"""The router's connection to the backend cluster: any of its nodes, the next when one dies.

aio-pika's robust connection reconnects to the one URL it was given; a
router of a backend cluster (the ha profile) must move to another node
when its own dies, as RabbitMQ's own clients do with a list of hosts.
`ClusterConnection` keeps the robust connection's behaviour (channels,
queues and consumers restored after a reconnect) and only changes where
each reconnect goes: every attempt after the first dials the next node of
the list, round and round, so a dead node costs one failed attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import aio_pika.exceptions
from aio_pika import RobustConnection
from yarl import URL

log = logging.getLogger(__name__)

#: Seconds between reconnect attempts (aio-pika waits 5): the next attempt goes to another
#: node, which has no reason to be down too.
RECONNECT_INTERVAL_S = 1.0
#: what a node that is down or refuses the router raises at connect
CONNECTION_ERRORS = (OSError, TimeoutError, aio_pika.exceptions.AMQPError)


class ClusterConnection(RobustConnection):
    def __init__(self, urls: Sequence[str], **kwargs: Any):
        if not urls:
            raise ValueError("ClusterConnection: no backend URL")
        nodes = [URL(u) for u in urls]
        super().__init__(nodes[0], **kwargs)
        self._attempts = 0
        self._nodes = nodes  # from here on the transport's setter picks the node

    # RobustConnection clears its transport before each connection attempt (its private
    # reconnect loop dials self.url); that is the one place a subclass can pick the node.
    @property  # type: ignore[override]
    def transport(self) -> Any:
        return self.__dict__.get("_cluster_transport")

    @transport.setter
    def transport(self, value: Any) -> None:
        nodes = self.__dict__.get("_nodes")
        if value is None and nodes is not None and self.__dict__.get("_cluster_transport") is None:
            # a new attempt: the first goes to the first node, each later one to the next
            self.url = nodes[self._attempts % len(nodes)]
            if self._attempts:
                log.warning("backend connection: trying %s:%s", self.url.host, self.url.port)
            self._attempts += 1
        self.__dict__["_cluster_transport"] = value

    async def _on_connection_close(self, closing: Any) -> None:
        # lost the node it had: the reconnect that follows dials the next one
        self.__dict__["_cluster_transport"] = None
        await super()._on_connection_close(closing)


async def connect_cluster(urls: Sequence[str], *, timeout: float = 10.0) -> ClusterConnection:
    """A robust connection to the first node of `urls` that answers; the error of the last
    one when none does (a router starting while the whole backend is away fails fast, as
    aio_pika.connect_robust does, for its supervisor to start it again)."""
    last: BaseException | None = None
    for i in range(len(urls)):
        connection = ClusterConnection([*urls[i:], *urls[:i]], reconnect_interval=RECONNECT_INTERVAL_S)
        try:
            await connection.connect(timeout=timeout)
            return connection
        except CONNECTION_ERRORS as e:
            last = e
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
