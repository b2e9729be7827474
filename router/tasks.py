"""Background work on the event loop: one way to start a task and hear of its failure, and
one loop for what runs every N seconds.

- `watch(future, failed)` logs the future's exception once, at error level, when it ends
  with one (`failed` is the message, with one `%r`/`%s` for the exception); a cancelled
  future is no failure.  The exception is retrieved, so asyncio does not log it again
  ("exception was never retrieved").
- `spawn(coro, name, failed)` starts a task and watches it.  A part that holds such a
  task starts it with `Lifecycle.spawn` (router/lifecycle.py), which also keeps what
  killed it.
- `every(interval, step, failed)` runs `step` every `interval` seconds, for ever: a step
  that raises is logged and the next one runs on time; cancelling the task (the part's
  stop) ends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn, TypeVar

log = logging.getLogger(__name__)

F = TypeVar("F", bound="asyncio.Future[Any]")


def watch(
    future: F,
    failed: str,
    *,
    logger: logging.Logger = log,
    on_failure: Callable[[BaseException], object] | None = None,
) -> F:
    """Log `failed % exception` once if `future` ends with an exception; returns `future`."""

    def done(f: asyncio.Future[Any]) -> None:
        if f.cancelled():
            return
        e = f.exception()
        if e is None:
            return
        logger.error(failed, e)
        if on_failure is not None:
            on_failure(e)

    future.add_done_callback(done)
    return future


def spawn(
    coro: Coroutine[Any, Any, Any],
    name: str,
    failed: str,
    *,
    logger: logging.Logger = log,
    on_failure: Callable[[BaseException], object] | None = None,
) -> asyncio.Task[Any]:
    """A task running `coro`, its failure logged once (`watch`)."""
    return watch(asyncio.create_task(coro, name=name), failed, logger=logger, on_failure=on_failure)


async def every(
    interval: float,
    step: Callable[[], Awaitable[object]],
    failed: str,
    *,
    first_after: float | None = None,
    logger: logging.Logger = log,
    traceback: bool = False,
) -> NoReturn:
    """Sleep `first_after` (default `interval`), run `step`, and again every `interval` s.

    A step that raises is logged -- `failed: <exception>`, or `failed` and the traceback
    with `traceback` (for what can only be a bug) -- and the loop goes on."""
    pause = interval if first_after is None else first_after
    while True:
        await asyncio.sleep(pause)
        pause = interval
        try:
            await step()
        except Exception as e:  # the next round tries again
            if traceback:
                logger.exception(failed)
            else:
                logger.error("%s: %r", failed, e)
