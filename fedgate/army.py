"""`fedgate army`: thousands of simulated devices against a running federation, counted end to end.

Each device is a real MQTT 3.1.1 client (paho-mqtt) with its own credentials
(`fedgate devices add`), connected to its home region's gateway.  Thousands
of them share one asyncio loop per worker process (paho driven through its
socket callbacks instead of a thread per client), and several worker
processes use every core.  Every device

- publishes telemetry at its share of the offered rate, QoS 1, with a
  sequence number and its send time (ms) in the payload;
- subscribes to its own command topic and records what arrives;
- reconnects on its own when its connection drops, to its home gateway or,
  if that does not answer, the next region in its list (failover).

The parent process registers the devices, starts the workers, sends
commands through the backend (`fedgate.commands`, confirmed), and counts:
uplink readings are checked against what a Kafka consumer reads back from
the telemetry topic, commands against what the devices received.  Nothing
is assumed: a reading counts as lost when the gateway acknowledged it
(PUBACK) and Kafka does not have it; a command when the backend confirmed
it and the device never got it.

Events, at a time into the run: a reconnect storm (every device's
connection dropped at once), roaming (a share of the devices moves to
another region), and a gateway killed (SIGKILL; its devices fail over).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import queue as queue_mod
import random
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import paho.mqtt.client as mqtt

from backend import contract as c

REPORT_EVERY_S = 0.5


@dataclass
class ArmyPlan:
    devices: int = 1000
    #: telemetry messages per second, the whole army together
    rate: float = 1000.0
    duration_s: float = 30.0
    processes: int = 2
    #: regions devices call home, round robin; empty: every gateway of the federation
    regions: list[str] = field(default_factory=list)
    #: commands per second sent through the router, spread over the devices
    commands_per_s: float = 0.0
    qos: int = 1
    #: MQTT persistent sessions: the gateway keeps a device's subscription while it is away
    persistent_sessions: bool = False
    tls: bool = False
    prefix: str = "army"
    #: new connections per second while the army connects
    connect_rate: float = 1000.0
    #: seconds into the run: drop every device's connection at once
    storm_at_s: float | None = None
    #: seconds into the run: this share of the devices moves to another region
    roam_at_s: float | None = None
    roam_share: float = 0.2
    #: (region, seconds into the run): that region's gateway is killed
    kill_gateway: tuple[str, float] | None = None
    #: how long to wait for stragglers (Kafka, command receipts) after the run
    drain_timeout_s: float = 60.0
    #: seconds at the start of the run left out of the latency percentiles (latency_all_ms has them)
    warmup_s: float = 0.0
    #: after the drain, how long to wait for a duplicate before counting (split between the
    #: devices' commands and Kafka's records)
    settle_s: float = 3.0
    payload_pad: int = 0

    def validate(self) -> ArmyPlan:
        if self.devices < 1 or self.processes < 1 or self.duration_s <= 0 or self.rate < 0:
            raise ValueError("devices, processes and duration must be positive, rate not negative")
        if self.settle_s < 0 or self.warmup_s < 0:
            raise ValueError("settle_s and warmup_s: not negative")
        if self.qos not in (0, 1):
            raise ValueError("qos: 0 or 1")
        if not 0 <= self.roam_share <= 1:
            raise ValueError("roam_share: between 0 and 1")
        return self


@dataclass(frozen=True)
class DeviceSpec:
    device_id: str
    secret: str
    #: (region, host, port), home first: where the device connects, then fails over to
    endpoints: tuple[tuple[str, str, int], ...]


@dataclass
class WorkerConfig:
    worker: int
    specs: list[DeviceSpec]
    plan: ArmyPlan
    ca_file: str | None


def quantiles(values: list[float], points: int = 100) -> list[float]:
    """`points` evenly spaced quantiles (the last is the maximum): enough to draw a CDF."""
    if not values:
        return []
    v = sorted(values)
    return [round(v[min(len(v) - 1, int(len(v) * (i + 1) / points))], 2) for i in range(points)]


def percentile(values: list[float], q: float) -> float | None:
    """The value at quantile q (nearest rank, no interpolation), to 0.1; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 1)


