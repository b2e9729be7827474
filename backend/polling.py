"""Waiting for a condition with a deadline: one loop instead of one per caller.

`wait_until(predicate, timeout, interval)` asks `predicate` at once, then every
`interval` seconds, until it answers something true or `timeout` seconds have passed.
It returns the last answer: true when the wait succeeded, the last false one when the
time ran out, so that a caller raises its own error (with its own message) on a false
answer.  The predicate is asked once more after the deadline passes, so a wait never
fails for want of a last look.  `await_until` is the same for asyncio code.

It lives in `backend/`, the one folder every other part may import
(tests/unit/test_architecture.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """The predicate's first true answer, or its last (false) one once `timeout` passed."""
    deadline = clock() + timeout
    while True:
        answer = predicate()
        if answer or clock() >= deadline:
            return answer
        sleep(interval)


async def await_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`wait_until` on the event loop: it sleeps with asyncio.sleep."""
    deadline = clock() + timeout
    while True:
        answer = predicate()
        if answer or clock() >= deadline:
            return answer
        await asyncio.sleep(interval)
