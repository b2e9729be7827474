"""How a command ends, read from its steps (backend/command_outcomes.py): what `fedgate send
--wait` and `fedgate command --wait` stop at."""

from __future__ import annotations

from backend.command_outcomes import QOS1_SETTLED_S, Outcome, final_outcome, partition_of


def test_a_command_ends_acknowledged_deadlettered_or_delivered_once_a_qos1_send_settled():
    routed_q1 = Outcome("routed", 10_000, "local-eu", delivery="qos1")
    settled = 10_000 + int(QOS1_SETTLED_S * 1000)
    assert final_outcome([], settled) is None
    assert final_outcome([Outcome("accepted", 9_990), routed_q1], settled - 1) is None, "may be parked again"
    assert final_outcome([Outcome("accepted", 9_990), routed_q1], settled) == "delivered"
    reparked = Outcome("parked", 10_500, reason="its connection ended as it was sent")
    assert final_outcome([routed_q1, reparked], settled + 60_000) is None, "parked again: it goes on"
    routed_q0 = Outcome("routed", 10_000, "local-eu", delivery="qos0")
    assert final_outcome([routed_q0], settled + 60_000) is None, "a QoS 0 device acknowledges"
    assert final_outcome([routed_q0, Outcome("acknowledged", 10_200)], 10_200) == "acknowledged"
    assert final_outcome([Outcome("routed", 10_000, "local-eu")], settled) is None, "unknown subscriptions"
    assert final_outcome([Outcome("deadlettered", 10_000, reason="expired")], 10_000) == "deadlettered"


def test_ids_spread_over_every_partition():
    # that it is the partition librdkafka writes a key to (CRC-32 of the key, its default
    # partitioner) the integration tests show: they read every step back from it alone
    assert {partition_of(f"{i:032x}", 3) for i in range(100)} == {0, 1, 2}
