"""A backend outage of 30 s while devices publish at QoS 1 loses nothing.

What is tried: a region joins, carries a command and leaves (the routers
must not trip over it when they reconnect); then a device on each gateway
publishes numbered QoS 1 messages without pause while the backend node is
stopped (clean shutdown) and started again.  Every message the gateway acknowledged (PUBACK) must reach
the backend once it is back -- buffered meanwhile in the gateway's
federation queue, moved with ack-mode on-confirm.  Duplicates are allowed
(at-least-once) and reported.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from backend import contract as c
from backend.amqp import Tap, send_command
from fedgate.devices import DeviceError, SimDevice
from tests.chaos.counting import spark_rows
from tests.helpers import device, kafka_records, record_counts, wait_present

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.slow,
    pytest.mark.chaos,
    pytest.mark.spark,
    pytest.mark.usefixtures("spark_job"),
]


class Publisher(threading.Thread):
    def __init__(self, dev: SimDevice):
        super().__init__(daemon=True)
        self.dev = dev
        self.acked: list[int] = []
        self.unacked: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            try:
                self.dev.publish(f"devices/{self.dev.device_id}/telemetry", {"seq": seq}, qos=1, timeout=15)
                self.acked.append(seq)
            except DeviceError:
                self.unacked.append(seq)  # a real device would retry; it was never promised
            seq += 1
            time.sleep(0.01)


def route_a_command_through_a_region_that_then_leaves(federation, endpoints, uid) -> None:
    """A region that came and went, with a command routed through it: when the routers
    reconnect after the outage below, nothing of it may stand in their way."""
    region = "local-gone"
    federation.add_region(region)
    try:
        ep = {**endpoints, **federation.endpoints()}
        dev_id = f"gone-{uid}"
        with device(ep, region, dev_id) as d:
            d.subscribe(c.device_command_topic(dev_id, "#"))
            wait_present(ep, dev_id, region)
            send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "hi"), b"hi")
            assert [r.payload for r in d.wait_for(1)] == [b"hi"]
    finally:
        federation.remove_region(region)


def test_stopping_and_restarting_the_backend_loses_no_qos1_message(federation, endpoints, uid):
    route_a_command_through_a_region_that_then_leaves(federation, endpoints, uid)
    url = endpoints["backend"]["url"]
    queue = f"test-outage-{uid}"
    devs = {r: f"outage-{uid}-{r}" for r in ("local-eu", "local-us")}
    keys = [f"devices.{d}.#" for d in devs.values()]
    tap = Tap(url, c.TELEMETRY_EXCHANGE, keys, durable_name=queue).open()
    tap.close()  # the durable queue collects while the backend is down and after

    pubs = []
    for region, dev_id in devs.items():
        d = device(endpoints, region, dev_id)
        pubs.append(Publisher(d))
    for p in pubs:
        p.start()
    try:
        time.sleep(1.0)
        federation.stop_node("backend")
        during = [len(p.acked) for p in pubs]
        time.sleep(3.0)
        # an operator stops a router while the backend is away: it must exit on SIGTERM, not hang
        # waiting for the backend (its robust channels would); RabbitMQ redelivers what it held
        assert federation.stop_node("router-1") == [], "router-1 had to be SIGKILLed"
        time.sleep(27.0)  # devices keep publishing to their gateways, which buffer
        federation.start_node("backend")
        federation.wait_for_links(timeout=60)
        federation.start_node("router-1")
        time.sleep(1.0)
    finally:
        for p in pubs:
            p.stop.set()
        for p in pubs:
            p.join(30)
            p.dev.close()

    acked = {(p.dev.device_id, s) for p in pubs for s in p.acked}
    published_while_down = sum(len(p.acked) for p in pubs) - sum(during)
    assert published_while_down > 0, "the test must publish while the backend is down"

    # the same keys: a batch holds other devices' readings too, which the tap leaves out
    tap = Tap(url, c.TELEMETRY_EXCHANGE, keys, durable_name=queue).open()
    try:
        got = tap.drain(expect=len(acked), timeout=60)
        # pick up duplicates that arrive right after
        got += tap.drain(timeout=5, idle=1.0)
        tap.delete()
    finally:
        tap.close()
    received = [(m.device, json.loads(m.payload)["seq"]) for m in got]
    missing = acked - set(received)
    duplicates = len(received) - len(set(received))
    # and on through the router and Kafka into the analysts' table, once each
    rows = spark_rows(federation, f"outage-{uid}-", expect=len(set(received)))
    record_counts(
        acked=len(acked),
        acked_while_down=published_while_down,
        received=len(received),
        lost=len(missing),
        duplicated=duplicates,
        telemetry_raw_rows=len(rows),
        telemetry_raw_duplicated=len(rows) - len(set(rows)),
    )
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    for m in got:
        assert m.region == next(r for r, d in devs.items() if d == m.device)
    assert len(rows) == len(set(rows)) and set(rows) == set(received), "telemetry_raw has each message once"


def test_the_routers_resume_bridging_after_the_backend_restart(federation, endpoints, uid):
    """Runs after the restart above: the routers reconnected and consume the shards again."""
    dev_id = f"after-restart-{uid}"
    with device(endpoints, "local-eu", dev_id) as d:
        for i in range(20):  # 20 topics' worth of seqs land on several shards, so on both routers
            d.publish(f"devices/{dev_id}/telemetry/t{i}", {"seq": i})
    recs = kafka_records(
        endpoints,
        c.KAFKA_TELEMETRY_TOPIC,
        lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id,
        expect=20,
        timeout=60,
    )
    assert sorted(json.loads(m.value())["seq"] for m, _ in recs) == list(range(20))
