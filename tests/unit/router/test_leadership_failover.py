"""The lease connection's candidacy loop on the node-cycling policy (its _candidate faked)."""

from __future__ import annotations

import asyncio

import router.leadership as leadership
from router.metrics import Metrics


def _sleeps(monkeypatch, urls: list[str], script: list[str]) -> tuple[list[float], list[str]]:
    """Run the candidacy loop through `script` ("ends": the lease connection ended after
    standing; "refused": the node did not answer); the sleeps between attempts and the
    nodes dialled."""
    sleeps: list[float] = []
    dialled: list[str] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)
        await real_sleep(0)

    async def scenario() -> None:
        lead = leadership.Leadership(urls, "r-0", Metrics(), elected=None, deposed=None)  # type: ignore[arg-type]
        steps = iter(script)
        done = asyncio.Event()

        async def candidate() -> None:
            dialled.append(lead.nodes.next())
            step = next(steps, None)
            if step is None:
                done.set()
                await real_sleep(10)
            if step == "refused":
                raise ConnectionRefusedError("no")

        lead._candidate = candidate  # type: ignore[method-assign]
        monkeypatch.setattr(leadership.asyncio, "sleep", fake_sleep)
        task = asyncio.create_task(lead._run())
        await asyncio.wait_for(done.wait(), 5)
        task.cancel()

    asyncio.run(scenario())
    return sleeps, dialled


SCRIPT = ["ends", "refused", "refused", "refused", "refused", "ends", "refused"]


def test_with_one_node_the_waits_are_as_before_half_a_second_after_a_lease_then_growing(monkeypatch):
    sleeps, dialled = _sleeps(monkeypatch, urls=["amqp://a/"], script=SCRIPT)
    assert sleeps == [0.5, 1.0, 2.0, 5.0, 5.0, 0.5, 1.0]
    assert set(dialled) == {"amqp://a/"}


def test_with_three_nodes_the_next_node_is_dialled_at_once_and_it_sleeps_once_per_round(monkeypatch):
    urls = ["amqp://a/", "amqp://b/", "amqp://c/"]
    sleeps, dialled = _sleeps(monkeypatch, urls=urls, script=SCRIPT)
    assert sleeps == [0, 0, 0.5, 0, 0, 0, 0]
    assert dialled == [*urls, *urls, *urls[:2]]
