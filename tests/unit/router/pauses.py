"""The pauses a router part asks for, recorded (its reconnect tests)."""

from __future__ import annotations

import asyncio
from types import ModuleType, SimpleNamespace

import pytest


def record_sleeps(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[float]:
    """The pauses `module` asks asyncio.sleep for, in order (they still pass): a loaded machine
    stretches every gap, a wrong policy asks for the wrong pause."""
    asked: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        asked.append(seconds)
        await real_sleep(seconds)

    monkeypatch.setattr(module, "asyncio", SimpleNamespace(**{**vars(asyncio), "sleep": sleep}))
    return asked
