"""A gateway killed with SIGKILL while its devices publish and are sent commands.

Tried: a region `local-gk` whose 6 devices find it nearest, each publishing
numbered QoS 1 readings and subscribed to its commands, while a backend
service sends every device a numbered command every 0.25 s.  The gateway's
RabbitMQ is SIGKILLed.  The devices live in local-gk's client network and
find their gateway by DNS: once the DNS server's health check has seen the
gateway dead and their answer's TTL ran out, they are answered the next
nearest region (local-eu), connect there and renew their subscriptions.  Commands keep
coming for 12 s more; then the killed gateway is started again, so that the
readings it had acknowledged and not yet passed on (its durable federation
queue, on its disk) flow to the backend.

Counted: every acknowledged reading is in Kafka and once in telemetry_raw;
every command the backend confirmed reached its device.  Those sent while
the gateway was dead and its devices not yet back came back from the dead
region's downlink queue after 10 s and followed their devices.
"""

from __future__ import annotations

import time

import pytest

from backend.polling import wait_until
from fedgate.resolver import Endpoint
from infra.local.driver import gateway_node_name
from tests.chaos.counting import CommandSender, Fleet, check, read_back, resend_bound
from tests.helpers import devices_in_network, firing, record_counts, router_metrics, wait_present

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.chaos,
    pytest.mark.spark,
    pytest.mark.usefixtures("spark_job"),
]

REGION = "local-gk"
FALLBACK = "local-eu"
DEVICES = 6


def test_a_gateway_killed_its_devices_fail_over_and_nothing_is_lost_either_way(federation, uid):
    federation.add_region(REGION)
    try:
        ep = federation.endpoints()
        near = Endpoint(REGION, ep["gateways"][REGION]["address"], ep["gateways"][REGION]["mqtt"])
        ids = [f"gk-{uid}-{i}" for i in range(DEVICES)]
        # the devices live in local-gk's client network: DNS answers them local-gk while its
        # gateway is healthy, the next region (local-eu) when it is not
        devices = devices_in_network(federation, ep, REGION, ids)
        assert {d.region for d in devices} == {REGION}

        with Fleet(devices, interval=0.05) as fleet, CommandSender(ep["backend"]["url"], ids) as commands:
            time.sleep(3)
            acked_before = fleet.total_acked
            federation.node(gateway_node_name(REGION)).kill()  # SIGKILL, every process of it
            killed_at = time.monotonic()
            deadline = killed_at + 60
            while not all(d.connected and d.region == FALLBACK for d in devices):
                assert time.monotonic() < deadline, "devices did not fail over to local-eu"
                time.sleep(0.05)
            failover_s = time.monotonic() - killed_at
            for d in devices:
                wait_present(ep, d.device_id, FALLBACK, timeout=30)
            # the federation's Prometheus pages: the region has no gateway up
            assert wait_until(lambda: firing(federation, "FedgateRegionDown", region=REGION), 45, 1), (
                f"FedgateRegionDown never fired for {REGION}: {federation.node('prometheus').alerts()}"
            )
            alert_s = time.monotonic() - killed_at
            # commands sent into the dead region come back (10 s) and follow
            time.sleep(max(0.0, 12 - (time.monotonic() - killed_at - failover_s)))
            federation.start_node(gateway_node_name(REGION))
            federation.wait_for_links(timeout=60)
            time.sleep(2)

        # every confirmed command at its device, by now or within a minute
        delivered = commands.delivered(devices)
        returned = router_returned(ep)

        got = read_back(ep["kafka"]["bootstrap"], fleet.acked, timeout=120)
        record_counts(
            failover_s=round(failover_s, 1),
            region_down_alert_s=round(alert_s, 1),
            dns_ttl_plus_health_check_s=ep["dns"]["ttl"] + ep["dns"]["health_check_interval"],
            acked_before_kill=acked_before,
            commands_sent=sum(len(v) for v in commands.sent.values()),
            commands_received=delivered.received,
            commands_returned_by_dead_region=int(returned),
            commands_lost=delivered.lost,
            commands_duplicated=delivered.twice,
        )
        # readings: QoS 1 retransmits what the dead gateway never acknowledged, to local-eu
        check(
            fleet,
            got,
            # the restarted gateway's link resends its unconfirmed window, devices their last publish
            max_duplicates=resend_bound(fleet, links=1),
            spark_federation=federation,
            device_prefix=f"gk-{uid}-",
            in_order=False,  # what the dead gateway held arrives when it is back
        )
        assert delivered.lost == 0, (
            f"{delivered.lost} confirmed commands never reached their device:\n"
            + commands.lost_story(delivered, ep["kafka"]["bootstrap"])
        )
        assert returned > 0, "commands sent while the devices were away came back from the dead region"
        assert all(d.failovers == [near] for d in devices), [(d.device_id, d.failovers) for d in devices]
        # the gateway back, the alert is no longer firing
        assert wait_until(lambda: not firing(federation, "FedgateRegionDown", region=REGION), 30, 1)
    finally:
        federation.remove_region(REGION)


def router_returned(ep: dict) -> float:
    return router_metrics(ep).get(f'fedgate_router_returned_total{{region="{REGION}"}}', 0.0)
