"""Devices prove who they are, and each is confined to its own topics, on the real gateways.

Tried: no login, a wrong secret, a revoked device, device A publishing as B,
A subscribing to B's commands, and A claiming B's client id at either gateway.
Each is refused, nothing of A's reaches B's topics or Kafka, B's own traffic
is untouched (B stays connected), and the refusal is visible (the gateway's log).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from backend import contract as c
from backend.amqp import send_command
from fedgate import cli
from fedgate.devices import DeviceError, SimDevice
from infra import device_registry
from infra.local import processes
from tests.helpers import REFUSED, device, kafka_records, record_counts, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def mqtt(endpoints, region: str, client_id: str, user: str | None, secret: str | None, **kw) -> SimDevice:
    ep = endpoints
    d = SimDevice(
        client_id,
        ep["gateways"][region]["address"],
        ep["gateways"][region]["mqtt"],
        user or "",
        secret or "",
        **kw,
    )
    if user is None:
        d.client.username_pw_set(None)  # no user name at all: anonymous
    return d


def gateway_log(federation, region: str) -> str:
    return federation.node(f"gw-{region}").log_file.read_text(errors="replace")


@pytest.mark.parametrize(
    "user, secret",
    [(None, None), ("nobody", "guess"), ("guest", "guest"), (c.ADMIN_USER, "wrong")],
    ids=["anonymous", "unknown-user", "guest", "wrong-admin-secret"],
)
def test_a_client_without_valid_credentials_is_refused(endpoints, uid, user, secret):
    d = mqtt(endpoints, "local-eu", f"anon-{uid}", user, secret, auto_reconnect=False)
    with pytest.raises(DeviceError, match=REFUSED):
        d.connect(timeout=5)


def test_a_device_with_a_wrong_or_rotated_secret_is_refused(endpoints, federation, uid):
    dev_id = f"rot-{uid}"
    old = federation.add_devices([dev_id])[dev_id]
    with pytest.raises(DeviceError):
        mqtt(endpoints, "local-eu", dev_id, dev_id, old + "x", auto_reconnect=False).connect(timeout=5)
    new = federation.add_devices([dev_id], rotate=True)[dev_id]
    with pytest.raises(DeviceError):
        mqtt(endpoints, "local-us", dev_id, dev_id, old, auto_reconnect=False).connect(timeout=5)
    with mqtt(endpoints, "local-us", dev_id, dev_id, new).connect():
        pass  # the new secret works on every gateway


def test_a_revoked_device_is_disconnected_and_cannot_reconnect(endpoints, federation, uid):
    dev_id = f"rev-{uid}"
    secret = federation.add_devices([dev_id])[dev_id]
    d = mqtt(endpoints, "local-eu", dev_id, dev_id, secret, auto_reconnect=False).connect()
    try:
        assert set(federation.revoke_devices([dev_id])) == {dev_id}
        assert d.dropped.wait(10), "the revoked device was disconnected"
    finally:
        d.close()
    for region in ("local-eu", "local-us"):
        with pytest.raises(DeviceError):
            mqtt(endpoints, region, dev_id, dev_id, secret, auto_reconnect=False).connect(timeout=5)
    assert dev_id not in federation.device_registry.devices()


def test_sync_removes_a_device_revoked_while_a_gateway_was_unreachable(endpoints, federation, uid):
    kept, gone = f"kept-{uid}", f"gone-{uid}"
    secrets = federation.add_devices([kept, gone])
    # revoked in the registry only: the push to the gateways never happened (they were unreachable)
    federation.device_registry.revoke([gone])
    mqtt(endpoints, "local-us", gone, gone, secrets[gone], auto_reconnect=False).connect().close()

    removed = federation.sync_devices()
    assert removed == {"local-eu": [gone], "local-us": [gone]}
    for region in ("local-eu", "local-us"):
        with pytest.raises(DeviceError):
            mqtt(endpoints, region, gone, gone, secrets[gone], auto_reconnect=False).connect(timeout=5)
        mqtt(endpoints, region, kept, kept, secrets[kept], auto_reconnect=False).connect().close()
    assert federation.sync_devices() == {"local-eu": [], "local-us": []}, "a second sync changes nothing"


def test_a_device_cannot_publish_as_another(endpoints, federation, uid):
    a_id, b_id = f"a-{uid}", f"b-{uid}"
    a = device(endpoints, "local-eu", a_id, auto_reconnect=False)
    try:
        with pytest.raises(DeviceError):
            # the gateway closes the connection instead of acking: no PUBACK
            a.publish(c.device_telemetry_topic(b_id), b'{"forged": true}', timeout=5)
        assert a.dropped.wait(10), "the gateway disconnected the device that tried"
    finally:
        a.close()
    with device(endpoints, "local-eu", b_id) as b:
        b.publish(c.device_telemetry_topic(b_id), b'{"genuine": true}')
    recs = kafka_records(
        endpoints,
        c.KAFKA_TELEMETRY_TOPIC,
        lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == b_id,
        expect=2,
        timeout=10,
    )
    assert [m.value() for m, _ in recs] == [b'{"genuine": true}'], "only B's own reading is in Kafka"
    assert "access to topic" in gateway_log(federation, "local-eu") and a_id in gateway_log(
        federation, "local-eu"
    )


def test_a_device_cannot_read_another_devices_commands(endpoints, federation, uid):
    a_id, b_id = f"a-{uid}", f"b-{uid}"
    b = device(endpoints, "local-eu", b_id)
    a = device(endpoints, "local-eu", a_id, auto_reconnect=False)
    try:
        b.subscribe(c.device_command_topic(b_id, "#"))
        for stolen in (c.device_command_topic(b_id, "#"), "devices/+/commands/#", "#"):
            with pytest.raises(DeviceError, match="refused|not acknowledged"):
                a.subscribe(stolen, timeout=5)
            if not a.connected:
                a.close()
                a = device(endpoints, "local-eu", a_id, auto_reconnect=False)
        wait_present(endpoints, b_id, "local-eu")
        send_command(
            endpoints["backend"]["url"], b_id, c.device_command_topic(b_id, "unlock"), b"secret-code"
        )
        assert [r.payload for r in b.wait_for(1)] == [b"secret-code"]
        time.sleep(1.0)
        assert a.received == [], "A received nothing of B's"
    finally:
        a.close()
        b.close()


def test_a_device_claiming_anothers_client_id_is_refused_at_connect_and_the_other_stays_connected(
    endpoints, federation, uid
):
    """A logs in with its own secret but B's client id, at B's gateway (where RabbitMQ would
    disconnect B, the holder of the id) and at the other one.  Before, A was let in and B
    was knocked off, again at each of A's reconnects; now the gateway's authentication
    refuses A at CONNECT, and B keeps its connection and gets its command once."""
    a_id, b_id = f"a-{uid}", f"b-{uid}"
    b = device(endpoints, "local-eu", b_id, auto_reconnect=False)
    try:
        b.subscribe(c.device_command_topic(b_id, "#"))
        wait_present(endpoints, b_id, "local-eu")
        _, a_secret = endpoints["credentials"](a_id)
        refused = 0
        for region in ("local-eu", "local-us"):
            impostor = mqtt(endpoints, region, b_id, a_id, a_secret, auto_reconnect=False)
            try:
                with pytest.raises(DeviceError, match="refused"):
                    impostor.connect()
                refused += 1
            finally:
                impostor.close()
        time.sleep(1.0)
        dropped = b.dropped.is_set()
        wait_present(endpoints, b_id, "local-eu")
        send_command(endpoints["backend"]["url"], b_id, c.device_command_topic(b_id, "x"), b"for-b")
        got = [r.payload for r in b.wait_for(1)]
        time.sleep(0.5)
        record_counts(claims=2, refused=refused, victim_dropped=int(dropped), victim_received=len(b.received))
        assert not dropped, "the device that holds the id was disconnected"
        assert got == [b"for-b"] and len(b.received) == 1
        assert f"is not device '{a_id}''s own" in gateway_log(federation, "local-eu")
    finally:
        b.close()


def test_devices_add_while_a_gateway_does_not_answer_names_it_and_sync_repairs_it(
    endpoints, federation, uid, tmp_path, monkeypatch, capsys
):
    """The gateway's process runs but its management API does not answer (SIGSTOP): the
    device is registered all the same, the CLI names the gateway in one line, and
    `devices sync` makes the device able to connect there once it answers."""
    dev_id = f"hung-{uid}"
    monkeypatch.setenv("FEDGATE_STATE_DIR", str(federation.state_dir))
    monkeypatch.setenv("FEDGATE_PORT_BASE", str(federation.settings.port_base))
    monkeypatch.setenv("FEDGATE_CLOUD_STATE_DIR", str(tmp_path / "cloud"))
    monkeypatch.setattr(device_registry, "ANSWER_TIMEOUT_S", 3.0)
    pids = processes.marked_pids(federation.node("gw-local-us").marker)
    assert pids
    capsys.readouterr()
    t0 = time.monotonic()
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        code = cli.main(["devices", "add", dev_id])
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    stopped_s = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert code == 1
    assert stopped_s < 15, f"the stop lasted {stopped_s:.1f} s"
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "local region local-us not updated (gateway gw-local-us:" in lines[0]
    assert "run `fedgate devices sync`" in lines[0]
    secret = next(line.split()[1] for line in out.splitlines() if line.startswith(f"{dev_id} "))
    assert dev_id in federation.device_registry.devices()

    # the gateway that answered has the device; the one that did not, not yet
    mqtt(endpoints, "local-eu", dev_id, dev_id, secret, auto_reconnect=False).connect().close()
    with pytest.raises(DeviceError):
        mqtt(endpoints, "local-us", dev_id, dev_id, secret, auto_reconnect=False).connect(timeout=5)

    assert cli.main(["devices", "sync"]) == 0
    out, err = capsys.readouterr()
    assert {line.split(":")[0] for line in out.splitlines()} == {"local-eu", "local-us"}, out + err
    mqtt(endpoints, "local-us", dev_id, dev_id, secret, auto_reconnect=False).connect().close()
