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
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from backend import contract as c
from backend.amqp import send_command
from infra.local import processes
from infra.local.driver import gateway_node_name
from tests.helpers import device, leader_url, record_counts, router_metrics, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.slow, pytest.mark.chaos]

REGION = "local-us"


def _present(ep: dict, dev_id: str) -> bool:
    with urllib.request.urlopen(f"{leader_url(ep)}/presence?device={dev_id}", timeout=5) as r:
        return bool(json.load(r)["devices"])


def test_a_gateway_frozen_and_resumed_its_connected_device_gets_every_command(federation, endpoints, uid):
    ep = endpoints
    dev_id = f"frozen-{uid}"
    dev = device(ep, REGION, dev_id, keepalive=120, auto_reconnect=False)
    dev.subscribe(c.device_command_topic(dev_id, "#"))
    wait_present(ep, dev_id, REGION)
    before = router_metrics(ep)

    gateway = federation.node(gateway_node_name(REGION))
    pids = processes.marked_pids(gateway.marker)
    assert pids, "the gateway's processes were not found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "set"), b'{"n": 1}')
        # back from the frozen region; its gateway does not answer: the session ended, parked
        deadline = time.monotonic() + 90
        while _present(ep, dev_id):
            assert time.monotonic() < deadline, "the router never gave up on the frozen gateway's session"
            time.sleep(0.2)
        ended_after_s = time.monotonic() - frozen_at
        # the device counts as offline now: parked at once
        send_command(ep["backend"]["url"], dev_id, c.device_command_topic(dev_id, "set"), b'{"n": 2}')
        time.sleep(1)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    try:
        deadline = time.monotonic() + 20
        while {json.loads(r.payload)["n"] for r in dev.received} != {1, 2} and time.monotonic() < deadline:
            time.sleep(0.1)
        delivered_after_s = time.monotonic() - resumed_at
        time.sleep(8)  # a second copy (a reconcile round and a sweep) would arrive by now
        after = router_metrics(ep)
        key = 'fedgate_router_presence_reconciled_total{change="found"}'
        got = [json.loads(r.payload)["n"] for r in dev.received]
        record_counts(
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
    finally:
        dev.close()
        federation.wait_for_links(timeout=60)