def percentiles(values: list[float]) -> dict[str, float | None]:
    v = sorted(values)
    return {
        "p50": percentile(v, 0.50),
        "p95": percentile(v, 0.95),
        "p99": percentile(v, 0.99),
        "max": round(v[-1], 1) if v else None,
    }


# --- the worker: thousands of paho clients on one asyncio loop ------------------------------------


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
        client.subscribe(c.device_command_topic(self.spec.device_id, "#"), qos=1)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        was = self.connected
        self.connected = False
        self.connecting = False
        if was and not self.w.finishing:
            self.w.count["drops"] += 1
        if not self.w.finishing:
            self.w.schedule_reconnect(self)

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


# --- the parent: devices, commands, verification, progress ---------------------------------------


class KafkaVerifier(threading.Thread):
    """Reads the telemetry topic from where it ended before the run: what each army device has there."""

    def __init__(self, bootstrap: str, prefix: str, topic: str = c.KAFKA_TELEMETRY_TOPIC):
        super().__init__(daemon=True, name="army-kafka")
        # imported here: the worker processes import this module and never read Kafka
        from backend import kafka_read

        self.prefix = prefix + "-"
        self.consumer = kafka_read.throwaway_consumer(bootstrap, "army")
        kafka_read.assign_from_end(self.consumer, topic)
        self.seen: dict[str, list[int]] = defaultdict(list)
        self.latency_ms: list[float] = []
        #: the device's send time (ms) of each latency sample, to leave a warm-up out
        self.sent_ms: list[float] = []
        self.total = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def missing(self, acked: dict[str, list[int]]) -> int:
        """How many of these acknowledged readings the consumer has not seen (yet)."""
        with self.lock:
            return sum(len(set(seqs) - set(self.seen.get(d, ()))) for d, seqs in acked.items())

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for msg in self.consumer.consume(1000, 0.2):
                    if msg.error():
                        continue
                    key = (msg.key() or b"").decode(errors="replace")
                    if not key.startswith(self.prefix):
                        continue
                    try:
                        body = json.loads(msg.value())
                        seq, sent_ms = int(body["seq"]), float(body["t"])
                    except (ValueError, KeyError, TypeError):
                        continue
                    with self.lock:
                        self.seen[key].append(seq)
                        self.total += 1
                        self.latency_ms.append(msg.timestamp()[1] - sent_ms)
                        self.sent_ms.append(sent_ms)
        finally:
            self.consumer.close()


class UncheckedVerifier(KafkaVerifier):
    """For a target whose readings never reach Kafka: nothing is read, nothing is checked."""

    def __init__(self) -> None:
        threading.Thread.__init__(self, daemon=True, name="army-unchecked")
        self.seen = defaultdict(list)
        self.latency_ms = []
        self.sent_ms = []
        self.total = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def missing(self, acked: dict[str, list[int]]) -> int:
        return 0

    def run(self) -> None:
        self.stop.wait()


#: Opens a downlink connection in the sender's thread: (send(device, body) -> None, close()).
CommandOpener = Callable[[], tuple[Callable[[str, bytes], None], Callable[[], None]]]


class CommandSender(threading.Thread):
    """Sends numbered commands at a steady rate; counts what the next hop confirmed."""

    def __init__(self, opener: CommandOpener, devices: list[str], per_s: float):
        super().__init__(daemon=True, name="army-commands")
        self.opener, self.devices, self.per_s = opener, devices, per_s
        self.confirmed: dict[str, list[int]] = defaultdict(list)
        #: command number -> wall-clock time it was confirmed (to place a lost one in the run)
        self.sent_at: dict[int, float] = {}
        self.total = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        send, close = self.opener()
        try:
            start = time.monotonic()
            n = 0
            while not self.stop.is_set():
                due = int((time.monotonic() - start) * self.per_s)
                while n < due and not self.stop.is_set():
                    device = self.devices[n % len(self.devices)]
                    body = json.dumps({"n": n, "t": round(time.time() * 1000, 1)}).encode()
                    try:
                        send(device, body)
                    except Exception as e:  # not confirmed: not promised, and reported
                        if len(self.errors) < 20:
                            self.errors.append(f"command {n} to {device}: {e}")
                    else:
                        self.confirmed[device].append(n)
                        self.sent_at[n] = time.time()
                        self.total += 1
                    n += 1
                time.sleep(0.01)
        finally:
            close()


