"""The processes of a local federation: what every node shares, and the RabbitMQ nodes.

A node knows how to render its config, start its process, tell whether it is ready and where its
log is.  The driver (driver.py) decides which nodes to start and in what order.  What a gateway's or
the backend's rabbitmq.conf holds and what "ready" means for them lives in their homes
(gateways/node.py, backend/node.py); this file only runs them.  Kafka, routers, Spark: services.py.

Node kinds:
  epmd     Erlang's port mapper, one per state dir on a fedgate port: two federations
           (the demo and the tests) never share one, `down` leaves no daemon behind
  backend  the backend RabbitMQ node (a cluster of 3 in the ha profile)
  gateway  a region's RabbitMQ node (3 in the ha profile), with the MQTT listener
  kafka    a Kafka broker in KRaft mode (3 in the ha profile; Apache Kafka's jars)
  router   the router service (python -m router)
  spark    the streaming job that keeps the analysts' tables (python -m spark.job)
  dns      PowerDNS answering devices' mqtt.<domain> (dns_node.py)
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from backend.contract import ADMIN_USER
from backend.errors import FedgateError
from backend.node import BackendNodeConfig
from backend.polling import wait_until
from backend.rabbitmq_admin import RabbitAdmin
from gateways.node import GatewayNodeConfig, listener_open
from infra.local import processes
from infra.local.broker import BrokerRuntime, BrokerRuntimeError, broker_runtime
from infra.local.layout import (  # noqa: F401  (re-exported: the roles and NodeSpec were defined here)
    ROLE_BACKEND,
    ROLE_EPMD,
    ROLE_GATEWAY,
    ROLE_KAFKA,
    ROLE_ROUTER,
    ROLE_SPARK,
    NodeSpec,
    StateFiles,
    ports_text,
    region_nodes,
)
from infra.local.settings import LocalSettings
from infra.local.tls import LocalCA, tls_listeners_conf

#: Erlang VM flags for several nodes sharing two cores: no busy-waiting schedulers (a core each).
ERL_SHARED_HOST_ARGS = "+sbwt none +sbwtdcpu none +sbwtdio none"


class NodeError(FedgateError):
    """A node cannot start or is not ready; the message names the node and its log."""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As the servers themselves do: connections of a stopped node lingering
        # in TIME_WAIT must not count as "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


#: Whether something accepts connections on a port (one definition, the gateway's readiness uses it).
port_open = listener_open


def render(template: Path, dest: Path, **values: Any) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(Template(template.read_text()).substitute(**values))


@dataclass
class Node:
    spec: NodeSpec
    settings: LocalSettings
    secrets: dict[str, Any]
    epmd_port: int

    # --- identity and files --------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dir(self) -> Path:
        return self.settings.state_dir / "nodes" / self.name

    @property
    def local_ca(self) -> LocalCA:
        """The federation's CA (state/tls), which signs its nodes' certificates."""
        return LocalCA(StateFiles(self.settings.state_dir).tls_dir)

    @property
    def pid_file(self) -> Path:
        return self.dir / "pid"

    @property
    def stdout_log(self) -> Path:
        return self.dir / "stdout.log"

    @property
    def log_file(self) -> Path:
        """The log a user should open when the node misbehaves."""
        return self.stdout_log

    def logs_to_read(self) -> str:
        """The log files that explain a failure, for error messages."""
        logs = [p for p in dict.fromkeys([self.log_file, self.stdout_log]) if p.exists() and p.stat().st_size]
        return " and ".join(str(p) for p in logs) or str(self.stdout_log)

    @property
    def marker(self) -> str:
        return processes.marker(self.settings.state_dir, self.name)

    @property
    def host(self) -> str:
        return self.settings.host

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def is_running(self) -> bool:
        pid = self.pid()
        return pid is not None and processes.pid_alive(pid, self.marker)

    # --- lifecycle -------------------------------------------------------------

    def taken_port(self) -> str | None:
        """The first of the node's ports that something holds, described; None: all free."""
        for port_name, port in self.spec.ports.items():
            if port_in_use(address := self.spec.bind_address(port_name, self.host), port):
                return f"port {port} ({port_name}) on {address}"
        return None

    def preflight(self) -> None:
        """Raise NodeError if the node cannot start (missing binary, port taken)."""
        if taken := self.taken_port():
            raise NodeError(
                f"{self.name}: {taken} is already in use; "
                "choose other ports with FEDGATE_PORT_BASE or [ports] in fedgate.toml"
            )

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        raise NotImplementedError

    def prepare(self) -> None:
        """Render config files before the first start (and on every start)."""

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prepare()
        argv, env, max_fds = self.command()
        with open(self.stdout_log, "ab") as f:
            f.write(f"\n==== fedgate: starting {self.name} at {time.ctime()}\n".encode())
        proc = processes.spawn(
            argv,
            env=env,
            node_marker=self.marker,
            log_path=self.stdout_log,
            cwd=self.dir,
            max_fds=max_fds,
        )
        self.pid_file.write_text(str(proc.pid))

    def exited(self) -> int | None:
        """Exit code if the node's process has died, None while it runs."""
        pid = self.pid()
        if pid is None:
            return -1
        code = processes.exit_code(pid)
        if code is not None:
            return code
        if processes.is_child(pid):
            # our own child, not exited: it runs.  Its marker cannot tell: while the
            # process execs the next step of its start (unshare, sh, chroot, the
            # server script on RabbitMQ 4.0) /proc/<pid>/environ reads empty.
            return None
        return None if processes.pid_alive(pid, self.marker) else -1

    def ready(self) -> bool:
        raise NotImplementedError

    def boot_retries(self) -> int:
        """How often a failed boot is tried again (as a service manager would restart it)."""
        return 0

    def boot_allowance(self, boot_timeout: float) -> float:
        """Seconds this node may take to become ready, given the federation's `boot_timeout`."""
        return boot_timeout

    def kill(self) -> None:
        """SIGKILL every process of the node at once, as a crash of its host would (chaos tests);
        returns once its ports are free for a restart (a killed JVM's threads hold them), 30 s at most."""
        processes.kill_marked(self.marker)
        if (pid := self.pid()) is not None:
            processes.forget(pid)
        wait_until(lambda: not self.taken_port(), 30, 0.1)

    def stop(self, grace: float = 30.0) -> list[int]:
        """SIGTERM, then SIGKILL after `grace`; returns the pids that had to be killed."""
        pid = self.pid()
        primary = [pid] if pid is not None and processes.pid_alive(pid, self.marker) else []
        killed = processes.stop_marked(self.marker, primary=primary, grace=grace)
        if pid is not None:
            processes.forget(pid)
        self.pid_file.unlink(missing_ok=True)
        return killed

    def base_env(self) -> dict[str, str]:
        keep = ("PATH", "LANG", "LC_ALL", "TZ", "JAVA_HOME")
        return {k: os.environ[k] for k in keep if k in os.environ}


