"""The simulated device (fedgate/devices.py) the army, the demo and the tests use: what its
publish promises when paho fails under it."""

from __future__ import annotations

import pytest

from fedgate.devices import DeviceError, SimDevice


def test_a_publish_that_meets_pahos_replaced_wakeup_socket_was_never_acknowledged(monkeypatch):
    """paho wakes its network thread through a socket pair that a reconnect replaces; a
    publish from another thread meanwhile met the old one closed, and the ConnectionResetError
    ended the chaos suite's publishing thread (test_gateway_kill, run r12).  It is a publish
    nobody acknowledged: a DeviceError, as a publish while disconnected is."""
    d = SimDevice("sim-1", "127.0.0.1", 1, "sim-1", "secret")

    def reset(*args: object, **kwargs: object) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(d.client, "publish", reset)
    with pytest.raises(DeviceError, match="sim-1: devices/sim-1/telemetry: .*Connection reset by peer"):
        d.publish("devices/sim-1/telemetry", {"seq": 1})
