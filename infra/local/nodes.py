"""The processes of a local federation: what each one is and how it starts.

A node knows how to render its config, start its process, tell whether it is
ready and where its log is.  The driver (driver.py) decides which nodes to
start and in what order.

Node kinds:
  epmd     Erlang's port mapper, one per state dir on a fedgate port, so that
           two local federations (the demo and the tests) never share one and
           `down` leaves no daemon behind
  backend  the backend RabbitMQ node
  gateway  one RabbitMQ node per local region, with the MQTT listener
  kafka    a single-node Kafka broker in KRaft mode (Apache Kafka's own jars)
  router   the router service (python -m router)
  spark    the streaming job that keeps the analysts' tables (python -m spark.job)
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from backend.contract import ADMIN_USER, gateway_cluster_name
from backend.errors import FedgateError
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from infra.local import processes
from infra.local.settings import PROJECT_ROOT, LocalSettings
from infra.local.tls import LocalCA, tls_listeners_conf

ROLE_EPMD = "epmd"
ROLE_BACKEND = "backend"
ROLE_GATEWAY = "gateway"
ROLE_KAFKA = "kafka"
ROLE_ROUTER = "router"
ROLE_SPARK = "spark"

#: Erlang VM flags for several nodes sharing two cores: no busy-waiting
#: schedulers (they would burn a core each while idle).
ERL_SHARED_HOST_ARGS = "+sbwt none +sbwtdcpu none +sbwtdio none"


class NodeError(FedgateError):
    """A node cannot start or is not ready; the message names the node and its log."""


@dataclass
class NodeSpec:
    """A node of the local federation as recorded in state/federation.json."""

    name: str
    role: str
    region: str | None
    ports: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "region": self.region, "ports": self.ports}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeSpec:
        return cls(d["name"], d["role"], d.get("region"), {k: int(v) for k, v in d["ports"].items()})


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


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


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

    def preflight(self) -> None:
        """Raise NodeError if the node cannot start (missing binary, port taken)."""
        for port_name, port in self.spec.ports.items():
            if port_in_use(self.host, port):
                raise NodeError(
                    f"{self.name}: port {port} ({port_name}) on {self.host} is already in use; "
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
        return None if processes.pid_alive(pid, self.marker) else -1

    def ready(self) -> bool:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL every process of the node at once, as a crash of its host would (chaos tests)."""
        processes.signal_pids(processes.marked_pids(self.marker), signal.SIGKILL)
        pid = self.pid()
        if pid is not None:
            processes.forget(pid)

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


class EpmdNode(Node):
    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        epmd = shutil.which("epmd") or "/usr/bin/epmd"
        env = self.base_env()
        return [epmd, "-port", str(self.spec.ports["epmd"]), "-address", self.host], env, None

    def preflight(self) -> None:
        if not (shutil.which("epmd") or Path("/usr/bin/epmd").exists()):
            raise NodeError(f"{self.name}: epmd not found (Erlang); run `make setup`")
        super().preflight()

    def ready(self) -> bool:
        return port_open(self.host, self.spec.ports["epmd"])


