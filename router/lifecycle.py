"""One lifecycle shape for every part of the router that holds a connection or a task.

Each part (the Router, the uplink bridge, the downlink, the Kafka tables,
the HTTP endpoint) has `async start()` and `async stop()`, and works as
`async with part:`.  A small state machine guards them, so that:

- `stop()` is safe to call twice, and safe on a part that never started or
  failed half-way through starting (the Router stops what it started when
  a later part fails);
- `start()` on a stopped part is refused instead of silently reviving it
  with stale state.

Subclasses implement `_start` and `_stop`; `_stop` must tolerate a
half-done `_start`.  A part's background tasks start with `self.spawn(coro, name)`:
a task that dies of an exception is logged once (router/tasks.py) and kept in
`task_failures`, so the part can see that it died; `_stop` cancels them with
`cancel_task`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self

from router import tasks


class State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class LifecycleError(RuntimeError):
    pass


class Lifecycle:
    def __init__(self) -> None:
        self.state = State.NEW
        #: background task name -> the exception it died of (router/tasks.py logged it)
        self.task_failures: dict[str, BaseException] = {}

    @property
    def running(self) -> bool:
        return self.state is State.RUNNING

    async def start(self, *args: Any) -> None:
        if self.state is not State.NEW:
            raise LifecycleError(f"{type(self).__name__}: start() when {self.state.value}")
        self.state = State.STARTING
        await self._start(*args)
        self.state = State.RUNNING

    async def stop(self) -> None:
        """Stop in the part's fixed order; a second call (or one before start) does nothing."""
        if self.state in (State.NEW, State.STOPPING, State.STOPPED):
            self.state = State.STOPPED if self.state is State.NEW else self.state
            return
        self.state = State.STOPPING
        try:
            await self._stop()
        finally:
            self.state = State.STOPPED

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as this part's background task `name`, its failure logged once."""

        def died(e: BaseException) -> None:
            self.task_failures.setdefault(name, e)

        return tasks.spawn(coro, name, f"{type(self).__name__}: {name} failed: %r", on_failure=died)

    async def _start(self, *args: Any) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError


#: How long a cancelled task has to end before it is cancelled again.
RECANCEL_AFTER_S = 1.0


async def cancel_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel a part's background task and wait until it has ended (None: there was none).

    A cancel can be lost: Python 3.11's asyncio.wait_for returns a wait that ends as it is
    cancelled and drops the cancel, and a loop around it (tasks.every) then runs on.  The task
    is cancelled again every RECANCEL_AFTER_S until it ends, so that a stop never waits for
    it forever (the DNS server's prober did: infra/dns/health.py)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_AFTER_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task
