"""A reconnect storm: every device of a region drops and reconnects at the same moment.

Tried: 100 devices on local-us, all disconnected at once and reconnected at
once from 100 threads.  Then each publishes one reading and is sent one
command through the router.  Counted: every device reconnected, every reading
is in Kafka (lost 0, duplicates bounded by QoS 1's at-least-once) and once
in telemetry_raw, every command reached its device once (lost 0).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend import contract as c
from backend.amqp import send_command
from backend.polling import wait_until
from fedgate.devices import SimDevice
from tests.chaos.counting import spark_rows
from tests.helpers import kafka_records, leader_url, record_counts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.spark,
    pytest.mark.usefixtures("spark_job"),
]

DEVICES = 100
REGION = "local-us"


def present_in(endpoints, ids: set[str], region: str) -> int:
    with urllib.request.urlopen(leader_url(endpoints) + "/presence", timeout=10) as r:
        devices = json.load(r)["devices"]
    return sum(1 for d in devices if d["device"] in ids and d["region"] == region)


def wait_all_present(endpoints, ids: set[str], region: str, timeout: float = 60) -> None:
    n = 0

    def all_present() -> bool:
        nonlocal n
        n = present_in(endpoints, ids, region)
        return n >= len(ids)

    assert wait_until(all_present, timeout, 0.5), f"the router sees {n} of {len(ids)} devices at {region}"


def test_all_devices_of_a_region_reconnect_at_once_and_nothing_is_lost(federation, endpoints, uid):
    ids = [f"storm-{uid}-{i}" for i in range(DEVICES)]
    secrets = federation.add_devices(ids)
    ep = endpoints
    host, port = ep["gateways"][REGION]["address"], ep["gateways"][REGION]["mqtt"]
    fleet = [SimDevice(d, host, port, d, secrets[d], auto_reconnect=False) for d in ids]

    def connect(dev: SimDevice) -> None:
        dev.connect(timeout=30)
        dev.subscribe(c.device_command_topic(dev.device_id, "#"), timeout=30)

    with ThreadPoolExecutor(max_workers=DEVICES) as pool:
        list(pool.map(connect, fleet))
        wait_all_present(endpoints, set(ids), REGION)

        # the storm: everyone drops at once, then everyone comes back at once
        list(pool.map(lambda d: d.close(), fleet))
        fleet = [SimDevice(d, host, port, d, secrets[d], auto_reconnect=False) for d in ids]
        start = threading.Barrier(DEVICES)

        def reconnect(dev: SimDevice) -> float:
            start.wait()
            t0 = time.monotonic()
            connect(dev)
            return time.monotonic() - t0

        took = sorted(pool.map(reconnect, fleet))
    try:
        assert all(d.connected for d in fleet), "every device reconnected"
        wait_all_present(endpoints, set(ids), REGION)

        for d in fleet:
            d.publish(c.device_telemetry_topic(d.device_id), {"after_storm": d.device_id, "seq": 0})
        for d in fleet:
            send_command(
                ep["backend"]["url"], d.device_id, c.device_command_topic(d.device_id, "hello"), b"back"
            )
        wait_until(lambda: sum(len(d.received) for d in fleet) >= DEVICES, 30, 0.2)
        time.sleep(1.0)  # a duplicate would arrive now
        commands = Counter(d.device_id for d in fleet for _ in d.received)

        readings = kafka_records(
            endpoints,
            c.KAFKA_TELEMETRY_TOPIC,
            lambda m, h: h.get(c.KAFKA_DEVICE_HEADER, "").startswith(f"storm-{uid}-"),
            expect=DEVICES,
            timeout=60,
            # read on past the 100th: else a copy displaced another device's reading (counted
            # lost) and the bound on copies below could never be what failed
            settle_s=3.0,
        )
        per_device = Counter(h[c.KAFKA_DEVICE_HEADER] for _, h in readings)
    finally:
        for d in fleet:
            d.close()
    rows = Counter(dev for dev, _ in spark_rows(federation, f"storm-{uid}-", expect=DEVICES))

    lost_commands = [d for d in ids if commands[d] == 0]
    lost_readings = [d for d in ids if per_device[d] == 0]
    record_counts(
        devices=DEVICES,
        reconnect_s_max=round(took[-1], 1),
        readings_sent=DEVICES,
        readings_in_kafka=sum(per_device.values()),
        readings_lost=len(lost_readings),
        commands_sent=DEVICES,
        commands_received=sum(commands.values()),
        commands_lost=len(lost_commands),
        telemetry_raw_rows=sum(rows.values()),
        telemetry_raw_duplicated=sum(rows.values()) - len(rows),
    )
    assert lost_readings == [] and lost_commands == []
    assert max(commands.values()) == 1, "each command arrived once"
    assert max(per_device.values()) <= 2, "QoS 1 may duplicate a reading, not multiply it"
    assert rows == Counter(ids), "telemetry_raw has each device's reading once"
