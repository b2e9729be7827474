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

from tests.chaos.counting import Fleet, check, read_back
from tests.chaos.faults import rabbitmq_eval

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
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked)
    check(fleet, got, max_duplicates=KILLS * BATCHER_PREFETCH + len(fleet.devices), batcher_kills=KILLS)
