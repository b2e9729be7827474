"""Simulated devices: real MQTT 3.1.1 or MQTT 5 clients (paho-mqtt) for the demo and the tests.

A SimDevice connects to its region's gateway, publishes at QoS 1 and waits
for the PUBACK (the gateway's confirm that the message is safely queued), and
records what it receives.  It is deliberately synchronous and small; the
device army for benchmarks builds on the same client.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from backend import contract as c
from backend.errors import FedgateError
from fedgate.dns_resolver import DnsResolver
from fedgate.resolver import Endpoint


class DeviceError(FedgateError):
    pass


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    at: float = field(default_factory=time.time)
    #: MQTT 5 PUBLISH properties (paho's Properties; None for an MQTT 3.1.1 device)
    properties: Any = None

    def json(self) -> Any:
        return json.loads(self.payload)

    def prop(self, name: str) -> Any:
        """One MQTT 5 property by paho's name (ResponseTopic, CorrelationData, ...), or None."""
        return getattr(self.properties, name, None) if self.properties is not None else None

    @property
    def user_properties(self) -> dict[str, str]:
        return dict(self.prop("UserProperty") or [])


def publish_properties(
    *,
    user: dict[str, str] | list[tuple[str, str]] | None = None,
    response_topic: str | None = None,
    correlation_data: bytes | None = None,
    content_type: str | None = None,
) -> Properties:
    """MQTT 5 PUBLISH properties for SimDevice.publish."""
    p = Properties(PacketTypes.PUBLISH)
    if user:
        p.UserProperty = list(user.items()) if isinstance(user, dict) else list(user)
    if response_topic is not None:
        p.ResponseTopic = response_topic
    if correlation_data is not None:
        p.CorrelationData = correlation_data
    if content_type is not None:
        p.ContentType = content_type
    return p


