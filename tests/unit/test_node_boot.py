"""start_and_wait: each node is given its own time to become ready."""

from __future__ import annotations

import time

import pytest

from infra.local.layout import NodeSpec
from infra.local.nodes import NodeError, start_and_wait


class SlowNode:
    """Stands in for a node that becomes ready `boot_s` after its start."""

    def __init__(self, name: str, boot_s: float, allowance: float | None = None) -> None:
        self.name, self.boot_s, self.allowance = name, boot_s, allowance
        self.spec = NodeSpec(name=name, role="spark", region=None, ports={"driver": 1})
        self.started_at: float | None = None

    def start(self) -> None:
        self.started_at = time.monotonic()

    def exited(self) -> int | None:
        return None

    def ready(self) -> bool:
        assert self.started_at is not None
        return time.monotonic() - self.started_at >= self.boot_s

    def boot_retries(self) -> int:
        return 0

    def boot_allowance(self, boot_timeout: float) -> float:
        return boot_timeout if self.allowance is None else self.allowance

    def logs_to_read(self) -> str:
        return f"{self.name}.log"


def test_a_node_allowed_longer_than_the_federations_boot_timeout_gets_its_time() -> None:
    """Tried: a Spark-like node ready after 0.6 s beside a broker ready at once, with
    boot_timeout 0.3 s and the slow node allowed 5 s: both are started and ready."""
    quick, slow = SlowNode("backend", 0.0), SlowNode("spark", 0.6, allowance=5.0)
    started: list = []
    start_and_wait([quick, slow], started, boot_timeout=0.3, progress=lambda _: None)  # type: ignore[list-item]
    assert started == [quick, slow]


def test_a_node_past_its_own_allowance_fails_the_start_naming_it_and_its_log() -> None:
    slow = SlowNode("spark", 60.0, allowance=0.5)
    t0 = time.monotonic()
    with pytest.raises(NodeError, match=r"spark not ready after 0s; see spark\.log"):
        start_and_wait([slow], [], boot_timeout=0.1, progress=lambda _: None)  # type: ignore[list-item]
    # it waited for its own allowance, not the federation's shorter one
    assert time.monotonic() - t0 >= 0.5