def router_commands(url: str) -> CommandOpener:
    """Commands through fedgate's router: fedgate.commands on the backend, publisher confirms."""

    def opener() -> tuple[Callable[[str, bytes], None], Callable[[], None]]:
        import pika

        from backend.amqp import connect

        conn = connect(url)
        ch = conn.channel()
        ch.confirm_delivery()

        def send(device: str, body: bytes) -> None:
            ch.basic_publish(
                c.COMMANDS_EXCHANGE,
                device,
                body,
                pika.BasicProperties(
                    delivery_mode=pika.DeliveryMode.Persistent,
                    headers={c.DEVICE_HEADER: device, c.TOPIC_HEADER: c.device_command_topic(device, "set")},
                ),
                mandatory=True,
            )

        return send, conn.close

    return opener


@dataclass
class Target:
    """What the fleet runs against: where each device connects, where its readings must land."""

    name: str
    specs: list[DeviceSpec]
    regions: list[str]
    kafka_bootstrap: str
    kafka_topic: str = c.KAFKA_TELEMETRY_TOPIC
    commands: CommandOpener | None = None
    ca_file: str | None = None
    #: kill(region) and restart(region) for plan.kill_gateway
    kill: Callable[[str], None] | None = None
    restart: Callable[[str], None] | None = None
    #: False: readings are not looked up in Kafka (a reference that stops short of it)
    verify: bool = True


def federation_target(fed: Any, plan: ArmyPlan, say: Callable[[str], None]) -> Target:
    """The local federation `fed` (infra.local.driver.LocalFederation), devices registered in it."""
    from infra.local.driver import gateway_node_name

    ep = fed.endpoints()
    regions = plan.regions or sorted(ep["gateways"])
    missing = [r for r in regions if r not in ep["gateways"]]
    if missing:
        raise ValueError(f"no gateway for {missing}; the federation has {sorted(ep['gateways'])}")
    port_kind = "mqtts" if plan.tls else "mqtt"
    if plan.tls and not ep.get("tls"):
        raise ValueError("--tls: the federation runs without TLS (FEDGATE_TLS=0)")
    all_regions = sorted(ep["gateways"])
    ids = [f"{plan.prefix}-{i:05d}" for i in range(plan.devices)]
    say(f"registering {len(ids)} devices (fedgate devices add --rotate)")
    secrets = fed.add_devices(ids, rotate=True)
    specs = []
    for i, d in enumerate(ids):
        home = regions[i % len(regions)]
        order = [home] + [r for r in all_regions if r != home]
        specs.append(
            DeviceSpec(d, secrets[d], tuple((r, ep["host"], ep["gateways"][r][port_kind]) for r in order))
        )
    tls = ep.get("tls") if plan.tls else None
    return Target(
        "fedgate",
        specs,
        regions,
        ep["kafka"]["bootstrap"],
        commands=router_commands(ep["backend"]["url"]),
        ca_file=tls["ca"] if tls else None,
        kill=lambda region: fed.node(gateway_node_name(region)).kill(),
        restart=lambda region: fed.start_node(gateway_node_name(region)),
    )


