"""The router under faults: killed mid-stream, Kafka away for 30 s, two routers sharing the uplink.

What is tried in each: devices publish numbered QoS 1 messages without pause
while the fault happens; afterwards a Kafka consumer reads everything back.
Every message a gateway acknowledged must be in Kafka (nothing lost), in the
order each device sent it; duplicates are allowed only within the in-flight
window and are counted.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition

from fedgate.devices import DeviceError, SimDevice
from infra.local import processes
from tests.helpers import device, record_counts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.chaos,
    pytest.mark.spark,
]

TOPIC = "telemetry.telemetry"


class Fleet:
    """Devices on both gateways publishing numbered messages from background threads."""

    def __init__(self, endpoints: dict, prefix: str, per_region: int, interval: float = 0.01):
        self.devices = []
        for region in ("local-eu", "local-us"):
            for i in range(per_region):
                self.devices.append(device(endpoints, region, f"{prefix}-{region}-{i}"))
        self.acked: dict[str, list[int]] = {d.device_id: [] for d in self.devices}
        self.stop = threading.Event()
        self.interval = interval
        self.threads = [threading.Thread(target=self._run, args=(d,), daemon=True) for d in self.devices]

    def _run(self, d: SimDevice) -> None:
        seq = 0
        while not self.stop.is_set():
            try:
                d.publish(f"devices/{d.device_id}/telemetry", {"seq": seq}, qos=1, timeout=60)
                self.acked[d.device_id].append(seq)
            except DeviceError:
                pass  # never acknowledged, so never promised
            seq += 1
            time.sleep(self.interval)

    def __enter__(self) -> Fleet:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)
        for d in self.devices:
            d.close()

    @property
    def total_acked(self) -> int:
        return sum(len(v) for v in self.acked.values())


def read_back(bootstrap: str, devices: set[str], expect: int, timeout: float = 90.0) -> dict[str, list[int]]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"t-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    md = consumer.list_topics(TOPIC, timeout=10)
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in md.topics[TOPIC].partitions])
    got: dict[str, list[int]] = {d: [] for d in devices}
    n = 0
    deadline = time.monotonic() + timeout
    idle_since = time.monotonic()
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                # stop once everything expected arrived and nothing more came for 3 s
                if n >= expect and time.monotonic() - idle_since > 3:
                    break
                continue
            key = (msg.key() or b"").decode()
            if key in got:
                got[key].append(json.loads(msg.value())["seq"])
                n += 1
                idle_since = time.monotonic()
    finally:
        consumer.close()
    return got


def check(fleet: Fleet, got: dict[str, list[int]], max_duplicates: int) -> tuple[int, int]:
    missing = duplicates = 0
    for dev, acked in fleet.acked.items():
        seen = got[dev]
        missing += len(set(acked) - set(seen))
        duplicates += len(seen) - len(set(seen))
        first_seen = list(dict.fromkeys(seen))  # order of first appearance
        assert first_seen == sorted(first_seen), f"{dev}: out of order in Kafka"
    record_counts(
        acked=fleet.total_acked,
        in_kafka=sum(len(v) for v in got.values()),
        lost=missing,
        duplicated=duplicates,
    )
    assert missing == 0, f"{missing} acknowledged messages never reached Kafka"
    assert duplicates <= max_duplicates
    return missing, duplicates


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
    with Fleet(endpoints, f"pair-{uid}", per_region=4) as fleet:
        time.sleep(3)
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked)
    check(fleet, got, max_duplicates=0)
    for name in ("router-0", "router-1"):
        assert bridged(name) > before[name], f"{name} took part"


def test_a_router_killed_mid_stream_loses_nothing(federation, endpoints, uid):
    with Fleet(endpoints, f"kill-{uid}", per_region=4) as fleet:
        time.sleep(1.5)
        victim = federation.node("router-1")
        pid = victim.pid()
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.5)  # devices keep publishing; router-1's shards wait in RabbitMQ
        federation.start_node("router-1")
        time.sleep(1.5)
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked)
    # duplicates only from the killed router's in-flight window (its prefetch)
    check(fleet, got, max_duplicates=2000)
    # the analysts' table has each message once, duplicates in Kafka or not
    in_kafka = {(dev, seq) for dev, seqs in got.items() for seq in seqs}
    rows = spark_rows(federation, f"kill-{uid}-", expect=len(in_kafka))
    record_counts(
        in_kafka_distinct=len(in_kafka),
        telemetry_raw_rows=len(rows),
        telemetry_raw_duplicated=len(rows) - len(set(rows)),
    )
    assert len(rows) == len(set(rows)) == len(in_kafka) and set(rows) == in_kafka


def spark_rows(federation, device_prefix: str, expect: int, timeout: float = 120.0) -> list[tuple[str, int]]:
    """(device, seq) of every telemetry_raw row of these devices, once `expect` rows landed (or timeout)."""
    from spark.query import session
    from spark.tables import register_views

    settings = federation.spark_settings()
    sql = (
        "SELECT device, CAST(fields['seq'] AS INT) AS seq FROM telemetry_raw "
        f"WHERE device LIKE '{device_prefix}%'"
    )
    with session(settings) as spark:

        def read() -> list[tuple[str, int]]:
            register_views(spark, settings.warehouse)  # sees the files landed since
            return [(r["device"], r["seq"]) for r in spark.sql(sql).collect()]

        deadline = time.monotonic() + timeout
        while len(read()) < expect and time.monotonic() < deadline:
            time.sleep(2)
        time.sleep(3)  # a duplicate would land in a later micro-batch
        return read()


def test_kafka_down_for_30s_while_devices_publish_loses_nothing(federation, endpoints, uid):
    with Fleet(endpoints, f"kafka-{uid}", per_region=2, interval=0.05) as fleet:
        time.sleep(1.0)
        federation.stop_node("kafka")
        stopped_at = time.monotonic()
        acked_at_stop = fleet.total_acked
        time.sleep(30)
        published_while_down = fleet.total_acked - acked_at_stop
        federation.start_node("kafka")
        record_counts(
            kafka_down_s=round(time.monotonic() - stopped_at), acked_while_down=published_while_down
        )
        time.sleep(2.0)
    assert published_while_down > 0, "devices kept publishing while Kafka was down"
    got = read_back(endpoints["kafka"]["bootstrap"], set(fleet.acked), fleet.total_acked, timeout=120)
    check(fleet, got, max_duplicates=0)
    for name in ("router-0", "router-1"):
        assert federation.node(name).is_running(), f"{name} survived the Kafka outage"


def test_sigterm_drains_and_exits_cleanly(federation, endpoints, uid):
    with Fleet(endpoints, f"term-{uid}", per_region=2) as fleet:
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
    check(fleet, got, max_duplicates=0)
