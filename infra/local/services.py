"""The services of a local federation that are not RabbitMQ: Kafka, the routers, the Spark job.

Each is a Node (nodes.py) that knows its own command line, config files and
readiness.  They are apart from nodes.py because they start other engines
(a JVM, python -m router, python -m spark.job) with their own settings files,
while nodes.py holds what every node shares and the RabbitMQ nodes.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client.parser import text_string_to_metric_families

from backend.kafka_security import KafkaSecurity
from infra.local.dns_node import DnsNode
from infra.local.kafka_metrics import agent_args
from infra.local.layout import (
    ROLE_BACKEND,
    ROLE_DNS,
    ROLE_EPMD,
    ROLE_GATEWAY,
    ROLE_KAFKA,
    ROLE_PROMETHEUS,
    ROLE_ROUTER,
    ROLE_SPARK,
    NodeSpec,
    StateFiles,
    kafka_broker_id,
)
from infra.local.nodes import (
    Node,
    NodeError,
    RabbitNode,
    check_runtime,
    port_open,
    render,
    runtime_of,
)
from infra.local.prometheus_node import PrometheusNode
from infra.local.settings import PROJECT_ROOT
from infra.local.toml_out import to_toml, toml_lines

#: The SCRAM user and mechanism of the local Kafka's SASL_SSL listener (KafkaNode.sasl_listener).
KAFKA_CLIENT_USER = "fedgate-client"
KAFKA_SCRAM_MECHANISM = "SCRAM-SHA-512"


class EpmdNode(Node):
    """Erlang's port mapper, from the same release as the RabbitMQ nodes that register with it."""

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        runtime = runtime_of(self.settings)
        args = ["-port", str(self.spec.ports["epmd"]), "-address", self.host]
        return runtime.command(runtime.epmd, args, shared=[]), self.base_env(), None

    def preflight(self) -> None:
        check_runtime(self.settings, self.name)
        super().preflight()

    def ready(self) -> bool:
        return port_open(self.host, self.spec.ports["epmd"])


