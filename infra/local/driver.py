"""The local driver: the local way of stamping out a federation on one machine.

``up`` starts epmd, the backend node, one gateway node per region and a Kafka
broker, waits for each to be ready, applies the federation wiring (the same
definitions a cloud region gets) and waits for the federation links.  ``down``
stops them all and checks that no process is left.  ``status`` reports on
every node.

``LocalFederation`` is the façade: it boots and stops the federation and
holds the parts, each in a module of its own job:

    layout.py    node names, roles and ports; the state folder's records
    nodes.py     a node's process (services.py: Kafka, routers, Spark)
    configs.py   what router.toml and spark.toml hold
    wiring.py    definitions applied to the RabbitMQ nodes; federation links
    regions.py   adding and removing a region while the federation runs
    devices.py   device users on the running gateways
    status.py    status rows and the endpoints clients use
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backend.polling import wait_until
from backend.rabbitmq_admin import AdminError
from backend.wiring import AmqpEndpoint
from infra.device_registry import DeviceRegistry
from infra.local import configs, devices, processes, status, wiring
from infra.local.dns_node import DnsNode
from infra.local.layout import (
    BACKEND_NODE,
    KAFKA_NODE,
    ROLE_BACKEND,
    ROLE_DNS,
    ROLE_EPMD,
    ROLE_GATEWAY,
    ROLE_KAFKA,
    ROLE_PROMETHEUS,
    ROLE_ROUTER,
    ROLE_SPARK,
    SPARK_NODE,
    FederationError,
    NodeSpec,
    StateFiles,
    gateway_node_name,
    port_layout,
)
from infra.local.nodes import Node, NodeError, RabbitNode, start_and_wait, stop_started
from infra.local.regions import RegionChanges
from infra.local.services import NODE_CLASSES, KafkaNode, RouterNode, SparkNode
from infra.local.settings import LocalSettings
from infra.local.status import ClusterStatus, NodeStatus

# Imported from here by the CLI, the tests and the benchmarks.
__all__ = ["FederationError", "LocalFederation", "NodeStatus", "gateway_node_name", "port_layout"]

Progress = Callable[[str], None]


class LocalFederation:
    def __init__(self, settings: LocalSettings, progress: Progress | None = None):
        #: replaced (not mutated) when a region is added or removed
        self.settings = settings
        self.state_dir = settings.state_dir
        self.progress: Progress = progress or (lambda msg: None)
        self.files = StateFiles(self.state_dir)
        self.region_changes = RegionChanges(self)

    # --- files -------------------------------------------------------------------

    @property
    def record_file(self) -> Path:
        return self.files.record_file

    @property
    def secrets_file(self) -> Path:
        return self.files.secrets_file

    @property
    def warehouse(self) -> Path:
        """Where the Spark job keeps the analysts' tables (and its checkpoints)."""
        return self.files.warehouse

    @property
    def tls_dir(self) -> Path:
        return self.files.tls_dir

    def recorded(self) -> dict[str, NodeSpec]:
        return self.files.recorded()

    def specs(self) -> list[NodeSpec]:
        """The nodes of this federation: as recorded while it exists, else as configured."""
        recorded = self.recorded()
        if recorded:
            return list(recorded.values())
        return port_layout(self.settings)

    def secrets(self) -> dict[str, Any]:
        """Generated credentials, created once per state dir."""
        return self.files.secrets(self.settings.regions)

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

    def up(self, spark_job: bool = True) -> list[NodeStatus]:
        """Start whatever is not running, wire the federation, wait until it carries traffic.

        Idempotent: with everything running it only re-checks the wiring. On
        any failure every node this call started is stopped again and
        FederationError names the node and its log.  `spark_job=False` renders the
        Spark job's config but leaves it stopped, for `start_node` to start when
        its tables are wanted (the job reads Kafka from where it left off).
        """
        t0 = time.monotonic()
        specs = port_layout(self.settings, self.recorded())
        sec = self.secrets()
        self.files.prepare_home(sec["erlang_cookie"])
        nodes = self.nodes(specs)
        to_start = [n for n in nodes if not n.is_running()]
        held = [] if spark_job else [n for n in to_start if isinstance(n, SparkNode)]
        to_start = [n for n in to_start if n not in held]
        if not to_start:
            self.progress("federation already up")
            return self.status()

        for n in to_start:
            try:
                n.preflight()
            except NodeError as e:
                raise FederationError(str(e)) from e
        self.files.write_record(specs, self.settings.host)

        started: list[Node] = []
        try:
            # epmd first: the Erlang nodes register with it as they boot.
            for n in to_start:
                if n.spec.role == ROLE_EPMD:
                    self._start_and_wait([n], started)
            brokers = [n for n in to_start if n.spec.role not in (ROLE_EPMD, ROLE_ROUTER, ROLE_SPARK)]
            # The brokers boot in parallel; a gateway's first boot takes ~11 s.
            self._start_and_wait(brokers, started)
            self.wire(nodes)
            # a DNS server or a gateway (re)started: wait until the server's checks have seen every
            # gateway, so that a device asking now is answered its own region
            if any(n.spec.role in (ROLE_DNS, ROLE_GATEWAY) for n in to_start):
                for dns in (n for n in nodes if isinstance(n, DnsNode)):
                    if not dns.settle():
                        self.progress(
                            f"{dns.name}: not every region's network is answered its own gateways yet"
                        )
            # The router last: it needs the wired backend, the gateways and Kafka.
            routers = [n for n in to_start if n.spec.role == ROLE_ROUTER]
            for r in routers:
                assert isinstance(r, RouterNode)
                r.config = self.router_config(nodes, r)
            self._start_and_wait(routers, started)
            # The Spark job reads what the routers write (it picks up topics as they appear).
            jobs: list[Node] = [n for n in to_start if isinstance(n, SparkNode)]
            for j in [*jobs, *held]:
                assert isinstance(j, SparkNode)
                j.config = self.spark_config(nodes, j)
            for j in held:
                j.dir.mkdir(parents=True, exist_ok=True)
                j.prepare()
            self._start_and_wait(jobs, started)
        except (NodeError, AdminError, TimeoutError) as e:
            self.progress(f"error: {e}; stopping what this run started")
            stop_started(started)
            raise FederationError(str(e)) from e
        except BaseException:
            # Ctrl-C or SIGTERM while booting: leave nothing half-running.
            self.progress("interrupted; stopping what this run started")
            stop_started(started)
            raise
        self.progress(f"federation up in {time.monotonic() - t0:.1f}s")
        return self.status()

    def _start_and_wait(self, nodes: list[Node], started: list[Node]) -> None:
        start_and_wait(nodes, started, boot_timeout=self.settings.boot_timeout, progress=self.progress)

    # --- down ----------------------------------------------------------------------

    def down(self, purge: bool = False) -> list[int]:
        """Stop every node (Kafka and gateways first, epmd last); no process is left.

        Returns pids that had to be SIGKILLed (empty on a clean stop).
        """
        nodes = self.nodes() if self.record_file.exists() else []
        running = [n for n in nodes if n.is_running()]
        # the router first: it drains its in-flight messages into Kafka and acks them
        # the Spark job first: it finishes or abandons its micro-batch (replayed at the next start)
        order = {
            ROLE_DNS: 0,
            ROLE_PROMETHEUS: 0,
            ROLE_SPARK: 0,
            ROLE_ROUTER: 1,
            ROLE_KAFKA: 2,
            ROLE_GATEWAY: 3,
            ROLE_BACKEND: 4,
            ROLE_EPMD: 5,
        }
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

    # --- wiring (wiring.py) -------------------------------------------------------------

    def wire(self, nodes: list[Node]) -> None:
        """Apply the federation definitions to every RabbitMQ node and wait for the links."""
        wiring.wire(
            nodes,
            settings=self.settings,
            secrets=self.secrets(),
            registry=self.device_registry,
            tls_dir=self.tls_dir,
            progress=self.progress,
        )

    def link_endpoint(self, node: Node) -> AmqpEndpoint:
        """Where a federation link reaches `node`: AMQPS checked against the local CA (TLS on)."""
        return wiring.link_endpoint(self.settings, self.tls_dir, node)

    def link_states(self) -> dict[str, list[tuple[str, str]]]:
        """Federation links per RabbitMQ cluster, keyed by its first node: (link, status)."""
        return wiring.link_states(self.nodes())

    def wait_for_links(self, timeout: float = 60) -> None:
        """Block until every federation link is running: 2 per gateway on the backend, 1 on each gateway."""
        wiring.wait_for_links(self.nodes(), timeout)

    # --- the services' settings files (configs.py) ----------------------------------------

    def spark_settings(self) -> Any:
        """Settings for a Spark session next to the job (configs.spark_settings)."""
        return configs.spark_settings(self.files)

    def count_aggregates_now(self, timeout: float = 120.0) -> int | None:
        """Ask the Spark job to count the batches landed so far in the aggregates now
        (SIGUSR1), not at its next aggregate_interval_s; wait for its answer.  The last batch
        the aggregates count, or None without an answer in `timeout`; NodeError if the job
        does not run."""
        job = self.node(SPARK_NODE)
        pid = job.pid()
        if pid is None or not job.is_running():
            raise NodeError(f"{job.name}: not running; `fedgate up` starts it")
        assert isinstance(job, SparkNode)
        asked_ms = int(time.time() * 1000)
        os.kill(pid, signal.SIGUSR1)

        def answer() -> dict[str, Any] | None:
            a = job.progress().get("count_request") or {}
            return a if a.get("answered_ms", 0) >= asked_ms else None

        got = wait_until(answer, timeout, 0.2)
        return None if got is None else int(got["through_batch"])

    def spark_config(self, nodes: list[Node], job: Node) -> dict[str, Any]:
        """What spark.toml holds (configs.spark_config)."""
        return configs.spark_config(self.settings, self.warehouse, nodes, job)

    def router_config(self, nodes: list[Node], router: Node) -> dict[str, Any]:
        """What router.toml holds (configs.router_config)."""
        return configs.router_config(self.settings, self.secrets(), nodes, router)

    # --- regions at run time (regions.py) -------------------------------------------------

    def add_region(self, region: str) -> list[NodeStatus]:
        """Start a gateway for `region` and join it to the running federation.

        Nothing else restarts: the backend gets the region's upstream and
        downlink exchange and registers it; the routers read it from there.
        """
        return self.region_changes.add(region)

    def remove_region(self, region: str) -> None:
        """Stop a region's gateway and remove every trace of it from the federation."""
        self.region_changes.remove(region)

    # --- devices (devices.py) ---------------------------------------------------------------

    @property
    def device_registry(self) -> DeviceRegistry:
        return DeviceRegistry(self.settings.device_registry_file)

    def add_devices(self, ids: Iterable[str], *, rotate: bool = False) -> dict[str, str]:
        """Register devices and make them users of every running gateway; returns their secrets.

        A gateway started later gets them when it is wired.
        """
        return devices.add_devices(self.device_registry, self.gateways, ids, rotate=rotate)

    def revoke_devices(self, ids: Iterable[str]) -> dict[str, int]:
        """Forget devices, delete their users on every running gateway and close their
        connections; returns the connections closed per device."""
        return devices.revoke_devices(self.device_registry, self.gateways, ids)

    def sync_devices(self) -> dict[str, list[str]]:
        """Make every running gateway's device users exactly the registry's; returns the
        device users removed per region (revoked while that gateway was down)."""
        return devices.sync_devices(self.device_registry, self.gateways)

    # --- status and endpoints (status.py) ---------------------------------------------------

    def status(self) -> list[NodeStatus]:
        return status.status_rows(self.nodes())

    def clusters(self, rows: list[NodeStatus] | None = None) -> list[ClusterStatus]:
        """Each cluster (backend, each region's gateways, Kafka): members, running, under-replicated."""
        return status.cluster_rows(self.nodes(), rows if rows is not None else self.status())

    def endpoints(self) -> dict[str, Any]:
        """Connection details for clients (demo, tests, benchmarks)."""
        sec = self.secrets()
        # read federation.json once, not once per role
        return status.endpoints(self.settings, sec, self.nodes(), self.tls_dir)