class RabbitNode(Node):
    """A RabbitMQ node run straight from Debian's package, one data dir per node."""

    @property
    def erlang_node(self) -> str:
        return f"fedgate-{self.name}@localhost"

    @property
    def log_file(self) -> Path:
        return self.dir / "log" / f"{self.erlang_node}.log"

    @property
    def template_dir(self) -> Path:
        sub = "backend" if self.spec.role == ROLE_BACKEND else "gateways"
        return PROJECT_ROOT / sub / "templates"

    def admin(self, timeout: float = 10.0) -> RabbitAdmin:
        url = f"http://{self.host}:{self.spec.ports['management']}"
        return RabbitAdmin(url, ADMIN_USER, self.secrets["admin"], timeout=timeout)

    def preflight(self) -> None:
        if not (self.settings.rabbitmq_bin_dir / "rabbitmq-server").exists():
            raise NodeError(
                f"{self.name}: {self.settings.rabbitmq_bin_dir}/rabbitmq-server not found; "
                "run `make setup` (installs Debian's rabbitmq-server)"
            )
        super().preflight()

    def prepare(self) -> None:
        p = self.spec.ports
        values = dict(
            region=self.spec.region or "",
            cluster_name=(gateway_cluster_name(self.spec.region) if self.spec.region else "fedgate-backend"),
            host=self.host,
            amqp_port=p["amqp"],
            management_port=p["management"],
            prometheus_port=p["prometheus"],
            mqtt_port=p.get("mqtt", 0),
            mqtt_tcp_buffer=self.settings.mqtt_tcp_buffer,
            memory_mb=self.settings.rabbitmq_memory_mb,
            admin_user=ADMIN_USER,
            admin_password=self.secrets["admin"],
        )
        render(self.template_dir / "rabbitmq.conf", self.dir / "rabbitmq.conf", **values)
        if self.settings.tls:
            cert = LocalCA(self.settings.state_dir / "tls").node_cert(self.name, self.host)
            with open(self.dir / "rabbitmq.conf", "a") as conf:
                conf.write(tls_listeners_conf(self.host, cert, p["amqps"], p.get("mqtts")))
        (self.dir / "rabbitmq.conf").chmod(0o600)
        shutil.copyfile(self.template_dir / "enabled_plugins", self.dir / "enabled_plugins")

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
        max_fds = self.settings.gateway_max_fds if self.spec.role == ROLE_GATEWAY else 8192
        return [str(self.settings.rabbitmq_bin_dir / "rabbitmq-server")], env, max_fds

    def ready(self) -> bool:
        try:
            self.admin(timeout=2).get("health/checks/virtual-hosts")
        except AdminError:
            return False
        # A gateway opens its MQTT listener only once its client-id tracker is up.
        return "mqtt" not in self.spec.ports or port_open(self.host, self.spec.ports["mqtt"])


class KafkaNode(Node):
    """Apache Kafka, broker and controller in one JVM (KRaft), from the jars in .cache."""

    @property
    def log_file(self) -> Path:
        return self.dir / "logs" / "server.log"

    @property
    def classpath(self) -> str:
        return str(self.settings.kafka_jars / "*")

    def preflight(self) -> None:
        if not shutil.which("java"):
            raise NodeError(f"{self.name}: java not found; run `make setup`")
        if not (self.settings.kafka_jars / ".complete").exists():
            raise NodeError(
                f"{self.name}: Kafka jars missing in {self.settings.kafka_jars}; run `make setup`"
            )
        super().preflight()

    def prepare(self) -> None:
        tdir = PROJECT_ROOT / "infra" / "local" / "templates"
        data = self.dir / "data"
        render(
            tdir / "kafka-server.properties",
            self.dir / "server.properties",
            host=self.host,
            bootstrap_port=self.spec.ports["bootstrap"],
            controller_port=self.spec.ports["controller"],
            data_dir=data,
        )
        render(
            tdir / "kafka-log4j2.properties",
            self.dir / "log4j2.properties",
            log_dir=self.dir / "logs",
        )
        if not (data / "meta.properties").exists():
            cluster_id = kraft_cluster_id()
            out = subprocess.run(
                [
                    *self.java_prefix(),
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    cluster_id,
                    "-c",
                    str(self.dir / "server.properties"),
                ],
                env={**self.base_env(), "FEDGATE_NODE_ID": self.marker},
                capture_output=True,
                text=True,
                timeout=120,
            )
            if out.returncode != 0:
                (self.dir / "format.log").write_text(out.stdout + out.stderr)
                raise NodeError(
                    f"{self.name}: formatting the KRaft storage failed; see {self.dir / 'format.log'}"
                )

    def java_prefix(self) -> list[str]:
        return [
            "java",
            "-Xms128m",
            f"-Xmx{self.settings.kafka_heap_mb}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.dir / 'logs'}",
            *self.settings.kafka_opts.split(),
            "-cp",
            self.classpath,
        ]

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        argv = [*self.java_prefix(), "kafka.Kafka", str(self.dir / "server.properties")]
        return argv, self.base_env(), 65536

    def ready(self) -> bool:
        if not port_open(self.host, self.spec.ports["bootstrap"]):
            return False
        from confluent_kafka.admin import AdminClient

        client = AdminClient({"bootstrap.servers": self.bootstrap, "socket.timeout.ms": 2000})
        try:
            md = client.list_topics(timeout=2)
        except Exception:  # KafkaException while the broker finishes starting
            return False
        return bool(md.brokers)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.spec.ports['bootstrap']}"


