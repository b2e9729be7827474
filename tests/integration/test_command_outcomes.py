"""A command's life, as its sender follows it (router/outcomes.py, `fedgate command <id>`).

Tried against the real federation: a command to a connected device that
acknowledges it (QoS 0 subscription), one to a registered device that is
away and connects later, and one to an id that is not registered.  Each
must show, in Kafka and through the CLI, every step the router took and the
last one: acknowledged, routed, dead-lettered with the reason.
"""

from __future__ import annotations

import json
import time

import pytest

from backend import contract as c
from backend.amqp import send_command
from backend.command_outcomes import read_outcomes
from fedgate import cli
from tests.conftest import TEST_PORT_BASE
from tests.helpers import device, record_counts, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def _send(endpoints, dev_id: str, name: str, payload: str) -> str:
    topic = c.device_command_topic(dev_id, name)
    send_command(endpoints["backend"]["url"], dev_id, topic, payload)
    return c.message_id(topic, payload.encode())


def _steps(endpoints, command_id: str, until: str, timeout: float = 20.0) -> list[tuple[str, str]]:
    """The command's steps on record once the last is `until`."""
    deadline = time.monotonic() + timeout
    while True:
        got = [(s.outcome, s.region) for s in read_outcomes(endpoints["kafka"]["bootstrap"], command_id)]
        if got and got[-1][0] == until:
            return got
        assert time.monotonic() < deadline, f"command {command_id}: {got}, never {until}"
        time.sleep(0.3)


def test_a_command_to_a_connected_device_that_acknowledges_is_routed_then_acknowledged(endpoints, uid):
    dev_id = f"life-ack-{uid}"
    d = device(endpoints, "local-us", dev_id)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"), qos=0)
        wait_present(endpoints, dev_id, "local-us")
        command_id = _send(endpoints, dev_id, "open", '{"valve": 2}')
        d.ack(*d.wait_for(1))
        steps = _steps(endpoints, command_id, "acknowledged")
        record_counts(sent=1, delivered=len(d.received), steps=len(steps), acknowledged=1, lost=0)
        assert steps == [("routed", "local-us"), ("acknowledged", "")]
    finally:
        d.close()


def test_a_command_for_a_device_away_is_parked_then_routed_when_it_connects(endpoints, uid):
    dev_id = f"life-away-{uid}"
    endpoints["credentials"](dev_id)  # registered, never connected
    command_id = _send(endpoints, dev_id, "setup", '{"interval_s": 5}')
    _steps(endpoints, command_id, "parked")
    with device(endpoints, "local-eu", dev_id) as d:
        d.subscribe(c.device_command_topic(dev_id, "#"))
        d.wait_for(1, timeout=15)
        steps = _steps(endpoints, command_id, "routed")
        record_counts(sent=1, delivered=len(d.received), steps=len(steps), lost=1 - len(d.received))
        assert steps == [("parked", ""), ("routed", "local-eu")]


def test_a_command_for_an_unregistered_id_ends_dead_lettered_with_the_reason_and_the_cli_shows_it(
    federation, endpoints, uid, monkeypatch, capsys
):
    ghost = f"life-ghost-{uid}"
    command_id = _send(endpoints, ghost, "x", "{}")
    steps = read_outcomes(endpoints["kafka"]["bootstrap"], command_id, wait_s=20)
    record_counts(sent=1, steps=len(steps), deadlettered=sum(s.outcome == "deadlettered" for s in steps))
    assert [(s.outcome, s.reason) for s in steps] == [("deadlettered", f"device {ghost!r} is not registered")]

    monkeypatch.setenv("FEDGATE_STATE_DIR", str(federation.state_dir))
    monkeypatch.setenv("FEDGATE_PORT_BASE", str(TEST_PORT_BASE))
    capsys.readouterr()
    assert cli.main(["command", command_id]) == 0
    out = capsys.readouterr().out
    assert f"deadlettered: device {ghost!r} is not registered" in out, out
    assert cli.main(["command", command_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["outcome"] == "deadlettered"
    assert cli.main(["command", "0" * 16]) == 1, "an id nothing is on record for says so"
