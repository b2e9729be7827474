"""One device of the army: a paho client driven by its worker's asyncio loop.

paho reads and writes when the loop says the device's socket is ready (the socket
callbacks below), so a worker holds thousands of devices without a thread each.  A device
finds its gateway by DNS from its client network (fedgate/army/resolving.py), or -- a
target without DNS, the benchmarks' baseline -- from its list of endpoints.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt

from backend import contract as c
from fedgate.army.plan import DeviceSpec
from fedgate.resolver import NoHealthyGatewayError

if TYPE_CHECKING:
    from fedgate.army.worker import Worker


class ArmyDevice:
    """One simulated device: a paho client driven by the worker's event loop."""

    def __init__(self, worker: Worker, spec: DeviceSpec, home: int):
        self.w = worker
        self.spec = spec
        #: index into spec.endpoints (a device without DNS) or spec.networks (one with)
        self.endpoint = home
        self.network = home
        #: the gateway (address, port) dialled last, its region, and the one that failed the
        #: device last (a device with DNS dials another address of its answer if it has one)
        self.at: tuple[str, int] | None = None
        self.region: str | None = None
        self.lost: tuple[str, int] | None = None
        self.roaming = False
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
        self.lost = None
        self.w.count["connects"] += 1
        self.w.last_connect_s = self.w.now()
        self.w.connect_ms.append((time.monotonic() - self._connect_started) * 1000)
        qos = self.w.cfg.plan.command_qos
        if qos is not None:
            client.subscribe(c.device_command_topic(self.spec.device_id, "#"), qos=qos)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        was = self.connected
        self.connected = False
        self.connecting = False
        if was and not self.w.finishing and not self.roaming:
            self.w.count["drops"] += 1
            self.lost = self.at
        self.roaming = False
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
    def _where(self) -> tuple[str, str, int, str]:
        """(region, host, port, own address) to dial now: what DNS answers the device's client
        network, or the next of its endpoints."""
        if self.w.sites is None:
            return (*self.spec.endpoints[self.endpoint], self.spec.source)
        region, network = self.spec.networks[self.network]
        gateway, source = self.w.sites.where(self.spec.device_id, network, self.lost, self.spec.pick)
        return gateway.region, gateway.host, gateway.port, source

    def connect(self) -> None:
        """Connect to where the device finds its gateway; on refusal, try again later -- the
        next of its endpoints, or what DNS answers by then."""
        if self.connected or self.connecting:
            return
        try:
            region, host, port, source = self._where()
        except NoHealthyGatewayError as e:
            self._failed("dns_errors", f"{self.spec.device_id}: DNS: {e}")
            return
        self.at, self.region = (host, port), region
        self.connecting = True
        self._connect_started = time.monotonic()
        try:
            self.client.connect(host, port, keepalive=30, bind_address=source)
        except OSError as e:
            self.connecting = False
            self.lost = self.at
            if self.w.sites is None:  # this gateway does not answer: the next in the list
                self.endpoint = (self.endpoint + 1) % len(self.spec.endpoints)
            self._failed("connect_errors", f"{self.spec.device_id} -> {region} {host}: {e}")

    def _failed(self, counter: str, error: str) -> None:
        self.failures += 1
        self.w.count[counter] += 1
        if self.failures <= 3:
            self.w.errors.append(error)
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

    @property
    def can_roam(self) -> bool:
        return len(self.spec.networks if self.w.sites else self.spec.endpoints) > 1

    def roam(self) -> None:
        """Leave this gateway cleanly for another region: the next client network (DNS then
        answers that region's gateway), or the next endpoint."""
        if self.w.sites is None:
            self.endpoint = (self.endpoint + 1) % len(self.spec.endpoints)
        else:
            self.network = (self.network + 1) % len(self.spec.networks)
        self.lost = None
        if self.connected:
            self.roaming = True
            self.client.disconnect()  # _on_disconnect reconnects, now from there
