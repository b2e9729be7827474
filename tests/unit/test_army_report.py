"""The army's report: figures in the units their names say."""

from __future__ import annotations

import time

from fedgate.army.report import all_back_after_kill_s
from fedgate.army.worker import seconds_into_run


def test_a_connect_before_the_run_began_is_0_s_into_it_not_the_epoch() -> None:
    now = time.time()
    assert seconds_into_run(0.0, now) == 0.0, "t0 is set when every device is connected"
    assert seconds_into_run(now - 12.5, now) == 12.5


def test_all_back_after_a_kill_is_seconds_after_it_from_the_last_worker_to_reconnect() -> None:
    # worker 0's devices were on the other gateway: their last connect was before the run
    assert all_back_after_kill_s([0.0, 31.25, 28.0], killed_at=20.0) == 11.2
    # a report of 1,795,907,751 s (epoch - kill) was a connect counted in wall-clock time
    assert all_back_after_kill_s([seconds_into_run(0.0, time.time()), 24.0], killed_at=20.0) == 4.0
    assert all_back_after_kill_s([0.0, 3.0], killed_at=20.0) == 0.0, "none had to reconnect"
    assert all_back_after_kill_s([5.0], killed_at=None) is None
