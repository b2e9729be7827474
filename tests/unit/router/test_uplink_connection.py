"""The uplink's connection keeper on the node-cycling policy (fake aiormq connections)."""

from __future__ import annotations

import asyncio

import pytest

import router.uplink_connection as uc
from backend.polling import await_until
from tests.unit.router.pauses import record_sleeps


class FakeChannel:
    def __init__(self) -> None:
        self.closing = asyncio.get_running_loop().create_future()


class FakeConnection:
    def __init__(self, url: str) -> None:
        self.url = url
        self.closing = asyncio.get_running_loop().create_future()

    async def channel(self) -> FakeChannel:
        return FakeChannel()

    async def close(self) -> None:
        if not self.closing.done():
            self.closing.set_result(None)


class Backend:
    def __init__(self, up: set[str]) -> None:
        self.up = up
        self.attempts: list[tuple[str, float]] = []
        self.connections: list[FakeConnection] = []

    async def connect(self, url: str, client_properties: object = None) -> FakeConnection:
        self.attempts.append((url, asyncio.get_running_loop().time()))
        if url not in self.up:
            raise ConnectionError(f"{url} down")
        conn = FakeConnection(url)
        self.connections.append(conn)
        return conn


def test_a_lost_connection_tries_every_other_node_at_once_and_sleeps_once_per_round(monkeypatch):
    async def scenario():
        backend = Backend(up={"b"})
        monkeypatch.setattr(uc.aiormq, "connect", backend.connect)
        asked = record_sleeps(monkeypatch, uc)
        setups = []

        async def setup(channel):
            setups.append(channel)

        conn = uc.UplinkConnection(["a", "b", "c"], "test uplink", setup, interval=0.2)
        try:  # a failed check still stops the keeper: it re-cancels a cancel Python 3.11 drops
            await conn.start()
            assert [u for u, _ in backend.attempts] == ["a", "b"], "start: each node once until one answers"
            await asyncio.sleep(0.25)  # lived longer than the interval: no pause before the first try
            backend.up = set()
            backend.attempts.clear()
            asked.clear()
            backend.connections[-1].closing.set_exception(ConnectionError("node b died"))
            await asyncio.sleep(0.3)
            backend.up = {"a"}
            # a loaded machine stretches the rounds' pauses: asked, not slept, is what the
            # policy is judged by, below
            assert await await_until(lambda: conn.reconnects == 1, 10, 0.02), "reconnected"
            tried = [u for u, _ in backend.attempts]
            assert tried[:7] == ["c", "a", "b", "c", "a", "b", "c"][: len(tried[:7])]
            # c, a, b at once, one interval, c, a ...: not one interval after each failure
            assert asked[:3] == [0.0, 0.0, 0.2], asked
            assert tried[-1] == "a" and conn.reconnects == 1
            assert len(setups) == 2, "setup ran again on the new channel"
        finally:
            await conn.stop()
        await conn.stop()  # safe twice

    asyncio.run(scenario())


def test_start_fails_with_the_last_error_when_no_node_answers(monkeypatch):
    async def scenario():
        backend = Backend(up=set())
        monkeypatch.setattr(uc.aiormq, "connect", backend.connect)
        conn = uc.UplinkConnection(["a", "b"], "test uplink", lambda ch: asyncio.sleep(0), interval=5)
        with pytest.raises(ConnectionError, match="b down"):
            await asyncio.wait_for(conn.start(), 1)
        assert [u for u, _ in backend.attempts] == ["a", "b"], "one round, no sleep"
        await conn.stop()

    asyncio.run(scenario())
