"""The baseline fedgate is measured against: one Mosquitto broker and a plain Python bridge.

This is the design fedgate's users start from: every device on one MQTT
broker (Debian's `mosquitto`), and a small Python process that subscribes
to the devices' telemetry (paho-mqtt) and produces it to Kafka
(confluent-kafka, with the router's producer settings).  For a fair
comparison the bridge is at least once, as fedgate's router is: it takes
QoS 1, acknowledges each message to the broker only after Kafka's delivery
report (paho's manual acks), and keys each record by device.

    with Baseline(workdir, port, bootstrap) as b:   # Mosquitto and the bridge, stopped on exit
        b.target(specs)                              # the army's Target for the same devices

Mosquitto is configured for a fleet, not left at its defaults: 1000
in-flight QoS 1 messages per client (its default, 20, would cap the bridge
at a few thousand messages/s) and a deep per-client queue.  It keeps
messages in memory (no persistence): its PUBACK means "in memory", where a
fedgate gateway's PUBACK means "in a durable queue on disk".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedgate.army import CommandOpener, DeviceSpec, Target
from infra.local import processes
from router.kafka import ensure_topics

TOPIC = "baseline.telemetry"
BRIDGE_CLIENT_ID = "baseline-bridge"


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/bin/mosquitto") if os.path.exists(p)), None
    )


class Baseline:
    def __init__(self, workdir: Path, port: int, bootstrap: str, host: str = "127.0.0.1"):
        self.dir = workdir / "baseline"
        self.port, self.bootstrap, self.host = port, bootstrap, host
        self.broker: subprocess.Popen[bytes] | None = None
        self.bridge: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Baseline:
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError(
                "mosquitto is not installed (run `make setup`, which installs Debian's mosquitto)"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} {self.host}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            "max_inflight_messages 1000\n"
            "max_queued_messages 100000\n"
            "max_connections -1\n"
            "log_dest stderr\n"
            "log_type error\n"
            "log_type warning\n"
        )
        ensure_topics(self.bootstrap, [TOPIC], 6, 1)
        with open(self.dir / "mosquitto.log", "ab") as log:  # the child keeps its own copy of the fd
            self.broker = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        _wait_port(self.host, self.port, self.broker, "mosquitto")
        with open(self.dir / "bridge.log", "ab") as log:
            self.bridge = subprocess.Popen(
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
        deadline = time.monotonic() + 30
        while "subscribed" not in (self.dir / "bridge.log").read_text():
            if self.bridge.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the baseline bridge did not start: {(self.dir / 'bridge.log').read_text()}"
                )
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in (self.bridge, self.broker):  # the bridge first: it flushes into Kafka
            if proc is not None:
                processes.stop_child(proc, grace=30)

    def broker_pids(self) -> list[int]:
        return [self.broker.pid] if self.broker and self.broker.poll() is None else []

    def target(self, specs: list[DeviceSpec]) -> Target:
        """The same devices, every one on the one broker."""
        return Target(
            "baseline",
            [DeviceSpec(s.device_id, s.secret, (("mosquitto", self.host, self.port),)) for s in specs],
            ["mosquitto"],
            self.bootstrap,
            kafka_topic=TOPIC,
            commands=self.commands(),
        )

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


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], name: str) -> None:
    import socket

    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start on {host}:{port}") from None
            time.sleep(0.1)
