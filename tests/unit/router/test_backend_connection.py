"""The router's backend connection picks a node per attempt: the first, then round the list."""

from __future__ import annotations

import asyncio
import socket

import pytest

from router.backend_connection import ClusterConnection, connect_cluster


def _dead_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_connection_attempt_after_the_first_dials_the_next_node():
    async def attempts() -> list[int | None]:
        conn = ClusterConnection([f"amqp://u:p@127.0.0.1:{p}/" for p in (1, 2, 3)])
        seen = []
        for _ in range(4):
            conn.transport = None  # what the robust connection does before each attempt
            seen.append(conn.url.port)
        conn.transport = object()  # connected ...
        conn.__dict__["_cluster_transport"] = None  # ... and lost (_on_connection_close)
        conn.transport = None
        seen.append(conn.url.port)
        return seen

    assert asyncio.run(attempts()) == [1, 2, 3, 1, 2]


def test_connecting_to_a_cluster_none_of_whose_nodes_answers_fails_fast_with_the_last_error():
    ports = [_dead_port() for _ in range(2)]
    urls = [f"amqp://u:p@127.0.0.1:{p}/" for p in ports]
    # ConnectionError, not OSError: wait_for's TimeoutError is an OSError too, so a
    # connect_cluster that kept retrying until the 20 s ran out would have passed
    with pytest.raises(ConnectionError, match=rf"\b{ports[-1]}\b"):
        asyncio.run(asyncio.wait_for(connect_cluster(urls, timeout=2), 20))


def test_a_channel_reopened_before_its_connection_is_back_logs_no_traceback():
    import logging

    from aiormq.exceptions import ChannelInvalidStateError

    from router.backend_connection import QuietChannelRestore

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            "aio_pika.tools", logging.ERROR, "", 0, "Callback error", (), (type(exc), exc, None)
        )

    quiet = QuietChannelRestore()
    assert not quiet.filter(record(ChannelInvalidStateError("No active transport in channel")))
    assert quiet.filter(record(RuntimeError("something else"))), "other errors are still logged"
