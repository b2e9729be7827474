"""A gateway that stops answering for a while, its devices still connected to it.

Tried: a device on local-us, subscribed to its commands.  Every process of
local-us's RabbitMQ is frozen (SIGSTOP: a VM paused, a node stuck in a long
GC, a partition that heals).  Command 1 is sent to the device: it cannot get
through, comes back, and the router, finding the gateway's management API
silent, takes the session for ended (as it must: the gateway may be dead) and
parks the command.  Command 2, sent then, is parked at once: the device counts
as offline.  Then the gateway resumes (SIGCONT): the device never left, so no
event will ever say it is there.

Counted: both commands reach the device while it keeps its connection -- the
router's periodic check of the gateways' connection lists
(`presence_reconcile_s`) takes the session back and sends what waited.
Before that check, command 2 waited until the device happened to reconnect,
or expired into the dead-letter topic.  Command 1 may arrive twice: the
frozen gateway had it in its link's socket when it froze.

And DNS: a device of local-us asking while its gateway is frozen -- its kernel
still completing every TCP handshake -- is answered the next region within the
health checks' worst case (infra/dns/health.py), and its own region again once
the gateway answers.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest

from backend import contract as c
from backend.amqp import send_command
from backend.polling import wait_until
from fedgate.dns_resolver import device_address
from infra.dns.query import DnsQueryError, DnsServer, ask_server
from infra.local import processes
from infra.local.driver import gateway_node_name
from tests.helpers import device, leader_url, record_counts, router_metrics, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.slow, pytest.mark.chaos]

REGION = "local-us"


def _present(ep: dict, dev_id: str) -> bool:
    with urllib.request.urlopen(f"{leader_url(ep)}/presence?device={dev_id}", timeout=5) as r:
        return bool(json.load(r)["devices"])


class DnsWatch(threading.Thread):
    """What a device of a region is answered, asked every 0.2 s from its own address: each
    answer and when it first came."""

    def __init__(self, ep: dict, region: str, dev_id: str):
        super().__init__(daemon=True)
        dns_ep = ep["dns"]
        server = DnsServer(dns_ep["host"], dns_ep["port"])
        source = device_address(dns_ep["client_networks"][region], dev_id)
        self.ask: Callable[[], list[str]] = lambda: sorted(ask_server(server, dns_ep["name"], source)[0])
        self.seen: list[tuple[float, list[str]]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                got = self.ask()
            except DnsQueryError as e:
                got = [f"no answer: {e}"]
            if not self.seen or self.seen[-1][1] != got:
                self.seen.append((time.monotonic(), got))
            time.sleep(0.2)

    def answered(self, want: list[str], after: float, timeout: float) -> float:
        """Seconds from `after` until `want` was answered (waiting up to `timeout` from `after`)."""
        while True:
            at = next((t for t, got in self.seen if t >= after and got == want), None)
            if at is not None:
                return round(at - after, 1)
            answers = [(round(t - after, 1), got) for t, got in self.seen]
            assert time.monotonic() < after + timeout, f"not {want} within {timeout:g} s; answers: {answers}"
            time.sleep(0.1)


def test_a_gateway_frozen_and_resumed_its_connected_device_gets_every_command(federation, endpoints, uid):
    ep = endpoints
    dev_id = f"frozen-{uid}"
    dev = device(ep, REGION, dev_id, keepalive=120, auto_reconnect=False)
    dev.subscribe(c.device_command_topic(dev_id, "#"))
    wait_present(ep, dev_id, REGION)
    before = router_metrics(ep)

    gateway = federation.node(gateway_node_name(REGION))
    # what a device of the region is told while the node is frozen: the region's other nodes,
    # or with none, the next region's (the zone's order: the federation's after the region)
    own = sorted(n["address"] for n in ep["gateways"][REGION]["nodes"])
    frozen_address = gateway.spec.bind_address("mqtt", gateway.host)
    others = [r for r in ep["gateways"] if r != REGION]
    next_answer = [a for a in own if a != frozen_address] or sorted(
        n["address"] for n in ep["gateways"][others[0]]["nodes"]
    )
    dns_ep = ep["dns"]
    watch = DnsWatch(ep, REGION, dev_id)
    assert watch.ask() == own, "before the freeze a device of the region is answered its gateways"
    watch.start()
    pids = processes.marked_pids(gateway.marker)
    assert pids, "the gateway's processes were not found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "set"), b'{"n": 1}')
        # back from the frozen region; its gateway does not answer: the session ended, parked
        assert wait_until(lambda: not _present(ep, dev_id), 90, 0.2), (
            "the router never gave up on the frozen gateway's session"
        )
        ended_after_s = time.monotonic() - frozen_at
        # the device counts as offline now: parked at once
        send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "set"), b'{"n": 2}')
        time.sleep(1)
        # the frozen node's listener still completes handshakes: only an MQTT check sees it hung
        dns_moved_s = watch.answered(next_answer, frozen_at, dns_ep["health_check_worst_case_s"] + 5)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    try:
        wait_until(lambda: {json.loads(r.payload)["n"] for r in dev.received} == {1, 2}, 20, 0.1)
        delivered_after_s = time.monotonic() - resumed_at
        time.sleep(8)  # a second copy (a reconcile round and a sweep) would arrive by now
        after = router_metrics(ep)
        key = 'fedgate_router_presence_reconciled_total{change="found"}'
        got = [json.loads(r.payload)["n"] for r in dev.received]
        back_within = dns_ep["health_check_interval"] + dns_ep["health_check_timeout"] + 5
        dns_back_s = watch.answered(own, resumed_at, back_within)
        record_counts(
            dns_health_check_worst_case_s=dns_ep["health_check_worst_case_s"],
            dns_ttl_s=dns_ep["ttl"],
            dns_next_region_after_freeze_s=dns_moved_s,
            dns_own_region_after_resume_s=dns_back_s,
            frozen_s=round(resumed_at - frozen_at, 1),
            session_ended_after_s=round(ended_after_s, 1),
            delivered_after_resume_s=round(delivered_after_s, 1),
            sessions_found_by_reconcile=int(after.get(key, 0.0) - before.get(key, 0.0)),
            sent=2,
            received=len(got),
            lost=len({1, 2} - set(got)),
            duplicated=len(got) - len(set(got)),
        )
        assert set(got) == {1, 2}, f"every command reaches the device that never left (got {got})"
        assert got.count(2) == 1, "command 2 was only ever parked: once"
        assert not dev.dropped.is_set(), "the device kept its connection: only the router's view changed"
        assert _present(ep, dev_id), "the router knows the device is at local-us again"
        assert dns_moved_s <= dns_ep["health_check_worst_case_s"] + 2, "DNS moved off the hung gateway"
        assert dns_back_s <= back_within
    finally:
        watch.stopped.set()
        dev.close()
        federation.wait_for_links(timeout=60)