class KafkaNode(Node):
    """Apache Kafka, broker and controller in one JVM (KRaft), from the jars in .cache."""

    #: the SCRAM user of the SASL_SSL listener, created at format
    scram_user: ClassVar[str] = KAFKA_CLIENT_USER

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

    def brokers(self) -> list[NodeSpec]:
        """Every broker of the federation's Kafka cluster, this one included, by node id."""
        recorded = StateFiles(self.settings.state_dir).recorded() or {self.name: self.spec}
        return sorted(
            (s for s in recorded.values() if s.role == ROLE_KAFKA), key=lambda s: kafka_broker_id(s.name)
        )

    def prepare(self) -> None:
        tdir = PROJECT_ROOT / "infra" / "local" / "templates"
        data = self.dir / "data"
        brokers = self.brokers()
        s = self.settings
        render(
            tdir / "kafka-server.properties",
            self.dir / "server.properties",
            host=self.host,
            bootstrap_port=self.spec.ports["bootstrap"],
            controller_port=self.spec.ports["controller"],
            data_dir=data,
            node_id=kafka_broker_id(self.name),
            brokers=len(brokers),
            voters=",".join(
                f"{kafka_broker_id(b.name)}@{self.host}:{b.ports['controller']}" for b in brokers
            ),
            # a federation recorded with fewer brokers than the settings say keeps its own count
            replication=min(s.kafka_replication, len(brokers)),
            min_insync=min(s.kafka_min_insync, len(brokers)),
            **self.sasl_listener(),
        )
        render(
            tdir / "kafka-log4j2.properties",
            self.dir / "log4j2.properties",
            log_dir=self.dir / "logs",
        )
        if not (data / "meta.properties").exists():
            # one id for every broker of the cluster, the same at each format
            cluster_id = kraft_cluster_id(str(self.settings.state_dir.resolve()))
            out = subprocess.run(
                [
                    *self.java_prefix(),
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    cluster_id,
                    "-c",
                    str(self.dir / "server.properties"),
                    # the SASL_SSL listener's user, in the cluster's metadata from the start
                    *(
                        [
                            "--add-scram",
                            f"{KAFKA_SCRAM_MECHANISM}=[name={self.scram_user},password={self.secrets['kafka_client']}]",
                        ]
                        if s.tls
                        else []
                    ),
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

    def sasl_listener(self) -> dict[str, str]:
        """With tls: a SASL_SSL listener (SCRAM, what MSK offers) beside the plaintext one, its
        certificate from the local CA; the federation's own clients stay on plaintext."""
        if not self.settings.tls:
            return {"sasl_listener": "", "sasl_config": ""}
        cert = self.local_ca.node_cert(self.name, self.host)
        keystore = self.dir / "sasl-keystore.pem"  # Kafka's PEM keystore: the key, then the chain
        keystore.write_text(cert.key.read_text() + cert.cert.read_text())
        keystore.chmod(0o600)
        return {
            "sasl_listener": f",SASL_SSL://{self.sasl_bootstrap}",
            "sasl_config": "\n".join(
                [
                    "# The SASL_SSL listener: SCRAM users over TLS (created at format, fedgate's",
                    "# kafka_client secret); no authorizer, so a user may do what a plaintext client may.",
                    f"sasl.enabled.mechanisms={KAFKA_SCRAM_MECHANISM}",
                    f"listener.name.sasl_ssl.{KAFKA_SCRAM_MECHANISM.lower()}.sasl.jaas.config="
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;",
                    "ssl.keystore.type=PEM",
                    f"ssl.keystore.location={keystore}",
                ]
            ),
        }

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
        # the broker alone serves metrics (the format tool shares java_prefix)
        metrics = agent_args(self.settings, self.dir, self.host, self.spec.ports.get("metrics"))
        argv = [*self.java_prefix(), *metrics, "kafka.Kafka", str(self.dir / "server.properties")]
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

    @property
    def sasl_bootstrap(self) -> str:
        """Where the SASL_SSL listener is ("": no tls, no such listener)."""
        return f"{self.host}:{self.spec.ports['sasl']}" if self.settings.tls else ""

    def sasl_security(self) -> KafkaSecurity | None:
        """How a client logs in at the SASL_SSL listener (None: no tls, no such listener)."""
        if not self.settings.tls:
            return None
        return KafkaSecurity(
            "SASL_SSL",
            KAFKA_SCRAM_MECHANISM,
            self.scram_user,
            self.secrets["kafka_client"],
            str(self.local_ca.ca_cert),
        )


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
            lines.append(f"{key} = {to_toml(value)}")
        for region, gw in self.config.get("gateways", {}).items():
            lines.append(f"\n[gateways.{region}]")
            lines += toml_lines(gw)
        path = self.dir / "router.toml"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)

    def command(self) -> tuple[list[str], dict[str, str], int | None]:
        env = self.base_env()
        env["PYTHONPATH"] = str(PROJECT_ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        router = [sys.executable, "-m", "router", "--config", str(self.dir / "router.toml")]
        # started again when it exits failed (a stalled Kafka producer), as systemd does in the cloud
        return [sys.executable, "-m", "infra.local.supervisor", "--", *router], env, 65536

    def regions(self) -> list[str] | None:
        """The regions the router routes to (its /regions); None while it does not answer."""
        try:
            with urllib.request.urlopen(self.metrics_url + "/regions", timeout=3) as r:
                return sorted(json.loads(r.read())["regions"])
        except (OSError, ValueError, KeyError):
            return None

    def metrics(self) -> dict[str, float]:
        """The router's Prometheus metrics, summed over labels."""
        out: dict[str, float] = {}
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=3) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                for sample in family.samples:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
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
        jars = self.settings.spark_jars
        for jar, what in (("spark-sql-kafka", "Spark's Kafka source"), ("iceberg-spark-runtime", "Iceberg")):
            if not any(jars.glob(f"{jar}*.jar")):
                raise NodeError(f"{self.name}: {what} is not in {jars}; run `make setup`")
        if shutil.which("java") is None:
            raise NodeError(f"{self.name}: java is not installed; run `make setup`")

    def prepare(self) -> None:
        # a report from before this start would make the new job look ready
        self.progress_file.unlink(missing_ok=True)
        if self.config is None:
            return  # restarted by start_node: keep the rendered config
        lines = ["# fedgate spark job -- rendered by fedgate, do not edit."]
        lines += toml_lines(self.config)
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

    def boot_allowance(self, boot_timeout: float) -> float:
        return max(boot_timeout, self.settings.spark_boot_timeout)

    def ready(self) -> bool:
        p = self.progress()
        queries = p.get("queries", {})
        return p.get("state") == "running" and bool(queries) and all(q["active"] for q in queries.values())

    def stop(self, grace: float = 60.0) -> list[int]:
        return super().stop(grace)


def kraft_cluster_id(seed: str) -> str:
    """The KRaft cluster id of the federation `seed` names (its state folder), shaped as
    `kafka-storage random-uuid` makes them: every broker formats its storage with the same.

    Base64 of a UUID starts with '-' one time in 64, and the storage tool
    would read such an id as an option ("expected one argument"); Kafka's
    own generator draws again in that case, and so does this.
    """
    for draw in itertools.count():
        digest = uuid.uuid5(uuid.NAMESPACE_URL, f"fedgate-kafka:{seed}:{draw}")
        cluster_id = base64.urlsafe_b64encode(digest.bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id
    raise AssertionError("unreachable")


def kafka_bootstrap(nodes: list[Node]) -> str:
    """Every broker of the federation's Kafka (host:port,...): a client reaches the cluster
    through whichever answers."""
    return ",".join(n.bootstrap for n in nodes if isinstance(n, KafkaNode))


#: the node kind of each role
NODE_CLASSES: dict[str, type[Node]] = {
    ROLE_EPMD: EpmdNode,
    ROLE_BACKEND: RabbitNode,
    ROLE_GATEWAY: RabbitNode,
    ROLE_KAFKA: KafkaNode,
    ROLE_ROUTER: RouterNode,
    ROLE_SPARK: SparkNode,
    ROLE_DNS: DnsNode,
    ROLE_PROMETHEUS: PrometheusNode,
}