def run_army(
    fed: Any,
    plan: ArmyPlan,
    *,
    progress: Callable[[str], None] | None = None,
    line: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the army against the running federation `fed` (infra.local.driver.LocalFederation)."""
    plan.validate()
    say = progress or (lambda m: print(f"[army] {m}", file=sys.stderr, flush=True))
    return run_fleet(federation_target(fed, plan, say), plan, progress=say, line=line)


def run_fleet(
    target: Target,
    plan: ArmyPlan,
    *,
    progress: Callable[[str], None] | None = None,
    line: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `plan` against `target`: connect, publish and receive, then count against Kafka."""
    plan.validate()
    say = progress or (lambda m: print(f"[army] {m}", file=sys.stderr, flush=True))
    show = line or say
    specs = target.specs
    ids = [s.device_id for s in specs]
    verifier: KafkaVerifier = (
        KafkaVerifier(target.kafka_bootstrap, plan.prefix, target.kafka_topic)
        if target.verify
        else UncheckedVerifier()
    )
    verifier.start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go, stop_publishing, finish = ctx.Event(), ctx.Event(), ctx.Event()
    shared_t0 = ctx.Value("d", 0.0)
    t0 = time.time()  # until the run starts: the clock counts the connecting
    workers = []
    for w in range(min(plan.processes, len(specs))):
        cfg = WorkerConfig(w, specs[w :: plan.processes], plan, target.ca_file)
        p = ctx.Process(
            target=worker_main, args=(cfg, out, go, shared_t0, stop_publishing, finish), name=f"army-{w}"
        )
        p.start()
        workers.append(p)
    say(f"{len(workers)} worker processes, {len(specs)} devices over {', '.join(target.regions)}")

    ticks: dict[int, dict[str, int]] = {}
    dl_recent: dict[int, list[float]] = {}
    done: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    peak_inflight = [0]

    def pump(timeout: float) -> None:
        try:
            item = out.get(timeout=timeout)
        except queue_mod.Empty:
            return
        if item[0] == "tick":
            ticks[item[1]] = item[2]
            # readings the gateways have not acknowledged yet: the devices' side of a backlog
            peak_inflight[0] = max(peak_inflight[0], total("inflight"))
            dl_recent[item[1]] = item[3]
        elif item[0] == "done":
            done[item[1]] = item[2]
        elif item[0] == "failed":
            failed[item[1]] = item[2]

    def check_workers() -> None:
        """A worker that reported a failure, or died before it could (an import error in a
        spawned process, the OOM killer), ends the run: its devices would count as silent."""
        if failed:
            raise RuntimeError(f"army worker failed: {failed}")
        dead = {p.name: p.exitcode for p in workers if p.exitcode is not None and p.exitcode != 0}
        if dead:
            raise RuntimeError(f"army worker process exited before the end of the run: {dead}")

    def total(name: str) -> int:
        return sum(t.get(name, 0) for t in ticks.values())

    def status(phase: str) -> str:
        with verifier.lock:
            lat = percentiles(verifier.latency_ms[-5000:])
            in_kafka = verifier.total
        dl = percentiles([x for v in dl_recent.values() for x in v])
        return (
            f"{phase} t={time.time() - t0:5.1f}s connected {total('connected')}/{len(specs)} "
            f"sent {total('sent')} acked {total('acked')} in-kafka {in_kafka} "
            f"cmds {commands.total if commands else 0}/{total('commands')} "
            f"up p50 {lat['p50']} p99 {lat['p99']} ms, down p99 {dl['p99']} ms"
        )

    last_line = 0.0

    def tick_line(phase: str) -> None:
        nonlocal last_line
        if time.monotonic() - last_line > 1:
            show(status(phase))
            last_line = time.monotonic()

    commands: CommandSender | None = None
    killed_at: float | None = None
    try:
        # the run starts when every device is connected (or after two minutes, with those that are)
        deadline = time.monotonic() + 120
        while total("connected") < len(specs) and time.monotonic() < deadline:
            pump(0.2)
            check_workers()
            tick_line("connecting")
        if total("connected") < len(specs):
            say(f"only {total('connected')} of {len(specs)} devices connected in 120 s; running with them")
        t0 = shared_t0.value = time.time()
        go.set()
        if plan.commands_per_s > 0 and target.commands is not None:
            commands = CommandSender(target.commands, ids, plan.commands_per_s)
            commands.start()
        end = t0 + plan.duration_s
        while time.time() < end:
            pump(0.2)
            check_workers()
            if plan.kill_gateway and killed_at is None and time.time() - t0 >= plan.kill_gateway[1]:
                if target.kill is None:
                    raise ValueError(f"{target.name}: no gateway to kill")
                say(f"killing the gateway of {plan.kill_gateway[0]} (SIGKILL)")
                target.kill(plan.kill_gateway[0])
                killed_at = time.time() - t0
            tick_line("running")
        stop_publishing.set()
        if commands is not None:
            commands.stop.set()
            commands.join(30)
        say("draining: waiting for the last acknowledgements and commands")
        deadline = time.monotonic() + plan.drain_timeout_s
        while time.monotonic() < deadline:
            pump(0.2)
            if total("commands") >= (commands.total if commands else 0) and total("inflight") == 0:
                break
            tick_line("draining")
        time.sleep(plan.settle_s / 3)  # a duplicate command would arrive now
        finish.set()
        deadline = time.monotonic() + 60
        while len(done) + len(failed) < len(workers) and time.monotonic() < deadline:
            pump(0.5)
        # every acknowledged reading must be in Kafka: wait until the consumer has them all
        acked = {d: seqs for w in done.values() for d, seqs in w["acked"].items()}
        deadline = time.monotonic() + plan.drain_timeout_s
        while verifier.missing(acked) and time.monotonic() < deadline:
            tick_line("draining")
            time.sleep(0.5)
        time.sleep(plan.settle_s * 2 / 3)  # a duplicate would arrive now
    finally:
        go.set()
        stop_publishing.set()
        finish.set()
        if commands is not None:
            commands.stop.set()
        for p in workers:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)
        verifier.stop.set()
        verifier.join(10)
        if plan.kill_gateway and killed_at is not None and target.restart is not None:
            say(f"starting the gateway of {plan.kill_gateway[0]} again")
            target.restart(plan.kill_gateway[0])

    report = _report(plan, target.regions, done, failed, verifier, commands, ticks, killed_at, t0)
    report["target"] = target.name
    report["uplink"]["inflight_peak"] = peak_inflight[0]
    if not target.verify:
        report["uplink"].update(in_kafka=None, lost=None, duplicated=None)
    return report


