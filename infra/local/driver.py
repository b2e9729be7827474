"""The local driver: the local way of stamping out a federation on one machine.

``up`` starts epmd, the backend node, one gateway node per region and a Kafka
broker, waits for each to be ready, applies the federation wiring (the same
definitions a cloud region gets) and waits for the federation links.  ``down``
stops them all and checks that no process is left.  ``status`` reports on
every node.

Everything lives under the state dir::

    state/
      federation.json   the nodes, their roles, regions and ports (status --json reads it)
      secrets.json      generated passwords (mode 600)
      home/             HOME of the Erlang nodes (.erlang.cookie)
      nodes/<node>/     config, data, logs and pid of each node
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend import contract as c
from backend.devices import device_users
from backend.rabbitmq_admin import AdminError
from backend.wiring import AmqpEndpoint, GatewayLink, backend_definitions
from gateways.wiring import gateway_definitions
from infra.device_registry import DeviceRegistry, apply_to_gateway, sync_gateway
from infra.local import configs, processes
from infra.local.layout import (
    BACKEND_NODE,
    KAFKA_NODE,
    ROLE_BACKEND,
    ROLE_EPMD,
    ROLE_GATEWAY,
    ROLE_KAFKA,
    ROLE_ROUTER,
    ROLE_SPARK,
    ROUTER_NODE,
    FederationError,
    NodeSpec,
    gateway_node_name,
    port_layout,
)
from infra.local.nodes import Node, NodeError, RabbitNode
from infra.local.services import NODE_CLASSES, KafkaNode, RouterNode, SparkNode
from infra.local.settings import LocalSettings
from infra.local.tls import LocalCA, tls_server_name
from infra.secrets_file import SecretsFile

Progress = Callable[[str], None]


@dataclass
class NodeStatus:
    name: str
    role: str
    region: str | None
    ports: dict[str, int]
    state: str  # running | stopped | unhealthy
    pid: int | None
    connections: int | None
    messages: int | None
    #: resident memory of the node's processes (the VM and its helpers), MB
    rss_mb: int | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class LocalFederation:
    def __init__(self, settings: LocalSettings, progress: Progress | None = None):
        self.settings = settings
        self.state_dir = settings.state_dir
        self.progress: Progress = progress or (lambda msg: None)

    # --- files -------------------------------------------------------------------

    @property
    def record_file(self) -> Path:
        return self.state_dir / "federation.json"

    @property
    def secrets_file(self) -> Path:
        return self.state_dir / "secrets.json"

    def recorded(self) -> dict[str, NodeSpec]:
        try:
            data = json.loads(self.record_file.read_text())
        except FileNotFoundError:
            return {}
        return {n["name"]: NodeSpec.from_json(n) for n in data["nodes"]}

    def specs(self) -> list[NodeSpec]:
        """The nodes of this federation: as recorded while it exists, else as configured."""
        recorded = self.recorded()
        if recorded:
            return list(recorded.values())
        return port_layout(self.settings)

    def secrets(self) -> dict[str, Any]:
        """Generated credentials, created once per state dir."""
        return SecretsFile(self.secrets_file).ensure(
            ("admin", "backend_link", "router", "erlang_cookie"),
            {"gateways": self.settings.regions},
        )

    def _write_record(self, specs: list[NodeSpec]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "state_dir": str(self.state_dir),
            "host": self.settings.host,
            "secrets_file": str(self.secrets_file),
            "nodes": [s.to_json() for s in specs],
        }
        tmp = self.record_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.record_file)

    def _prepare_home(self, cookie: str) -> None:
        home = self.state_dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        path = home / ".erlang.cookie"
        if not path.exists():
            path.write_text(cookie)
            path.chmod(0o400)

    # --- nodes -------------------------------------------------------------------

    def nodes(self, specs: list[NodeSpec] | None = None) -> list[Node]:
        specs = specs or self.specs()
        sec = self.secrets()
        epmd_port = next(s.ports["epmd"] for s in specs if s.role == ROLE_EPMD)
        return [NODE_CLASSES[s.role](s, self.settings, sec, epmd_port) for s in specs]

    def node(self, name: str) -> Node:
        for n in self.nodes():
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in this federation")

    def gateways(self) -> list[RabbitNode]:
        return [n for n in self.nodes() if isinstance(n, RabbitNode) and n.spec.role == ROLE_GATEWAY]

    def backend(self) -> RabbitNode:
        node = self.node(BACKEND_NODE)
        assert isinstance(node, RabbitNode)
        return node

    def kafka(self) -> KafkaNode:
        node = self.node(KAFKA_NODE)
        assert isinstance(node, KafkaNode)
        return node

    # --- up ------------------------------------------------------------------------

    def up(self) -> list[NodeStatus]:
        """Start whatever is not running, wire the federation, wait until it carries traffic.

        Idempotent: with everything running it only re-checks the wiring. On
        any failure every node this call started is stopped again and
        FederationError names the node and its log.
        """
        t0 = time.monotonic()
        specs = port_layout(self.settings, self.recorded())
        sec = self.secrets()
        self._prepare_home(sec["erlang_cookie"])
        nodes = self.nodes(specs)
        to_start = [n for n in nodes if not n.is_running()]
        if not to_start:
            self.progress("federation already up")
            return self.status()

        for n in to_start:
            try:
                n.preflight()
            except NodeError as e:
                raise FederationError(str(e)) from e
        self._write_record(specs)

        started: list[Node] = []
        try:
            # epmd first: the Erlang nodes register with it as they boot.
            for n in to_start:
                if n.spec.role == ROLE_EPMD:
                    self._start_and_wait([n], started)
            brokers = [n for n in to_start if n.spec.role not in (ROLE_EPMD, ROLE_ROUTER, ROLE_SPARK)]
            # The brokers boot in parallel; a gateway's first boot takes ~11 s.
            self._start_and_wait(brokers, started)
            self._wire(nodes)
            # The router last: it needs the wired backend, the gateways and Kafka.
            routers = [n for n in to_start if n.spec.role == ROLE_ROUTER]
            for r in routers:
                assert isinstance(r, RouterNode)
                r.config = self.router_config(nodes, r)
            self._start_and_wait(routers, started)
            # The Spark job reads what the routers write (it picks up topics as they appear).
            jobs: list[Node] = [n for n in to_start if isinstance(n, SparkNode)]
            for j in jobs:
                assert isinstance(j, SparkNode)
                j.config = self.spark_config(nodes, j)
            self._start_and_wait(jobs, started)
        except (NodeError, AdminError, TimeoutError) as e:
            self.progress(f"error: {e}; stopping what this run started")
            self._undo(started)
            raise FederationError(str(e)) from e
        except BaseException:
            # Ctrl-C or SIGTERM while booting: leave nothing half-running.
            self.progress("interrupted; stopping what this run started")
            self._undo(started)
            raise
        self.progress(f"federation up in {time.monotonic() - t0:.1f}s")
        return self.status()

    @staticmethod
    def _undo(started: list[Node]) -> None:
        for n in reversed(started):
            n.stop(grace=15)

    def _start_and_wait(self, nodes: list[Node], started: list[Node]) -> None:
        t0 = time.monotonic()
        for n in nodes:
            self.progress(f"starting {n.name} ({self._ports_text(n.spec)})")
            n.start()
            started.append(n)
        waiting = list(nodes)
        deadline = t0 + self.settings.boot_timeout
        last_note = t0
        while waiting:
            for n in list(waiting):
                code = n.exited()
                if code is not None:
                    raise NodeError(f"{n.name} failed to boot (exit code {code}); see {n.logs_to_read()}")
                if n.ready():
                    waiting.remove(n)
                    self.progress(f"{n.name} ready in {time.monotonic() - t0:.1f}s")
            if not waiting:
                break
            now = time.monotonic()
            if now > deadline:
                n = waiting[0]
                raise NodeError(
                    f"{n.name} not ready after {self.settings.boot_timeout:.0f}s; see {n.logs_to_read()}"
                )
            if now - last_note > 10:
                self.progress(f"waiting for {', '.join(n.name for n in waiting)} ...")
                last_note = now
            time.sleep(0.25)

    def _wire(self, nodes: list[Node]) -> None:
        """Apply the federation definitions to every RabbitMQ node and wait for the links."""
        sec = self.secrets()
        backend = next(n for n in nodes if n.spec.role == ROLE_BACKEND)
        gateways = [n for n in nodes if n.spec.role == ROLE_GATEWAY]
        assert isinstance(backend, RabbitNode)
        backend_ep = self.link_endpoint(backend)
        for gw in gateways:
            assert isinstance(gw, RabbitNode) and gw.spec.region
            gw.admin().apply(
                gateway_definitions(
                    gw.spec.region,
                    backend_ep,
                    admin_password=sec["admin"],
                    backend_link_password=sec["backend_link"],
                    gateway_password=sec["gateways"][gw.spec.region],
                )
            )
            fleet = self.device_registry.hashes()
            if fleet:
                gw.admin().import_users(device_users(fleet))
        links = [
            GatewayLink(
                gw.spec.region or "",
                self.link_endpoint(gw),
                sec["gateways"][gw.spec.region],
            )
            for gw in gateways
        ]
        backend.admin().apply(
            backend_definitions(
                links,
                admin_password=sec["admin"],
                backend_link_password=sec["backend_link"],
                router_password=sec["router"],
                uplink_shards=self.settings.uplink_shards,
            )
        )
        self.progress("federation wired; waiting for links")
        self.wait_for_links(timeout=60)

    @property
    def warehouse(self) -> Path:
        """Where the Spark job keeps the analysts' tables (and its checkpoints)."""
        return self.state_dir / "warehouse"

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    def link_endpoint(self, node: Node) -> AmqpEndpoint:
        """Where a federation link reaches `node`: AMQPS checked against the local CA (TLS on)."""
        host = self.settings.host
        if not self.settings.tls:
            return AmqpEndpoint(host, node.spec.ports["amqp"])
        return AmqpEndpoint(
            host,
            node.spec.ports["amqps"],
            tls=True,
            ca_file=str(LocalCA(self.tls_dir).ensure_ca()),
            server_name=tls_server_name(host),
        )

    def spark_settings(self) -> Any:
        """Settings for a Spark session next to the job (configs.spark_settings)."""
        return configs.spark_settings(self.state_dir, self.warehouse)

    def spark_config(self, nodes: list[Node], job: Node) -> dict[str, Any]:
        """What spark.toml holds (configs.spark_config)."""
        return configs.spark_config(self.settings, self.warehouse, nodes, job)

    def router_config(self, nodes: list[Node], router: Node) -> dict[str, Any]:
        """What router.toml holds (configs.router_config)."""
        return configs.router_config(self.settings, self.secrets(), nodes, router)

    def link_states(self) -> dict[str, list[tuple[str, str]]]:
        """Federation links per RabbitMQ node: (upstream/exchange, status)."""
        out: dict[str, list[tuple[str, str]]] = {}
        for n in self.nodes():
            if isinstance(n, RabbitNode):
                try:
                    links = n.admin(timeout=3).federation_links()
                except AdminError:
                    links = []
                out[n.name] = [
                    (
                        f"{lk.get('upstream')}:{lk.get('upstream_exchange') or lk.get('exchange')}",
                        lk.get("status", "?"),
                    )
                    for lk in links
                ]
        return out

    def wait_for_links(self, timeout: float = 60) -> None:
        """Block until every federation link is running: 2 per gateway on the backend, 1 on each gateway."""
        gateways = [n.name for n in self.gateways()]
        want = {BACKEND_NODE: 2 * len(gateways), **dict.fromkeys(gateways, 1)}
        deadline = time.monotonic() + timeout
        while True:
            states = self.link_states()
            missing = {
                node: f"{sum(1 for _, s in states.get(node, []) if s == 'running')}/{n} running"
                for node, n in want.items()
                if sum(1 for _, s in states.get(node, []) if s == "running") < n
            }
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"federation links not running after {timeout:.0f}s: {missing}")
            time.sleep(0.25)

    # --- devices ----------------------------------------------------------------------

    @property
    def device_registry(self) -> DeviceRegistry:
        return DeviceRegistry(self.settings.device_registry_file)

    def add_devices(self, ids: Iterable[str], *, rotate: bool = False) -> dict[str, str]:
        """Register devices and make them users of every running gateway; returns their secrets.

        A gateway started later gets them when it is wired.
        """
        issued = self.device_registry.add(ids, rotate=rotate)
        hashes = self.device_registry.hashes()
        fleet = device_users({d: hashes[d] for d in issued})
        for gw in self.gateways():
            if gw.is_running():
                apply_to_gateway(gw.admin(), fleet, [])
        return issued

    def revoke_devices(self, ids: Iterable[str]) -> dict[str, int]:
        """Forget devices, delete their users on every running gateway and close their
        connections; returns the connections closed per device."""
        gone = self.device_registry.revoke(list(ids))
        closed = dict.fromkeys(gone, 0)
        for gw in self.gateways():
            if gw.is_running():
                for d, n in apply_to_gateway(gw.admin(), None, gone).items():
                    closed[d] += n
        return closed

    def sync_devices(self) -> dict[str, list[str]]:
        """Make every running gateway's device users exactly the registry's; returns the
        device users removed per region (revoked while that gateway was down)."""
        hashes = self.device_registry.hashes()
        return {
            gw.spec.region or gw.name: sync_gateway(gw.admin(), hashes)
            for gw in self.gateways()
            if gw.is_running()
        }

    # --- single nodes (chaos, tests) -------------------------------------------------

    def stop_node(self, name: str) -> list[int]:
        """Stop one node; returns the pids that did not stop on SIGTERM in time and were killed."""
        self.progress(f"stopping {name}")
        return self.node(name).stop()

    def start_node(self, name: str) -> None:
        """Start one stopped node again and wait until it is ready (wiring persists in its data)."""
        node = self.node(name)
        if node.is_running():
            return
        node.preflight()
        self._start_and_wait([node], [])

    # --- regions at run time ---------------------------------------------------------

    def add_region(self, region: str) -> list[NodeStatus]:
        """Start a gateway for `region` and join it to the running federation.

        Nothing else restarts: the backend gets the region's upstream and
        downlink exchange, the routers re-read their config (SIGHUP).
        """
        c.validate_region(region)
        recorded = self.recorded()
        name = gateway_node_name(region)
        if not recorded or not self.backend().is_running():
            raise FederationError("the local federation is not running; start it with `fedgate up`")
        if name in recorded and self.node(name).is_running():
            self.progress(f"region {region} is already part of the federation")
            return self.status()
        if region not in self.settings.regions:
            self.settings = dataclasses.replace(self.settings, regions=(*self.settings.regions, region))
        specs = port_layout(self.settings, recorded)
        nodes = self.nodes(specs)
        gateway = next(n for n in nodes if n.name == name)
        try:
            gateway.preflight()
        except NodeError as e:
            raise FederationError(str(e)) from e
        self._write_record(specs)
        t0 = time.monotonic()
        started: list[Node] = []
        try:
            self._start_and_wait([gateway], started)
            self._wire(nodes)
            self.reload_routers(nodes)
        except (NodeError, AdminError, TimeoutError) as e:
            self.progress(f"error: {e}; removing {region} again")
            self._undo(started)
            self._forget_region(region)
            raise FederationError(str(e)) from e
        self.progress(
            f"region {region} joined in {time.monotonic() - t0:.1f}s "
            f"(MQTT on {self.settings.host}:{gateway.spec.ports['mqtt']})"
        )
        return self.status()

    def remove_region(self, region: str) -> None:
        """Stop a region's gateway and remove every trace of it from the federation."""
        name = gateway_node_name(region)
        if name not in self.recorded():
            self.progress(f"region {region} is not part of the federation")
            return
        gateways = [g for g in self.gateways() if g.name != name]
        if not gateways:
            raise FederationError(f"{region} is the last region; a federation needs one gateway")
        node = self.node(name)
        self.progress(f"stopping {name}")
        node.stop()
        self._forget_region(region)
        shutil.rmtree(node.dir, ignore_errors=True)
        backend = self.backend()
        if backend.is_running():
            # The reverse of joining: the upstream sets drop the region first (RabbitMQ
            # stops its links), the routers stop sending there, and only then do its
            # upstream and exchange go.  Deleting the upstream while a set still named
            # it made RabbitMQ 3.10 fail the next set update (HTTP 500, link not_found).
            self._wire(self.nodes())
            self.reload_routers(self.nodes())
            backend.admin().remove_gateway(region, c.gateway_upstream_name(region))
        self.progress(f"region {region} removed")

    def _forget_region(self, region: str) -> None:
        name = gateway_node_name(region)
        specs = [s for s in self.recorded().values() if s.name != name]
        self._write_record(specs)
        self.settings = dataclasses.replace(
            self.settings, regions=tuple(r for r in self.settings.regions if r != region)
        )
        SecretsFile(self.secrets_file).forget(region, ("gateways",))

    def reload_routers(self, nodes: list[Node]) -> None:
        """Re-render every running router's config and make it re-read it (SIGHUP)."""
        for r in nodes:
            if isinstance(r, RouterNode) and r.is_running():
                r.config = self.router_config(nodes, r)
                r.prepare()
                pid = r.pid()
                if pid is not None:
                    os.kill(pid, signal.SIGHUP)
                    self.progress(f"{r.name} reloads its gateways")

    # --- down ----------------------------------------------------------------------

    def down(self, purge: bool = False) -> list[int]:
        """Stop every node (Kafka and gateways first, epmd last); no process is left.

        Returns pids that had to be SIGKILLed (empty on a clean stop).
        """
        nodes = self.nodes() if self.record_file.exists() else []
        running = [n for n in nodes if n.is_running()]
        # the router first: it drains its in-flight messages into Kafka and acks them
        # the Spark job first: it finishes or abandons its micro-batch (replayed at the next start)
        order = {ROLE_SPARK: 0, ROLE_ROUTER: 1, ROLE_KAFKA: 2, ROLE_GATEWAY: 3, ROLE_BACKEND: 4, ROLE_EPMD: 5}
        killed: list[int] = []
        if not running and not self.leftover_pids():
            self.progress("federation already down")
        else:
            t0 = time.monotonic()
            for role in sorted(order, key=order.__getitem__):
                group = [n for n in running if n.spec.role == role]
                for n in group:
                    self.progress(f"stopping {n.name}")
                # nodes of one role stop in parallel: each takes seconds
                with ThreadPoolExecutor(max_workers=max(1, len(group))) as pool:
                    killed += [pid for pids in pool.map(lambda n: n.stop(), group) for pid in pids]
            # anything else carrying this state dir's marker (a crashed node's children)
            leftovers = self.leftover_pids()
            if leftovers:
                killed += processes.stop_marked(self._marker_prefix(), grace=10)
            self.progress(f"federation down in {time.monotonic() - t0:.1f}s")
        if purge and self.state_dir.exists():
            shutil.rmtree(self.state_dir)
            self.progress(f"removed {self.state_dir}")
        return killed

    def _marker_prefix(self) -> str:
        return processes.marker(self.state_dir, "")

    def leftover_pids(self) -> list[int]:
        """Processes of this federation still alive (empty after a clean down)."""
        return processes.marked_pids(self._marker_prefix())

    # --- status ---------------------------------------------------------------------

    def status(self) -> list[NodeStatus]:
        out = []
        for n in self.nodes():
            pid = n.pid() if n.is_running() else None
            st = NodeStatus(
                n.name,
                n.spec.role,
                n.spec.region,
                n.spec.ports,
                "running" if pid else "stopped",
                pid,
                None,
                None,
            )
            if pid:
                st.rss_mb = processes.rss_bytes(processes.marked_pids(n.marker)) // (1024 * 1024)
            if pid and isinstance(n, RabbitNode):
                try:
                    ov = n.admin(timeout=3).overview()
                    st.connections = ov.get("object_totals", {}).get("connections")
                    st.messages = ov.get("queue_totals", {}).get("messages")
                except AdminError as e:
                    st.state, st.detail = "unhealthy", str(e)
            elif pid and isinstance(n, KafkaNode):
                st.state = "running" if n.ready() else "unhealthy"
            elif pid and isinstance(n, SparkNode):
                # for the job: records in its last raw micro-batch
                p = n.progress()
                st.messages = (p.get("queries", {}).get("raw") or {}).get("input_rows")
                if not n.ready():
                    st.state = "starting" if not p else "unhealthy"
                    st.detail = p.get("state", "no progress report yet")
            elif pid and isinstance(n, RouterNode):
                # for a router: devices it sees connected, and messages on their way to Kafka
                try:
                    m = n.metrics()
                    st.connections = int(m.get("fedgate_router_presence_devices", 0))
                    st.messages = int(m.get("fedgate_router_inflight", 0))
                except OSError as e:
                    st.state, st.detail = "unhealthy", str(e)
            out.append(st)
        return out

    @staticmethod
    def _ports_text(spec: NodeSpec) -> str:
        return ", ".join(f"{k} {v}" for k, v in spec.ports.items())

    # --- what clients need -------------------------------------------------------------

    def endpoints(self) -> dict[str, Any]:
        """Connection details for clients (demo, tests, later the router)."""
        sec = self.secrets()
        host = self.settings.host
        nodes = self.nodes()  # read federation.json once, not once per role
        b = next(n for n in nodes if n.spec.role == ROLE_BACKEND).spec.ports
        kafka = next(n for n in nodes if isinstance(n, KafkaNode))
        router = next((n for n in nodes if isinstance(n, RouterNode) and n.name == ROUTER_NODE), None)
        return {
            "host": host,
            "backend": {
                "amqp": b["amqp"],
                "management": b["management"],
                "url": f"amqp://{c.ADMIN_USER}:{sec['admin']}@{host}:{b['amqp']}/%2F",
            },
            "gateways": {
                g.spec.region: {
                    "mqtt": g.spec.ports["mqtt"],
                    "amqp": g.spec.ports["amqp"],
                    "management": g.spec.ports["management"],
                    **({"mqtts": g.spec.ports["mqtts"]} if self.settings.tls else {}),
                }
                for g in nodes
                if g.spec.role == ROLE_GATEWAY
            },
            "kafka": {"bootstrap": kafka.bootstrap},
            "router": {"metrics": router.metrics_url if router else None},
            "admin": {"user": c.ADMIN_USER, "password": sec["admin"]},
            # devices check the gateways' certificates against this CA (MQTT over TLS)
            "tls": {"ca": str(LocalCA(self.tls_dir).ca_cert), "server_name": tls_server_name(host)}
            if self.settings.tls
            else None,
        }