def start_and_wait(
    nodes: list[Node], started: list[Node], *, boot_timeout: float, progress: Callable[[str], None]
) -> None:
    """Start `nodes` (each appended to `started`) and wait until each is ready, or NodeError."""
    t0 = time.monotonic()
    for n in nodes:
        progress(f"starting {n.name} ({ports_text(n.spec)})")
        n.start()
        started.append(n)
    waiting = list(nodes)
    allowed = {n.name: n.boot_allowance(boot_timeout) for n in nodes}
    last_note = t0
    retries = {n.name: n.boot_retries() for n in nodes}
    while waiting:
        for n in list(waiting):
            code = n.exited()
            if code is not None and retries[n.name] > 0:
                retries[n.name] -= 1
                progress(f"{n.name} exited while booting (exit code {code}); starting it again")
                n.start()
                continue
            if code is not None:
                raise NodeError(f"{n.name} failed to boot (exit code {code}); see {n.logs_to_read()}")
            if n.ready():
                waiting.remove(n)
                progress(f"{n.name} ready in {time.monotonic() - t0:.1f}s")
        if not waiting:
            break
        now = time.monotonic()
        for n in waiting:
            if now > t0 + allowed[n.name]:
                raise NodeError(f"{n.name} not ready after {allowed[n.name]:.0f}s; see {n.logs_to_read()}")
        if now - last_note > 10:
            progress(f"waiting for {', '.join(n.name for n in waiting)} ...")
            last_note = now
        time.sleep(0.25)


def stop_started(started: list[Node]) -> None:
    """Stop what a failed start started, the last first."""
    for n in reversed(started):
        n.stop(grace=15)


def runtime_of(settings: LocalSettings) -> BrokerRuntime:
    return broker_runtime(settings.rabbitmq_release, settings.cache_dir, settings.rabbitmq_bin_dir)


def check_runtime(settings: LocalSettings, who: str) -> None:
    try:
        runtime_of(settings).check(who)
    except BrokerRuntimeError as e:
        raise NodeError(str(e)) from e


def erlang_node_name(node: str) -> str:
    return f"fedgate-{node}@localhost"