class RouterNode(Node):
    """The router service (python -m router), configured by a rendered router.toml."""

    #: filled in by the driver before start: what the router connects to
    config: dict[str, Any] | None = None

    @property
    def log_file(self) -> Path:
        return self.stdout_log

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.spec.ports['metrics']}"

    def prepare(self) -> None:
        if self.config is None:
            return  # restarted by start_node: keep the rendered config
        lines = ["# fedgate router -- rendered by fedgate, do not edit."]
        for key, value in self.config.items():
            if key == "gateways":
                continue
            lines.append(f"{key} = {_toml(value)}")
        for region, gw in self.config.get("gateways", {}).items():
            lines.append(f"\n[gateways.{region}]")
            lines += [f"{k} = {_toml(v)}" for k, v in gw.items()]
        path = self.dir / "router.toml"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        env = self.base_env()
        env["PYTHONPATH"] = str(PROJECT_ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        return [sys.executable, "-m", "router", "--config", str(self.dir / "router.toml")], env, 65536

    def metrics(self) -> dict[str, float]:
        """The router's Prometheus metrics, summed over labels."""
        out: dict[str, float] = {}
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=3) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    name = name.split("{", 1)[0]
                    out[name] = out.get(name, 0.0) + float(value)
        return out

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.metrics_url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False


class SparkNode(Node):
    """The Spark job (python -m spark.job) on a local master; pyspark starts its JVM as a child."""

    #: filled in by the driver before start: the job's settings (spark.toml)
    config: dict[str, Any] | None = None

    @property
    def progress_file(self) -> Path:
        return self.dir / "progress.json"

    def preflight(self) -> None:
        super().preflight()
        jars = self.settings.spark_kafka_jars
        if not any(jars.glob("spark-sql-kafka*.jar")):
            raise NodeError(f"{self.name}: Spark's Kafka source is not in {jars}; run `make setup`")
        if shutil.which("java") is None:
            raise NodeError(f"{self.name}: java is not installed; run `make setup`")

    def prepare(self) -> None:
        # a report from before this start would make the new job look ready
        self.progress_file.unlink(missing_ok=True)
        if self.config is None:
            return  # restarted by start_node: keep the rendered config
        lines = ["# fedgate spark job -- rendered by fedgate, do not edit."]
        lines += [f"{k} = {_toml(v)}" for k, v in self.config.items()]
        (self.dir / "spark.toml").write_text("\n".join(lines) + "\n")

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        env = self.base_env()
        env["PYTHONPATH"] = str(PROJECT_ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        return [sys.executable, "-m", "spark.job", "--config", str(self.dir / "spark.toml")], env, None

    def progress(self) -> dict[str, Any]:
        """What the job last wrote about its queries ({} before its first report)."""
        try:
            return dict(json.loads(self.progress_file.read_text()))
        except (FileNotFoundError, ValueError):
            return {}

    def ready(self) -> bool:
        p = self.progress()
        queries = p.get("queries", {})
        return p.get("state") == "running" and bool(queries) and all(q["active"] for q in queries.values())

    def stop(self, grace: float = 60.0) -> list[int]:
        return super().stop(grace)


def kraft_cluster_id() -> str:
    """A random KRaft cluster id, as `kafka-storage random-uuid` makes them.

    Base64 of a UUID starts with '-' one time in 64, and the storage tool
    would read such an id as an option ("expected one argument"); Kafka's
    own generator draws again in that case, and so does this.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


NODE_CLASSES: dict[str, type[Node]] = {
    ROLE_EPMD: EpmdNode,
    ROLE_BACKEND: RabbitNode,
    ROLE_GATEWAY: RabbitNode,
    ROLE_KAFKA: KafkaNode,
    ROLE_ROUTER: RouterNode,
    ROLE_SPARK: SparkNode,
}
