"""A worker process of the army: thousands of paho clients on one asyncio loop.

paho is driven through its socket callbacks instead of a thread per client,
so one process holds thousands of devices; the parent starts several
(`worker_main`, spawned by fedgate.army.run) to use every core.  A worker
talks to the parent only through the queue and events it is given: counts
("tick") while it runs, every device's acknowledged readings and received
commands ("done") at the end, or why it failed ("failed").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt

from backend import contract as c
from fedgate.army.plan import ArmyPlan, DeviceSpec

REPORT_EVERY_S = 0.5


@dataclass
class WorkerConfig:
    worker: int
    specs: list[DeviceSpec]
    plan: ArmyPlan
    ca_file: str | None


class ArmyDevice:
    """One simulated device: a paho client driven by the worker's event loop."""

    def __init__(self, worker: Worker, spec: DeviceSpec, home: int):
        self.w = worker
        self.spec = spec
        self.endpoint = home
        self.seq = 0
        self.inflight: dict[int, int] = {}
        self.acked: list[int] = []
        self.commands: list[int] = []
        self.connected = False
        self.connecting = False
        self.failures = 0
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=spec.device_id,
            clean_session=not worker.cfg.plan.persistent_sessions,
            protocol=mqtt.MQTTv311,
        )
        self.client.username_pw_set(spec.device_id, spec.secret)
        if worker.cfg.ca_file:
            self.client.tls_set(ca_certs=worker.cfg.ca_file)
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_socket_open = self._on_socket_open
        self.client.on_socket_close = self._on_socket_close
        self.client.on_socket_register_write = self._on_register_write
        self.client.on_socket_unregister_write = self._on_unregister_write
        self._connect_started = 0.0

    # socket plumbing: paho reads and writes when the loop says the socket is ready
    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        self.w.loop.add_reader(sock, client.loop_read)

    def _on_socket_close(self, client: Any, userdata: Any, sock: Any) -> None:
        self.w.loop.remove_reader(sock)
        self.w.loop.remove_writer(sock)

    def _on_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        self.w.loop.add_writer(sock, client.loop_write)

    def _on_unregister_write(self, client: Any, userdata: Any, sock: Any) -> None:
        self.w.loop.remove_writer(sock)

    # MQTT callbacks
    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self.connecting = False
        if getattr(rc, "is_failure", rc != 0):
            self.w.count["refused"] += 1
            self.failures += 1
            self.w.errors.append(f"{self.spec.device_id}: CONNACK {rc}")
            return
        self.connected = True
        self.failures = 0
        self.w.count["connects"] += 1
        self.w.connect_ms.append((time.monotonic() - self._connect_started) * 1000)
        qos = self.w.cfg.plan.command_qos
        if qos is not None:
            client.subscribe(c.device_command_topic(self.spec.device_id, "#"), qos=qos)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        was = self.connected
        self.connected = False
        self.connecting = False
        if was and not self.w.finishing:
            self.w.count["drops"] += 1
        if not self.w.finishing:
            self.w.schedule_reconnect(self)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: Any, props: Any = None) -> None:
        # the SUBACK: the gateway holds the command subscription (or refused it)
        refused = any(getattr(rc, "is_failure", False) for rc in codes)
        self.w.count["subscribe_refused" if refused else "subscribed"] += 1

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any = None) -> None:
        seq = self.inflight.pop(mid, None)
        if seq is not None:
            self.acked.append(seq)
            self.w.count["acked"] += 1

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        try:
            body = json.loads(msg.payload)
            n, sent_ms = int(body["n"]), float(body["t"])
        except (ValueError, KeyError, TypeError):
            self.w.count["foreign_messages"] += 1
            return
        if self.w.cfg.plan.command_qos == 0:
            # QoS 0 delivers at most once: the device acknowledges, or the router sends it again
            ack = json.dumps({"acks": [c.message_id(msg.topic, msg.payload)]})
            client.publish(c.device_ack_topic(self.spec.device_id), ack, qos=1)
        if sent_ms < self.w.born_ms:
            self.w.count["stale_commands"] += 1
            return
        if n not in self.commands:  # the drain waits for every command once, not for copies
            self.w.count["commands_distinct"] += 1
        self.commands.append(n)
        self.w.count["commands"] += 1
        self.w.downlink_ms.append(time.time() * 1000 - sent_ms)

    # actions
    def connect(self) -> None:
        """Connect to the current endpoint; on refusal, move on to the next one later."""
        if self.connected or self.connecting:
            return
        region, host, port = self.spec.endpoints[self.endpoint]
        self.connecting = True
        self._connect_started = time.monotonic()
        try:
            self.client.connect(host, port, keepalive=30)
        except OSError as e:
            self.connecting = False
            self.failures += 1
            self.w.count["connect_errors"] += 1
            if self.failures <= 3:
                self.w.errors.append(f"{self.spec.device_id} -> {region}: {e}")
            # this gateway does not answer: the next region in the list
            self.endpoint = (self.endpoint + 1) % len(self.spec.endpoints)
            self.w.schedule_reconnect(self)

    def publish(self) -> None:
        payload: dict[str, Any] = {"seq": self.seq, "t": round(time.time() * 1000, 1), "temp_c": 21.5}
        if self.w.cfg.plan.payload_pad:
            payload["pad"] = "x" * self.w.cfg.plan.payload_pad
        info = self.client.publish(
            c.device_telemetry_topic(self.spec.device_id), json.dumps(payload), qos=self.w.cfg.plan.qos
        )
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self.w.count["publish_errors"] += 1
            return
        self.w.count["sent"] += 1
        if self.w.cfg.plan.qos == 0:
            self.acked.append(self.seq)
        else:
            self.inflight[info.mid] = self.seq
        self.seq += 1

    def drop(self) -> None:
        """The network goes away under the device (no DISCONNECT)."""
        sock = self.client.socket()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def move_to(self, endpoint: int) -> None:
        """Roam: leave this gateway cleanly and connect to another region's."""
        self.endpoint = endpoint
        if self.connected:
            self.client.disconnect()  # _on_disconnect reconnects, now to `endpoint`


