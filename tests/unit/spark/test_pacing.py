"""The job's pacing: micro-batches spaced as far apart as the freshness target allows."""

from __future__ import annotations

from spark.job import pause_after


def test_a_steady_batch_waits_for_the_target_less_what_batches_take():
    # batches of ~0.8 s, target 4 s: the next starts 3.2 s after this one did, so a record
    # that arrived right after this batch started is a row ~4 s later
    assert round(pause_after(0.8, [0.7, 0.8, 0.6], 4.0), 2) == 2.4


def test_the_slowest_recent_batch_is_what_the_next_is_expected_to_take():
    assert round(pause_after(0.5, [0.5, 1.5, 0.5], 4.0), 2) == 2.0


def test_the_first_batch_expects_the_next_to_take_as_long_as_itself():
    assert round(pause_after(1.0, [], 4.0), 2) == 2.0


def test_batches_that_take_the_whole_target_follow_each_other_at_once():
    assert pause_after(2.5, [2.0, 2.2], 4.0) == 0.0
    assert pause_after(6.0, [], 4.0) == 0.0


def test_no_target_no_pause():
    assert pause_after(0.1, [0.1], 0.0) == 0.0
