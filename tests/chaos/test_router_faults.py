"""The router under faults: killed mid-stream, Kafka away for 30 s, two routers sharing the uplink.

What is tried in each: devices publish numbered QoS 1 messages without pause
while the fault happens; afterwards a Kafka consumer reads everything back.
Every message a gateway acknowledged must be in Kafka (nothing lost), in the
order each device sent it; duplicates are allowed only within the in-flight
window and are counted.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from infra.local import processes
from tests.chaos.counting import Fleet, check, read_back

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.chaos,
    pytest.mark.spark,
]


def test_two_routers_share_the_uplink_and_keep_per_device_order(federation, endpoints, uid):
    def bridged(name: str) -> float:
        import urllib.request

        node = federation.node(name)
        with urllib.request.urlopen(f"{node.metrics_url}/metrics", timeout=5) as r:
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in r.read().decode().splitlines()
                if line.startswith("fedgate_router_bridged_total")
            )

    before = {n: bridged(n) for n in ("router-0", "router-1")}
    # Each device's telemetry hashes to one shard (router-0 reads 0 and 2, router-1 1 and 3):
    # with 8 devices all of them land on one router's shards once in ~128 runs (it happened:
    # uid dca48a9c), with 16 once in ~32,000.
    with Fleet.on_both_gateways(endpoints, f"pair-{uid}", per_region=8) as fleet:
        time.sleep(3)
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked)
    check(fleet, got, max_duplicates=0)
    for name in ("router-0", "router-1"):
        assert bridged(name) > before[name], f"{name} took part"


def test_a_router_killed_mid_stream_loses_nothing(federation, endpoints, uid):
    with Fleet.on_both_gateways(endpoints, f"kill-{uid}", per_region=4) as fleet:
        time.sleep(1.5)
        victim = federation.node("router-1")
        pid = victim.pid()
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.5)  # devices keep publishing; router-1's shards wait in RabbitMQ
        federation.start_node("router-1")
        time.sleep(1.5)
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked)
    # duplicates only from the killed router's in-flight window (its prefetch)
    check(fleet, got, max_duplicates=2000, spark_federation=federation, device_prefix=f"kill-{uid}-")


def test_kafka_down_for_30s_while_devices_publish_loses_nothing(federation, endpoints, uid):
    with Fleet.on_both_gateways(endpoints, f"kafka-{uid}", per_region=2, interval=0.05) as fleet:
        time.sleep(1.0)
        federation.stop_node("kafka")
        stopped_at = time.monotonic()
        acked_at_stop = fleet.total_acked
        time.sleep(30)
        published_while_down = fleet.total_acked - acked_at_stop
        federation.start_node("kafka")
        down_s = round(time.monotonic() - stopped_at)
        time.sleep(2.0)
    assert published_while_down > 0, "devices kept publishing while Kafka was down"
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked, timeout=120)
    check(
        fleet,
        got,
        max_duplicates=0,
        spark_federation=federation,
        device_prefix=f"kafka-{uid}-",
        kafka_down_s=down_s,
        acked_while_down=published_while_down,
    )
    for name in ("router-0", "router-1"):
        assert federation.node(name).is_running(), f"{name} survived the Kafka outage"


def test_sigterm_drains_and_exits_cleanly(federation, endpoints, uid):
    with Fleet.on_both_gateways(endpoints, f"term-{uid}", per_region=2) as fleet:
        time.sleep(1.0)
        node = federation.node("router-1")
        pid = node.pid()
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while processes.exit_code(pid) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        code = processes.exit_code(pid)
        federation.start_node("router-1")
        time.sleep(1.0)
    assert code == 0, f"router exit code {code} after SIGTERM"
    log = node.stdout_log.read_text()
    assert "stopping: producer flushed" in log and "stopped" in log
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked)
    check(fleet, got, max_duplicates=0, spark_federation=federation, device_prefix=f"term-{uid}-")
