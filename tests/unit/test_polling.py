"""wait_until / await_until: asked at once, every interval, once more at the deadline."""

from __future__ import annotations

import asyncio

from backend.polling import await_until, wait_until


class Clock:
    """A fake monotonic clock that only sleeping moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_a_true_answer_at_once_returns_it_without_sleeping():
    clock = Clock()
    assert wait_until(lambda: "yes", 5, 1, clock=clock, sleep=clock.sleep) == "yes"
    assert clock.sleeps == []


def test_it_asks_every_interval_until_the_answer_is_true_and_returns_that_answer():
    clock = Clock()
    answers = iter([0, [], None, 7])
    asked: list[float] = []

    def predicate():
        asked.append(clock.now)
        return next(answers)

    assert wait_until(predicate, 10, 0.5, clock=clock, sleep=clock.sleep) == 7
    assert asked == [100.0, 100.5, 101.0, 101.5]
    assert clock.sleeps == [0.5, 0.5, 0.5]


def test_a_timeout_returns_the_last_false_answer_after_a_last_look_at_the_deadline():
    clock = Clock()
    asked: list[float] = []

    def predicate():
        asked.append(clock.now)
        return []

    assert wait_until(predicate, 2, 0.5, clock=clock, sleep=clock.sleep) == []
    # asked at 100, 100.5, 101, 101.5 and once at the deadline (102), then no more
    assert asked == [100.0, 100.5, 101.0, 101.5, 102.0]
    assert clock.now == 102.0, "it does not sleep past the deadline"


def test_a_zero_timeout_asks_once():
    clock = Clock()
    calls = []
    assert wait_until(lambda: calls.append(1), 0, 1, clock=clock, sleep=clock.sleep) is None
    assert calls == [1] and clock.sleeps == []


def test_await_until_waits_on_the_event_loop_and_gives_up_at_the_deadline():
    async def scenario():
        flag = {"set": False}
        asyncio.get_running_loop().call_later(0.05, lambda: flag.update(set=True))
        t0 = asyncio.get_running_loop().time()
        assert await await_until(lambda: flag["set"], 5, 0.01) is True
        assert asyncio.get_running_loop().time() - t0 < 1
        t0 = asyncio.get_running_loop().time()
        assert await await_until(lambda: False, 0.1, 0.02) is False
        assert 0.09 < asyncio.get_running_loop().time() - t0 < 1

    asyncio.run(scenario())
