"""The baseline fedgate is measured against: one Mosquitto broker and a plain Python bridge.

This is the design fedgate's users start from: every device on one MQTT
broker (Mosquitto from Debian 13, the release fedgate's RabbitMQ comes from:
the system's package on Debian 13, the cached Debian 13 root on Debian 12,
started the way infra/local/broker.py starts a node), and a small Python
process that subscribes to the devices' telemetry (paho-mqtt) and produces
it to Kafka (confluent-kafka, with the router's producer settings).  For a fair
comparison the bridge is at least once, as fedgate's router is: it takes
QoS 1, acknowledges each message to the broker only after Kafka's delivery
report (paho's manual acks), and keys each record by device.

    with Baseline(workdir, port, bootstrap, cache_dir) as b:  # Mosquitto and the bridge
        b.target(specs)                      # the army's Target for the same devices
    with Mosquitto(folder, port, debian13_runtime(cache_dir)) as m:  # a fresh broker alone
        m.pids(), m.version

Mosquitto is configured for a fleet, not left at its defaults: 1000
in-flight QoS 1 messages per client (its default, 20, would cap the bridge
at a few thousand messages/s) and a deep per-client queue.  It keeps
messages in memory (no persistence): its PUBACK means "in memory", where a
fedgate gateway's PUBACK means "in a durable queue on disk".
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from backend.polling import wait_until
from fedgate.army import CommandOpener, DeviceSpec, Target
from infra.local import processes
from infra.local.broker import MOSQUITTO, BrokerRuntime, debian13_runtime
from router.kafka import ensure_topics

TOPIC = "baseline.telemetry"
BRIDGE_CLIENT_ID = "baseline-bridge"


def mosquitto_conf(host: str, port: int) -> str:
    return (
        f"listener {port} {host}\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "max_inflight_messages 1000\n"
        "max_queued_messages 100000\n"
        "max_connections -1\n"
        "log_dest stderr\n"
        "log_type error\n"
        "log_type warning\n"
    )


def mosquitto_version(runtime: BrokerRuntime) -> str | None:
    """The version the runtime's Mosquitto reports (`mosquitto -h`: "mosquitto version 2.0.21")."""
    out = subprocess.run(
        runtime.command(MOSQUITTO, ["-h"], shared=[]), capture_output=True, text=True, timeout=30
    ).stdout
    found = re.search(r"mosquitto version (\S+)", out)
    return found.group(1) if found else None


class Mosquitto:
    """One Mosquitto broker of Debian 13, configured for a fleet, started fresh; stopped on exit."""

    def __init__(self, folder: Path, port: int, runtime: BrokerRuntime, host: str = "127.0.0.1"):
        self.dir, self.port, self.runtime, self.host = folder, port, runtime, host
        self.proc: subprocess.Popen[bytes] | None = None
        self.version: str | None = None

    def __enter__(self) -> Mosquitto:
        self.runtime.check_program("the benchmarks' baseline broker", MOSQUITTO)
        self.version = mosquitto_version(self.runtime)
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "mosquitto.conf"
        conf.write_text(mosquitto_conf(self.host, self.port))
        # the folder holding its config is bound into the root at the same path; every step of
        # the command execs, so the pid is Mosquitto's own
        argv = self.runtime.command(MOSQUITTO, ["-c", str(conf)], shared=[self.dir])
        with open(self.dir / "mosquitto.log", "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_port(self.host, self.port, self.proc, "mosquitto")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            processes.stop_child(self.proc, grace=30)

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc and self.proc.poll() is None else []


class Baseline:
    def __init__(self, workdir: Path, port: int, bootstrap: str, cache_dir: Path, host: str = "127.0.0.1"):
        self.dir = workdir / "baseline"
        self.port, self.bootstrap, self.host = port, bootstrap, host
        self.broker = Mosquitto(self.dir, port, debian13_runtime(cache_dir), host)
        self.bridge: subprocess.Popen[bytes] | None = None

    @property
    def version(self) -> str | None:
        return self.broker.version

    def __enter__(self) -> Baseline:
        ensure_topics(self.bootstrap, [TOPIC], 6, 1)
        self.broker.__enter__()
        try:
            self._start_bridge()
        except BaseException:
            self.broker.__exit__()
            raise
        return self

    def _start_bridge(self) -> None:
        with open(self.dir / "bridge.log", "ab") as log:
            self.bridge = bridge = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.baseline_bridge",
                    self.host,
                    str(self.port),
                    self.bootstrap,
                    TOPIC,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def subscribed_or_exited() -> str:
            if "subscribed" in (self.dir / "bridge.log").read_text():
                return "subscribed"
            return "exited" if bridge.poll() is not None else ""

        if wait_until(subscribed_or_exited, 30, 0.1) != "subscribed":
            processes.stop_child(bridge, grace=5)
            raise RuntimeError(f"the baseline bridge did not start: {(self.dir / 'bridge.log').read_text()}")

    def __exit__(self, *exc: object) -> None:
        if self.bridge is not None:  # the bridge first: it flushes into Kafka
            processes.stop_child(self.bridge, grace=30)
        self.broker.__exit__()

    def broker_pids(self) -> list[int]:
        return self.broker.pids()

    def bridge_pids(self) -> list[int]:
        return [self.bridge.pid] if self.bridge and self.bridge.poll() is None else []

    def target(self, specs: list[DeviceSpec]) -> Target:
        """The same devices, every one on the one broker."""
        return mosquitto_target(specs, self.host, self.port, self.bootstrap, self.commands())

    def commands(self) -> CommandOpener:
        """A backend service's commands, published straight to the broker (there is no router)."""
        host, port = self.host, self.port

        def opener() -> tuple[Any, Any]:
            import paho.mqtt.client as mqtt

            client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="baseline-commands")
            client.max_inflight_messages_set(1000)
            client.connect(host, port)
            client.loop_start()

            def send(device: str, body: bytes) -> None:
                info = client.publish(f"devices/{device}/commands/set", body, qos=1)
                info.wait_for_publish(10)
                if not info.is_published():
                    raise RuntimeError("no PUBACK from mosquitto")

            def close() -> None:
                client.disconnect()
                client.loop_stop()

            return send, close

        return opener


def mosquitto_target(
    specs: list[DeviceSpec], host: str, port: int, bootstrap: str, commands: CommandOpener | None = None
) -> Target:
    """The army's Target for `specs`, every device on the Mosquitto at host:port."""
    return Target(
        "baseline",
        [DeviceSpec(s.device_id, s.secret, (("mosquitto", host, port),)) for s in specs],
        ["mosquitto"],
        bootstrap,
        kafka_topic=TOPIC,
        commands=commands,
    )


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], name: str) -> None:
    import socket

    def listening_or_exited() -> str:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return "listening"
        except OSError:
            return "exited" if proc.poll() is not None else ""

    if wait_until(listening_or_exited, 15, 0.1) != "listening":
        raise RuntimeError(f"{name} did not start on {host}:{port}")
