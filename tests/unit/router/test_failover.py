"""The node-cycling policy: each node once in turn without a pause, one sleep per full round
(growing, capped), and the rounds start again after a success."""

from __future__ import annotations

import pytest

from router.failover import NodeCycle


def test_nodes_come_in_turn_round_and_round():
    cycle = NodeCycle(["a", "b", "c"])
    assert [cycle.next() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_it_sleeps_once_per_full_round_of_failures_and_the_sleeps_grow_to_the_last_interval():
    cycle = NodeCycle(["a", "b", "c"], intervals=(0.5, 1.0, 2.0))
    tried, sleeps = [], []
    for _ in range(12):
        tried.append(cycle.next())
        sleeps.append(cycle.failed())
    assert tried == ["a", "b", "c"] * 4
    assert sleeps == [0, 0, 0.5, 0, 0, 1.0, 0, 0, 2.0, 0, 0, 2.0]


def test_with_one_node_every_failure_ends_a_round():
    cycle = NodeCycle(["only"], intervals=(0.5, 1.0, 2.0, 5.0))
    assert [cycle.failed() for _ in range(6)] == [0.5, 1.0, 2.0, 5.0, 5.0, 5.0]


def test_a_success_starts_the_rounds_and_the_backoff_again_and_the_next_node_follows_on():
    cycle = NodeCycle(["a", "b"], intervals=(1.0, 3.0))
    for _ in range(4):
        cycle.next()
        cycle.failed()
    assert cycle.next() == "a"
    cycle.succeeded()
    # lost after the success: the next node at once, a sleep of the first interval after the round
    assert cycle.next() == "b"
    assert cycle.failed() == 0
    assert cycle.next() == "a"
    assert cycle.failed() == 1.0


def test_no_node_or_a_negative_interval_is_refused():
    with pytest.raises(ValueError):
        NodeCycle([])
    with pytest.raises(ValueError):
        NodeCycle(["a"], intervals=(-1.0,))
    with pytest.raises(ValueError):
        NodeCycle(["a"], intervals=())