class RabbitNode(Node):
    """A RabbitMQ node, one data dir per node; infra/local/broker.py knows how it is started."""

    @property
    def erlang_node(self) -> str:
        return erlang_node_name(self.name)

    @property
    def log_file(self) -> Path:
        return self.dir / "log" / f"{self.erlang_node}.log"

    def node_config(self) -> GatewayNodeConfig | BackendNodeConfig:
        """What this node is configured with: a gateway's config or the backend's."""
        s = self.settings
        if self.spec.role == ROLE_GATEWAY:
            assert self.spec.region
            return GatewayNodeConfig(
                region=self.spec.region,
                host=self.host,
                mqtt_host=self.spec.bind_address("mqtt", self.host),
                ports=self.spec.ports,
                admin_user=ADMIN_USER,
                admin_password=self.secrets["admin"],
                memory_mb=s.rabbitmq_memory_mb,
                mqtt_tcp_buffer=s.mqtt_tcp_buffer,
                max_fds=s.gateway_max_fds,
                broker_release=s.rabbitmq_release,
                cluster_nodes=self.cluster_node_names(),
                uplink_batching=s.uplink_batching,
            )
        return BackendNodeConfig(
            host=self.host,
            ports=self.spec.ports,
            admin_user=ADMIN_USER,
            admin_password=self.secrets["admin"],
            memory_mb=s.rabbitmq_memory_mb,
            broker_release=s.rabbitmq_release,
            cluster_nodes=self.cluster_node_names(),
        )

    def cluster_members(self) -> list[NodeSpec]:
        """Every node of this node's RabbitMQ cluster (the backend's or its region's), itself included."""
        recorded = StateFiles(self.settings.state_dir).recorded() or {self.name: self.spec}
        return region_nodes(recorded.values(), self.spec.role, self.spec.region)

    def cluster_node_names(self) -> tuple[str, ...]:
        return tuple(erlang_node_name(m.name) for m in self.cluster_members())

    def boot_retries(self) -> int:
        # a cluster's nodes booting together can fail on a race in RabbitMQ 4.0 (`badmatch` in
        # mirrored_supervisor); started again, the node joins its peers
        return 2 if len(self.cluster_members()) > 1 else 0

    def admin(self, timeout: float = 10.0) -> RabbitAdmin:
        url = f"http://{self.host}:{self.spec.ports['management']}"
        return RabbitAdmin(url, ADMIN_USER, self.secrets["admin"], timeout=timeout)

    def preflight(self) -> None:
        check_runtime(self.settings, self.name)
        super().preflight()

    def prepare(self) -> None:
        p = self.spec.ports
        config = self.node_config()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rabbitmq.conf").write_text(config.rabbitmq_conf())
        if self.settings.tls:
            also = (self.spec.address, f"mqtt.{self.settings.dns_domain}") if self.spec.address else ()
            cert = self.local_ca.node_cert(self.name, self.host, *also)
            with open(self.dir / "rabbitmq.conf", "a") as conf:
                mqtts = (self.spec.bind_address("mqtts", self.host), p["mqtts"]) if "mqtts" in p else None
                conf.write(tls_listeners_conf(self.host, cert, p["amqps"], p["management_tls"], mqtts))
        (self.dir / "rabbitmq.conf").chmod(0o600)
        (self.dir / "enabled_plugins").write_text(config.enabled_plugins_text())
        if isinstance(config, GatewayNodeConfig):
            for source in config.plugin_sources:
                runtime_of(self.settings).build_plugin(source, self.dir / "plugins")

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        env = self.base_env()
        env.update(
            HOME=str(self.settings.state_dir / "home"),
            RABBITMQ_NODENAME=self.erlang_node,
            RABBITMQ_NODE_IP_ADDRESS=self.host,
            RABBITMQ_NODE_PORT=str(self.spec.ports["amqp"]),
            RABBITMQ_DIST_PORT=str(self.spec.ports["dist"]),
            RABBITMQ_CONFIG_FILE=str(self.dir / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.dir / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.dir / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(self.dir / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.dir / "log"),
            RABBITMQ_CONF_ENV_FILE="/dev/null",
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            # Erlang distribution on loopback only, not on every interface.
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=(
                "-kernel inet_dist_use_interface {127,0,0,1} " + ERL_SHARED_HOST_ARGS
            ),
        )
        config = self.node_config()
        runtime = runtime_of(self.settings)
        if isinstance(config, GatewayNodeConfig):
            env["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] += " " + config.erl_args
            # fedgate's plugins (built in prepare()) first, then the package's own
            env["RABBITMQ_PLUGINS_DIR"] = f"{self.dir / 'plugins'}:{runtime.package_plugins_dir()}"
        max_fds = config.max_fds
        # a socket is an Erlang port, which RabbitMQ's scripts cap at 65,536 unless told
        env["ERL_MAX_PORTS"] = str(max(65536, max_fds or 0))
        # the state folder holds the node's config, data, logs, the shared cookie and TLS files
        argv = runtime.command(runtime.rabbitmq("rabbitmq-server"), [], shared=[self.settings.state_dir])
        return argv, env, max_fds

    def ready(self) -> bool:
        return self.node_config().ready(self.admin(timeout=2))