class SimDevice:
    def __init__(
        self,
        device_id: str,
        host: str,
        port: int,
        username: str,
        password: str,
        *,
        clean_session: bool = True,
        keepalive: int = 30,
        auto_reconnect: bool = True,
        resolver: DnsResolver | None = None,
        tls_ca: str | None = None,
        mqtt5: bool = False,
        source: str | None = None,
    ):
        self.device_id = device_id
        #: the device's own address (its connections leave from it); None: the system's choice
        self.source = source
        self.mqtt5 = mqtt5
        self.clean_session = clean_session
        self.host, self.port = host, port
        #: with a resolver the device fails over to the next nearest healthy gateway
        self.resolver = resolver
        self.endpoint: Endpoint | None = None
        #: gateways this device lost, oldest first (failover tests read it)
        self.failovers: list[Endpoint] = []
        #: one failover at a time: a connection that drops while a failover is connecting is
        #: that failover's to retry, not a second one's (two would each dial, and the second
        #: would stop the first's connection and count a gateway it never lost)
        self._failover_guard = threading.Lock()
        self._failover_running = False
        #: set when the connection being opened or held drops; connect() stops waiting at once
        self._attempt_dropped = threading.Event()
        #: filters this device subscribed to: a clean session loses them, so a failover renews them
        self.subscriptions: dict[str, int] = {}
        # MQTT 5 has no clean-session flag at CONNECT's construction: clean_start goes with connect()
        # paho reconnects by itself (to the same gateway) only for a device without a resolver:
        # one with a resolver moves on by itself (_fail_over), and a second reconnect racing it
        # -- or reviving a device told not to reconnect -- would be a second session
        paho_reconnects = auto_reconnect and resolver is None
        if mqtt5:
            self.client = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2,
                client_id=device_id,
                protocol=mqtt.MQTTv5,
                reconnect_on_failure=paho_reconnects,
            )
        else:
            self.client = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2,
                client_id=device_id,
                clean_session=clean_session,
                protocol=mqtt.MQTTv311,
                reconnect_on_failure=paho_reconnects,
            )
        self.client.username_pw_set(username, password)
        if tls_ca:
            # MQTT over TLS: the gateway's certificate must chain to this CA and name the host
            self.client.tls_set(ca_certs=tls_ca)
        self.keepalive = keepalive
        self.auto_reconnect = auto_reconnect
        #: set when the server closed the connection (e.g. a newer session took over)
        self.dropped = threading.Event()
        self.received: list[Received] = []
        self._cond = threading.Condition()
        self._connected = threading.Event()
        self._connect_rc: Any = None
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = self._on_disconnect
        # PUBACKs can take a while when the gateway applies back-pressure.
        self.client.max_inflight_messages_set(100)

    # --- callbacks (paho's network thread) ------------------------------------

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self._connect_rc = rc
        self._connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self._connected.clear()
        if getattr(rc, "is_failure", False) or rc not in (0, None):
            self.dropped.set()
            self._attempt_dropped.set()
            if self.resolver is not None and self.auto_reconnect:
                # paho would retry the same gateway; a device re-resolves instead.
                # The loop thread cannot stop itself: a helper thread moves on.
                client.disconnect()
                with self._failover_guard:
                    if self._failover_running:
                        return  # its attempt failed: the running failover tries the next
                    self._failover_running = True
                threading.Thread(
                    target=self._fail_over, name=f"failover-{self.device_id}", daemon=True
                ).start()
            elif not self.auto_reconnect:
                # disconnect() from the callback stops paho's automatic reconnect
                client.disconnect()

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        with self._cond:
            props = msg.properties if self.mqtt5 else None
            self.received.append(Received(msg.topic, msg.payload, msg.qos, msg.retain, properties=props))
            self._cond.notify_all()

    def _fail_over(self) -> None:
        """Connect to what DNS answers now, for up to a minute; again if that connection drops
        before this thread is done (the callback left it to this one)."""
        while True:
            self.client.loop_stop()
            lost = self.endpoint
            if lost is not None:
                self.failovers.append(lost)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    self.connect(exclude=[lost] if lost else [])
                    for topic_filter, qos in list(self.subscriptions.items()):
                        self.subscribe(topic_filter, qos)
                    break
                except (DeviceError, ConnectionError):
                    time.sleep(0.5)
            with self._failover_guard:
                if self.connected or time.monotonic() >= deadline or not self.auto_reconnect:
                    self._failover_running = False
                    return

    # --- API ---------------------------------------------------------------------

    @classmethod
    def nearest(
        cls,
        device_id: str,
        resolver: DnsResolver,
        username: str,
        password: str,
        **kw: Any,
    ) -> SimDevice:
        """A device that picks its gateway the way a device would: the nearest healthy region."""
        ep = resolver.endpoints[0]
        kw.setdefault("source", resolver.source)
        return cls(device_id, ep.host, ep.port, username, password, resolver=resolver, **kw)

    @property
    def region(self) -> str | None:
        return self.endpoint.region if self.endpoint else None

    def connect(self, timeout: float = 10.0, exclude: list[Endpoint] | None = None) -> SimDevice:
        if self.resolver is not None:
            self.endpoint = self.resolver.resolve(exclude or [])
            self.host, self.port = self.endpoint.host, self.endpoint.port
        self._connected.clear()
        self._attempt_dropped.clear()
        kw: dict[str, Any] = {}
        if self.mqtt5:
            kw["clean_start"] = self.clean_session
            if not self.clean_session:  # MQTT 5: a session outlives its connection only with an expiry
                kw["properties"] = Properties(PacketTypes.CONNECT)
                kw["properties"].SessionExpiryInterval = 86_400
        try:
            if self.source:
                kw["bind_address"] = self.source
            self.client.connect(self.host, self.port, keepalive=self.keepalive, **kw)
        except OSError as e:
            raise DeviceError(f"{self.device_id}: cannot reach {self.host}:{self.port}: {e}") from e
        self.client.loop_start()
        waited = time.monotonic() + timeout
        while not self._connected.wait(0.05):
            if self._attempt_dropped.is_set() or time.monotonic() > waited:
                self.close()
                why = (
                    "closed before its CONNACK"
                    if self._attempt_dropped.is_set()
                    else f"no CONNACK in {timeout}s"
                )
                raise DeviceError(f"{self.device_id}: {self.host}:{self.port}: {why}")
        if self._connect_rc != 0 and getattr(self._connect_rc, "is_failure", True):
            rc = self._connect_rc
            self.close()
            raise DeviceError(f"{self.device_id}: connection refused: {rc}")
        return self

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def subscribe(self, topic_filter: str, qos: int = 1, timeout: float = 10.0) -> None:
        done = threading.Event()
        refused: list[Any] = []

        def on_subscribe(client: Any, userdata: Any, mid: int, reason_codes: Any, props: Any) -> None:
            # MQTT 3.1.1 SUBACK: 0x80 is a refusal (e.g. not authorised for that filter)
            refused.extend(rc for rc in reason_codes if getattr(rc, "is_failure", False))
            done.set()

        self.client.on_subscribe = on_subscribe
        result, _ = self.client.subscribe(topic_filter, qos)
        if result != mqtt.MQTT_ERR_SUCCESS or not done.wait(timeout):
            raise DeviceError(f"{self.device_id}: SUBSCRIBE {topic_filter} not acknowledged")
        if refused:
            raise DeviceError(f"{self.device_id}: SUBSCRIBE {topic_filter} refused by the gateway")
        self.subscriptions[topic_filter] = qos

    def publish(
        self,
        topic: str,
        payload: bytes | str | dict[str, Any],
        qos: int = 1,
        timeout: float = 10.0,
        properties: Properties | None = None,
    ) -> None:
        """Publish and, for QoS 1, wait until the gateway acknowledged (PUBACK).

        `properties` (MQTT 5 devices only): see publish_properties."""
        if isinstance(payload, dict):
            payload = json.dumps(payload)
        try:
            info = self.client.publish(topic, payload, qos=qos, properties=properties)
        except OSError as e:
            # paho wakes its network thread through a socket pair that a reconnect replaces:
            # a publish from another thread meanwhile can meet the old one closed (ECONNRESET).
            # The message is queued, may go after the reconnect, and was never acknowledged
            raise DeviceError(f"{self.device_id}: {topic}: {e}") from e
        if qos > 0:
            try:
                info.wait_for_publish(timeout)
            except RuntimeError as e:
                # not connected: paho may still send it after reconnecting, but nothing
                # acknowledged it, so nothing was promised
                raise DeviceError(f"{self.device_id}: {topic}: {e}") from e
            if not info.is_published():
                raise DeviceError(f"{self.device_id}: no PUBACK for {topic} in {timeout}s")

    def ack(self, *commands: Received, timeout: float = 10.0) -> None:
        """Acknowledge commands received through a QoS 0 subscription (docs/router.md): the
        router sends each again until it is acknowledged."""
        ids = [c.message_id(r.topic, r.payload) for r in commands]
        self.publish(c.device_ack_topic(self.device_id), {"acks": ids}, timeout=timeout)

    def reply(self, command: Received, payload: bytes | str | dict[str, Any], timeout: float = 10.0) -> None:
        """Answer an MQTT 5 command: publish to its response topic with its correlation data."""
        topic = command.prop("ResponseTopic")
        if not topic:
            raise DeviceError(f"{self.device_id}: {command.topic} has no response topic to answer on")
        corr = command.prop("CorrelationData")
        self.publish(topic, payload, timeout=timeout, properties=publish_properties(correlation_data=corr))

    def publish_async(self, topic: str, payload: bytes | str, qos: int = 1) -> mqtt.MQTTMessageInfo:
        return self.client.publish(topic, payload, qos=qos)

    def wait_for(self, count: int = 1, timeout: float = 10.0) -> list[Received]:
        """Wait until at least `count` messages arrived; return all received so far."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.received) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self.received)

    def close(self) -> None:
        try:
            self.client.disconnect()
        finally:
            # paho's network thread clears its handle as it exits after the disconnect, and a
            # loop_stop between its check and its join raises AttributeError (paho-mqtt 2.x;
            # seen once in `make test`, 2026-12-06): the thread is gone then, nothing to stop
            with contextlib.suppress(AttributeError):
                self.client.loop_stop()

    def __enter__(self) -> SimDevice:
        return self if self.connected else self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()
