"""Background tasks: a failure logged once, in one place; a periodic loop that survives its
steps' exceptions and ends when cancelled; a Lifecycle part that sees its task die."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from router.lifecycle import Lifecycle, cancel_task
from router.tasks import every, spawn, watch


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_task_that_fails_is_logged_once_and_asyncio_does_not_log_it_again(caplog):
    async def boom():
        raise ValueError("refused")

    seen: list[BaseException] = []

    async def scenario():
        task = spawn(boom(), "boom", "the boom task failed: %r", on_failure=seen.append)
        await asyncio.sleep(0.01)
        assert task.done()
        del task  # "exception was never retrieved" would be logged here if nobody had looked

    caplog.set_level(logging.ERROR)
    asyncio.run(scenario())
    assert _errors(caplog) == ["the boom task failed: ValueError('refused')"]
    assert [repr(e) for e in seen] == ["ValueError('refused')"]


def test_a_cancelled_or_successful_future_is_no_failure(caplog):
    async def scenario():
        ok = watch(asyncio.ensure_future(asyncio.sleep(0)), "failed: %r")
        sleeper = watch(asyncio.ensure_future(asyncio.sleep(10)), "failed: %r")
        await ok
        await cancel_task(sleeper)
        await asyncio.sleep(0)

    caplog.set_level(logging.ERROR)
    asyncio.run(scenario())
    assert _errors(caplog) == []


def test_the_message_is_logged_on_the_callers_logger_as_given(caplog):
    async def scenario():
        f = asyncio.get_running_loop().create_future()
        watch(f, "ack/nack failed: %s", logger=logging.getLogger("router.uplink_acks"))
        f.set_exception(RuntimeError("channel gone"))
        await asyncio.sleep(0)

    caplog.set_level(logging.ERROR)
    asyncio.run(scenario())
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("router.uplink_acks", "ack/nack failed: channel gone")
    ]


def test_every_runs_on_time_survives_failing_steps_and_stops_when_cancelled(caplog):
    runs: list[int] = []

    async def step():
        runs.append(len(runs))
        if len(runs) in (1, 3):
            raise RuntimeError(f"round {len(runs)}")

    async def scenario():
        task = asyncio.create_task(every(0.02, step, "the round failed", first_after=0.0))
        for _ in range(500):  # rounds, not a time: a loaded machine runs them late
            if len(runs) >= 4:
                break
            await asyncio.sleep(0.01)
        assert len(runs) >= 4, "the rounds after a failing one still run"
        await cancel_task(task)
        assert task.cancelled()
        n = len(runs)
        await asyncio.sleep(0.06)
        assert len(runs) == n, "no round after the cancel"

    caplog.set_level(logging.ERROR)
    asyncio.run(scenario())
    assert _errors(caplog) == [
        "the round failed: RuntimeError('round 1')",
        "the round failed: RuntimeError('round 3')",
    ]


def test_every_waits_a_full_interval_before_its_first_round_unless_told_otherwise():
    runs: list[float] = []

    async def step():
        runs.append(asyncio.get_running_loop().time())

    async def scenario():
        t0 = asyncio.get_running_loop().time()
        task = asyncio.create_task(every(0.1, step, "x"))
        await asyncio.sleep(0.05)
        assert runs == []
        await asyncio.sleep(0.1)
        await cancel_task(task)
        assert len(runs) == 1 and runs[0] - t0 >= 0.1

    asyncio.run(scenario())


def test_every_with_traceback_logs_the_message_and_the_traceback(caplog):
    async def step():
        raise KeyError("bug")

    async def scenario():
        task = asyncio.create_task(every(0.01, step, "link check failed", first_after=0, traceback=True))
        await asyncio.sleep(0.005)
        await cancel_task(task)

    caplog.set_level(logging.ERROR)
    asyncio.run(scenario())
    (record,) = caplog.records
    assert record.getMessage() == "link check failed" and record.exc_info is not None


class Part(Lifecycle):
    def __init__(self, work):
        super().__init__()
        self.work = work
        self.task: asyncio.Task[None] | None = None

    async def _start(self):
        self.task = self.spawn(self.work(), "worker")

    async def _stop(self):
        with contextlib.suppress(Exception):
            await cancel_task(self.task)


def test_a_part_sees_its_background_task_die_and_it_is_logged_once(caplog):
    async def dies():
        raise OSError("gone")

    async def scenario():
        part = Part(dies)
        async with part:
            await asyncio.sleep(0.01)
            assert repr(part.task_failures["worker"]) == "OSError('gone')"
        quiet = Part(lambda: asyncio.sleep(10))
        async with quiet:
            await asyncio.sleep(0.01)
        assert quiet.task_failures == {}, "cancelled at stop: no failure"

    caplog.set_level(logging.ERROR)
    asyncio.run(scenario())
    assert _errors(caplog) == ["Part: worker failed: OSError('gone')"]


def test_a_task_whose_step_loses_a_cancel_is_still_stopped(monkeypatch):
    """Python 3.11's wait_for drops a cancel that comes as its wait ends; an `every` loop
    around such a step runs on.  cancel_task cancels again until the task ends: before, a
    part's stop waited for it forever (as the DNS server's prober did in the suite)."""
    import router.lifecycle

    monkeypatch.setattr(router.lifecycle, "RECANCEL_AFTER_S", 0.05, raising=False)
    swallowed = []

    async def scenario() -> bool:
        stepping = asyncio.Event()

        async def step() -> None:
            stepping.set()
            try:
                await asyncio.sleep(10)  # where the cancel comes
            except asyncio.CancelledError:
                if not swallowed:
                    swallowed.append(True)  # lost, once
                    return
                raise

        task = asyncio.get_running_loop().create_task(every(0.001, step, "step failed", first_after=0))
        await stepping.wait()
        stopping = asyncio.ensure_future(cancel_task(task))
        done, _ = await asyncio.wait({stopping}, timeout=5)
        if not done:
            task.cancel()  # the old cancel_task: end the test, not the run
            stopping.cancel()
        return bool(done) and task.cancelled()

    assert asyncio.run(scenario()), "cancel_task returned once the task had ended"
    assert swallowed, "the step did lose a cancel"