def _p50_by_third(samples: list[tuple[float, float]], start_ms: float, end_ms: float) -> list[float | None]:
    """The median latency of each third of [start_ms, end_ms), by send time."""
    thirds: list[list[float]] = [[], [], []]
    span = max(end_ms - start_ms, 1e-3)
    for lat, sent in samples:
        if start_ms <= sent < end_ms:
            thirds[min(2, int(3 * (sent - start_ms) / span))].append(lat)
    return [percentile(t, 0.50) for t in thirds]


def _report(
    plan: ArmyPlan,
    regions: list[str],
    done: dict[int, dict[str, Any]],
    failed: dict[int, str],
    verifier: KafkaVerifier,
    commands: CommandSender | None,
    ticks: dict[int, dict[str, int]],
    killed_at: float | None,
    t0: float,
) -> dict[str, Any]:
    acked = {d: seqs for w in done.values() for d, seqs in w["acked"].items()}
    # (latency, send time) of the readings sent after the warm-up (plan.warmup_s)
    warm_from_ms = (t0 + plan.warmup_s) * 1000
    after_warmup = [
        (lat, sent)
        for lat, sent in zip(verifier.latency_ms, verifier.sent_ms, strict=True)
        if sent >= warm_from_ms
    ]
    lost = sum(len(set(seqs) - set(verifier.seen.get(d, []))) for d, seqs in acked.items())
    in_kafka = sum(len(v) for v in verifier.seen.values())
    distinct = sum(len(set(v)) for v in verifier.seen.values())
    received = {d: n for w in done.values() for d, n in w["commands"].items()}
    sent_cmds = commands.confirmed if commands else {}
    lost_cmds = sorted(x for d, ns in sent_cmds.items() for x in set(ns) - set(received.get(d, [])))
    cmd_lost = len(lost_cmds)
    cmd_received = sum(len(v) for v in received.values())
    cmd_distinct = sum(len(set(v)) for v in received.values())
    total_acked = sum(len(v) for v in acked.values())
    connect_all_s = max((w["connect_all_s"] for w in done.values()), default=0.0)

    def tick(name: str) -> int:
        return sum(t.get(name, 0) for t in ticks.values())

    return {
        "plan": {k: v for k, v in asdict(plan).items() if v is not None},
        "regions": regions,
        "workers_failed": failed,
        "uplink": {
            "sent": tick("sent"),
            "acked": total_acked,
            "unacked": sum(w["unacked"] for w in done.values()),
            "skipped_while_disconnected": tick("skipped"),
            "in_kafka": in_kafka,
            "lost": lost,
            "duplicated": in_kafka - distinct,
            "acked_per_s": round(total_acked / plan.duration_s, 1),
            # after the warm-up (plan.warmup_s), and over the whole run
            "latency_ms": percentiles([lat for lat, _ in after_warmup]),
            "latency_all_ms": percentiles(verifier.latency_ms),
            # the median of each third of the run after the warm-up, by send time: a latency
            # that grows from third to third is a queue building up, not a steady state
            "latency_p50_by_third_ms": _p50_by_third(
                after_warmup, warm_from_ms, (t0 + plan.duration_s) * 1000
            ),
            # the latency after the warm-up at 1%, 2%, ... 100%: the CDF
            "latency_cdf_ms": quantiles([lat for lat, _ in after_warmup]),
        },
        "downlink": {
            "sent": commands.total if commands else 0,
            "received": cmd_received,
            "lost": cmd_lost,
            "duplicated": cmd_received - cmd_distinct,
            # when the lost ones were sent, seconds into the run (the first 50)
            "lost_sent_at_s": [round(commands.sent_at[n] - t0, 2) for n in lost_cmds[:50]]
            if commands
            else [],
            "latency_ms": percentiles([x for w in done.values() for x in w["downlink_ms"]]),
        },
        "connections": {
            "devices": plan.devices,
            "connects": tick("connects"),
            # every device connected within this long (paced by plan.connect_rate; 0 means unpaced)
            "connect_all_s": round(connect_all_s, 2),
            "connect_per_s": round(plan.devices / connect_all_s, 1) if connect_all_s else None,
            "connect_ms": percentiles([x for w in done.values() for x in w["connect_ms"]]),
            "refused": tick("refused"),
            "connect_errors": tick("connect_errors"),
            "drops": tick("drops"),
            "reconnects": tick("reconnects"),
            "roamed": tick("roamed"),
            "storm_dropped": tick("storm_dropped"),
            "gateway_killed_at_s": killed_at,
        },
        "errors": [e for w in done.values() for e in w["errors"]][:20]
        + (commands.errors[:5] if commands else []),
    }


