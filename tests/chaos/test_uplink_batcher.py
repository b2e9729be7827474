"""The gateway's uplink batcher (gateways/uplink_batcher_plugin) killed while devices publish.

Tried: two devices on each region's gateway publish numbered QoS 1 readings every 10 ms;
local-eu's batcher process is killed three times, 2 s apart, mid-stream: each time with
readings taken from its queue and not yet published, and batches published and not yet
confirmed.  Its supervisor starts it again at once; RabbitMQ delivers again what it had not
acked.

Counted: every reading the gateways acknowledged is in Kafka, in order per device; the
copies are at most what the batcher held unacked (its prefetch) per kill.  A batcher that
acked a reading before the batch carrying it was confirmed would lose what it held.
"""

from __future__ import annotations

import time

import pytest

from backend import contract as c
from tests.chaos.counting import Fleet, check, read_back
from tests.chaos.faults import rabbitmq_eval
from tests.helpers import device

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.chaos]

KILLS = 3
#: the batcher's prefetch (gateways/uplink_batcher_plugin/fedgate_uplink_batcher.app)
BATCHER_PREFETCH = 2000


def test_the_batcher_killed_mid_stream_loses_nothing(federation, endpoints, uid):
    with Fleet.on_both_gateways(endpoints, f"batcher-{uid}", per_region=2) as fleet:
        time.sleep(2.0)
        for _ in range(KILLS):
            # badarg, and a failed test, if no batcher runs: the supervisor must have restarted it
            rabbitmq_eval(federation, "gw-local-eu", "exit(whereis(fedgate_uplink_batcher), kill).")
            time.sleep(2.0)
    stats = rabbitmq_eval(federation, "gw-local-eu", "fedgate_uplink_batcher:stats().")
    assert "connected => true" in stats, f"the batcher reads again after the kills: {stats}"
    got = read_back(endpoints["kafka"]["bootstrap"], fleet.acked)
    check(fleet, got, max_duplicates=KILLS * BATCHER_PREFETCH + len(fleet.devices), batcher_kills=KILLS)


def test_acknowledgements_between_batches_leave_the_batcher_on_its_channel(federation, endpoints, uid):
    """Tried: a device sends a reading, then a command acknowledgement (devices/<id>/acks,
    which the batcher forwards alone, in order with the batches) 20-32 ms later, 300 times:
    the acknowledgement lands just after the batch carrying the reading left (its linger is
    25 ms) and, some of the times, before that batch's confirm, while four other devices'
    readings are in flight.  The batcher covered the batch's readings a second time there and
    acked their delivery tag twice; RabbitMQ closed its channel for it (PRECONDITION_FAILED,
    unknown delivery tag), which stalled the uplink a second and delivered what it held
    again: 232 times in one test run.

    Counted: every acknowledged reading is in Kafka once, in order, and the batcher never
    had to open its channel again."""
    acker = f"acker-{uid}"
    closes_before = batcher_channel_closes(federation)
    reconnects_before = batcher_reconnects(federation)
    fleet = Fleet.on_both_gateways(endpoints, f"between-{uid}", per_region=2, interval=0.05)
    with fleet, device(endpoints, "local-eu", acker) as d:
        for i in range(300):
            d.publish(f"devices/{acker}/telemetry", {"seq": i}, qos=1, timeout=60)
            time.sleep(0.020 + (i % 25) * 0.0005)
            d.publish(c.device_ack_topic(acker), {"acks": [f"{uid}-{i}"]}, qos=1, timeout=60)
    got = read_back(endpoints["kafka"]["bootstrap"], fleet.acked)
    check(fleet, got, max_duplicates=0)
    closes = batcher_channel_closes(federation) - closes_before
    assert closes == 0, f"the batcher's channel was closed {closes} times (the gateway's log)"
    assert batcher_reconnects(federation) == reconnects_before, "and so say the batcher's own counters"


def batcher_channel_closes(federation) -> int:
    """The times gw-local-eu's log says the batcher lost its channel (old code too)."""
    log = federation.node("gw-local-eu").log_file.read_text(errors="replace")
    return log.count("fedgate uplink batcher: channel closed")


def batcher_reconnects(federation) -> int:
    """The channels the batcher lost since it started (fedgate_uplink_batcher:stats())."""
    return int(
        rabbitmq_eval(
            federation, "gw-local-eu", "maps:get(reconnects, fedgate_uplink_batcher:stats())."
        ).strip()
    )
