"""A command's life, as its sender follows it (router/outcomes.py, `fedgate command <id>`).

Tried against the real federation: a command to a connected device that
acknowledges it (QoS 0 subscription), one to a registered device that is
away and connects later, and one to an id that is not registered.  Each
must show, in Kafka and through the CLI, every step the router took and the
last one: acknowledged, routed, dead-lettered with the reason.  Then
`fedgate send --wait` as a sender uses it: it must end at each way a command
can end -- delivered to a QoS 1 session, acknowledged, expired while the
device stayed away -- with that outcome and its exit status.
"""

from __future__ import annotations

import json
import threading

import pytest

from backend import contract as c
from backend.amqp import send_command
from backend.command_outcomes import read_outcomes
from backend.polling import wait_until
from fedgate import cli
from tests.helpers import device, record_counts, router_metrics, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def _send(endpoints, dev_id: str, name: str, payload: str) -> str:
    topic = c.device_command_topic(dev_id, name)
    send_command(endpoints["backend"]["url"], dev_id, topic, payload)
    return c.message_id(topic, payload.encode())


def _steps(endpoints, command_id: str, until: str, timeout: float = 20.0) -> list[tuple[str, str]]:
    """The command's steps on record once the last is `until`."""
    got: list[tuple[str, str]] = []

    def ended() -> bool:
        nonlocal got
        got = [(s.outcome, s.region) for s in read_outcomes(endpoints["kafka"]["bootstrap"], command_id)]
        return bool(got) and got[-1][0] == until

    assert wait_until(ended, timeout, 0.3), f"command {command_id}: {got}, never {until}"
    return got


def _timed(endpoints, outcome: str) -> float:
    """Commands the leading router timed to `outcome` (fedgate_router_command_seconds)."""
    return router_metrics(endpoints).get(f'fedgate_router_command_seconds_count{{outcome="{outcome}"}}', 0.0)


def test_a_command_to_a_connected_device_that_acknowledges_is_routed_then_acknowledged(endpoints, uid):
    dev_id = f"life-ack-{uid}"
    d = device(endpoints, "local-us", dev_id)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"), qos=0)
        wait_present(endpoints, dev_id, "local-us")
        timed = _timed(endpoints, "acknowledged")
        command_id = _send(endpoints, dev_id, "open", '{"valve": 2}')
        d.ack(*d.wait_for(1))
        steps = _steps(endpoints, command_id, "acknowledged")
        record_counts(sent=1, delivered=len(d.received), steps=len(steps), acknowledged=1, lost=0)
        assert steps == [("accepted", ""), ("routed", "local-us"), ("acknowledged", "")]
        # its way timed on the router that routes commands, for an objective on it
        assert wait_until(lambda: _timed(endpoints, "acknowledged") >= timed + 1, 10, 0.2)
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
        assert steps == [("accepted", ""), ("parked", ""), ("routed", "local-eu")]


def test_a_command_for_an_unregistered_id_ends_dead_lettered_with_the_reason_and_the_cli_shows_it(
    federation, endpoints, uid, monkeypatch, capsys
):
    ghost = f"life-ghost-{uid}"
    command_id = _send(endpoints, ghost, "x", "{}")
    steps = read_outcomes(endpoints["kafka"]["bootstrap"], command_id, wait_s=20)
    record_counts(sent=1, steps=len(steps), deadlettered=sum(s.outcome == "deadlettered" for s in steps))
    assert [(s.outcome, s.reason) for s in steps] == [
        ("accepted", ""),
        ("deadlettered", f"device {ghost!r} is not registered"),
    ]

    monkeypatch.setenv("FEDGATE_STATE_DIR", str(federation.state_dir))
    monkeypatch.setenv("FEDGATE_PORT_BASE", str(federation.settings.port_base))
    capsys.readouterr()
    assert cli.main(["command", command_id]) == 0
    out = capsys.readouterr().out
    assert f"deadlettered: device {ghost!r} is not registered" in out, out
    assert cli.main(["command", command_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[-1]["outcome"] == "deadlettered"
    assert cli.main(["command", "0" * 16]) == 1, "an id nothing is on record for says so"


def _send_and_follow(federation, monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """`fedgate send ... --wait` as a sender runs it: (exit status, stdout, stderr)."""
    monkeypatch.setenv("FEDGATE_STATE_DIR", str(federation.state_dir))
    monkeypatch.setenv("FEDGATE_PORT_BASE", str(federation.settings.port_base))
    capsys.readouterr()
    status = cli.main(["send", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_send_wait_ends_at_each_way_a_command_ends_with_its_outcome_and_exit_status(
    federation, endpoints, uid, monkeypatch, capsys
):
    """Three commands, each followed by `fedgate send --wait` until it ended: to a device holding
    a QoS 1 subscription (MQTT carries it on: delivered), to one holding QoS 0 that acknowledges
    it, and to a registered device that stays away past the command's expiry."""
    ended: dict[str, int] = {}

    # QoS 1: the session's queue has it; MQTT delivers it at least once
    q1 = f"wait-q1-{uid}"
    with device(endpoints, "local-us", q1) as d:
        d.subscribe(c.device_command_topic(q1, "#"), qos=1)
        wait_present(endpoints, q1, "local-us")
        status, out, err = _send_and_follow(
            federation,
            monkeypatch,
            capsys,
            q1,
            c.device_command_topic(q1, "open"),
            '{"n": 1}',
            "--wait",
            "20",
        )
        assert status == 0, out + err
        assert "accepted" in out and "routed at local-us (qos1 subscription)" in out, out
        assert f"delivered to {q1}'s session at local-us" in out, out
        d.wait_for(1, timeout=10)
        ended["delivered"] = len(d.received)

    # QoS 0: the device acknowledges what it got (router/acks.py); the sender sees that
    q0 = f"wait-q0-{uid}"
    with device(endpoints, "local-eu", q0) as d:
        d.subscribe(c.device_command_topic(q0, "#"), qos=0)
        wait_present(endpoints, q0, "local-eu")
        acking = threading.Thread(target=lambda: d.ack(*d.wait_for(1, timeout=15)), daemon=True)
        acking.start()
        status, out, err = _send_and_follow(
            federation,
            monkeypatch,
            capsys,
            q0,
            c.device_command_topic(q0, "open"),
            '{"n": 2}',
            "--wait",
            "20",
        )
        acking.join(15)
        assert status == 0, out + err
        assert "routed at local-eu (qos0 subscription)" in out and f"acknowledged by {q0}" in out, out
        ended["acknowledged"] = len(d.received)

    # away past its expiry: dead-lettered with the reason, and the sender is told so (exit 1)
    away = f"wait-away-{uid}"
    endpoints["credentials"](away)
    status, out, err = _send_and_follow(
        federation,
        monkeypatch,
        capsys,
        away,
        c.device_command_topic(away, "open"),
        '{"n": 3}',
        "--expires-in",
        "2",
        "--wait",
        "30",
    )
    assert status == 1, out + err
    assert "parked" in out and "was dead-lettered" in err and "expired" in err, out + err
    ended["deadlettered"] = 1
    record_counts(sent=3, **ended, lost=0)