class Worker:
    def __init__(self, cfg: WorkerConfig, out: Any, go: Any, t0: Any, stop_publishing: Any, finish: Any):
        self.cfg = cfg
        self.out = out
        #: set by the parent once every device is connected; t0 holds that moment (wall clock)
        self.go, self.t0 = go, t0
        #: commands sent before this worker started are an earlier run's (sent again to a QoS 0
        #: device whose acknowledgement the router never got): acknowledged, not counted
        self.born_ms = time.time() * 1000
        self.stop_publishing = stop_publishing
        self.finish = finish
        self.finishing = False
        self.loop = asyncio.get_running_loop()
        self.count: dict[str, int] = defaultdict(int)
        self.errors: list[str] = []
        self.connect_ms: list[float] = []
        self.downlink_ms: list[float] = []
        self.devices = [ArmyDevice(self, s, 0) for s in cfg.specs]
        self.rng = random.Random(cfg.worker)
        #: how long connecting every device of this worker took
        self.connect_all_s = 0.0

    def schedule_reconnect(self, d: ArmyDevice) -> None:
        # jitter so that a storm's reconnects spread over a second, as real devices' do
        delay = self.rng.uniform(0.05, 1.0) * min(8, 2 ** max(0, d.failures - 1))
        self.count["reconnects"] += 1
        self.loop.call_later(delay, d.connect)

    def now(self) -> float:
        return time.time() - self.t0.value

    async def run(self) -> None:
        plan = self.cfg.plan
        share = len(self.devices) / max(1, plan.devices)
        misc = asyncio.create_task(self._misc())
        reporter = asyncio.create_task(self._report())
        started = time.monotonic()
        await self._connect_all(plan.connect_rate * share)
        self.connect_all_s = time.monotonic() - started
        self._send_counts()
        while not self.go.is_set():  # the run starts for every worker at once
            await asyncio.sleep(0.02)
        events = asyncio.create_task(self._events())
        await self._publish(plan.rate * share)
        # stop publishing; wait for the gateway's PUBACKs, keep receiving commands until told to finish
        deadline = time.monotonic() + plan.drain_timeout_s
        while any(d.inflight for d in self.devices) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        while not self.finish.is_set():
            await asyncio.sleep(0.1)
        self.finishing = True
        events.cancel()
        for d in self.devices:
            if d.connected:
                d.client.disconnect()
        await asyncio.sleep(0.5)  # let the DISCONNECTs go out
        reporter.cancel()
        misc.cancel()
        self._send_counts()
        self.out.put(
            (
                "done",
                self.cfg.worker,
                {
                    "acked": {d.spec.device_id: d.acked for d in self.devices},
                    "unacked": sum(len(d.inflight) for d in self.devices),
                    "commands": {d.spec.device_id: d.commands for d in self.devices},
                    "connect_ms": self.connect_ms,
                    "connect_all_s": self.connect_all_s,
                    "downlink_ms": self.downlink_ms,
                    "errors": self.errors[:50],
                },
            )
        )

    async def _connect_all(self, per_s: float) -> None:
        interval = 1.0 / per_s if per_s > 0 else 0.0
        for d in self.devices:
            d.connect()
            if interval:
                await asyncio.sleep(interval)
        deadline = time.monotonic() + 60
        while sum(d.connected for d in self.devices) < len(self.devices) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _publish(self, per_s: float) -> None:
        """Publish at `per_s` over the connected devices, round robin, until told to stop."""
        start = time.monotonic()
        done = 0
        i = 0
        n = len(self.devices)
        while not self.stop_publishing.is_set():
            due = int((time.monotonic() - start) * per_s)
            tries = 0
            while done < due and tries < n:
                d = self.devices[i % n]
                i += 1
                if d.connected:
                    d.publish()
                    done += 1
                    tries = 0
                else:
                    tries += 1
            if tries >= n:  # nobody connected right now: those readings are not sent
                self.count["skipped"] += due - done
                done = due
            await asyncio.sleep(0.005)

    async def _events(self) -> None:
        plan = self.cfg.plan
        todo: list[tuple[float, Callable[[], None]]] = []
        if plan.storm_at_s is not None:
            todo.append((plan.storm_at_s, self._storm))
        if plan.roam_at_s is not None:
            todo.append((plan.roam_at_s, self._roam))
        for at, action in sorted(todo, key=lambda x: x[0]):
            await asyncio.sleep(max(0.0, at - self.now()))
            action()

    def _storm(self) -> None:
        self.count["storm_dropped"] += sum(d.connected for d in self.devices)
        for d in self.devices:
            d.drop()

    def _roam(self) -> None:
        movers = self.devices[: int(len(self.devices) * self.cfg.plan.roam_share)]
        for d in movers:
            if len(d.spec.endpoints) > 1:
                d.move_to((d.endpoint + 1) % len(d.spec.endpoints))
                self.count["roamed"] += 1

    async def _misc(self) -> None:
        # keepalive and retransmission timers of every client, once a second
        while True:
            await asyncio.sleep(1.0)
            for d in self.devices:
                if d.connected or d.connecting:
                    d.client.loop_misc()

    def _send_counts(self) -> None:
        counts = dict(self.count)
        counts["connected"] = sum(d.connected for d in self.devices)
        counts["inflight"] = sum(len(d.inflight) for d in self.devices)
        self.out.put(("tick", self.cfg.worker, counts, self.downlink_ms[-2000:]))

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            self._send_counts()


def worker_main(cfg: WorkerConfig, out: Any, go: Any, t0: Any, stop_publishing: Any, finish: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop

    async def main() -> None:
        await Worker(cfg, out, go, t0, stop_publishing, finish).run()

    try:
        asyncio.run(main())
    except Exception as e:  # reported, never silent: the parent counts this worker's devices as failed
        out.put(("failed", cfg.worker, f"{type(e).__name__}: {e}"))
        raise