def to_text(r: dict[str, Any]) -> str:
    up, down, conn = r["uplink"], r["downlink"], r["connections"]
    lat, dl, cm = up["latency_ms"], down["latency_ms"], conn["connect_ms"]
    lines = [
        f"army: {conn['devices']} devices over {', '.join(r['regions'])}, "
        f"{r['plan']['rate']:g} readings/s offered for {r['plan']['duration_s']:g} s",
        f"  uplink    sent {up['sent']}, acked {up['acked']} ({up['acked_per_s']}/s), "
        f"in Kafka {up['in_kafka']}, "
        f"lost {up['lost']}, duplicated {up['duplicated']}, unacked {up['unacked']}; "
        f"device -> Kafka p50 {lat['p50']} p95 {lat['p95']} p99 {lat['p99']} max {lat['max']} ms",
        f"  downlink  sent {down['sent']}, received {down['received']}, lost {down['lost']}, "
        f"duplicated {down['duplicated']}; backend -> device p50 {dl['p50']} p99 {dl['p99']} ms",
        f"  connect   {conn['connects']} connects ({conn['connect_per_s']}/s while connecting; "
        f"p50 {cm['p50']} p99 {cm['p99']} ms), refused {conn['refused']}, errors {conn['connect_errors']}, "
        f"drops {conn['drops']}, reconnects {conn['reconnects']}, roamed {conn['roamed']}",
    ]
    if r["workers_failed"]:
        lines.append(f"  workers failed: {r['workers_failed']}")
    for e in r["errors"][:5]:
        lines.append(f"  error: {e}")
    return "\n".join(lines)


def ok(r: dict[str, Any]) -> bool:
    """Nothing promised was lost, and every worker finished."""
    return not r["workers_failed"] and r["uplink"]["lost"] == 0 and r["downlink"]["lost"] == 0
