"""Typed settings of the local federation, validated at start-up.

Sources, later ones winning: the defaults below, a TOML file (``fedgate.toml``
in the project root, or the path in ``FEDGATE_CONFIG``), then environment
variables ``FEDGATE_<FIELD>`` (e.g. ``FEDGATE_PORT_BASE=27000``,
``FEDGATE_REGIONS=local-eu,local-us``).

Ports: every node gets its ports from ``port_base`` by a fixed layout (``port_layout``) that stays
clear of the standard ports (1883, 5672, 15672, 4369, 9092, ...), so a system broker on the same
machine does not clash.  Any single port can be pinned in the TOML file's ``[ports]`` table
(docs/operations.md, "Settings").

The router's own settings are not defined here: the ``[router]`` table is
router/settings.py's (its fields, defaults and checks), passed to every router
process as it is, next to what the driver wires in (configs.router_config)::

    [router]
    park_ttl_s = 600
    [[router.rules]]
    pattern = "devices/{device}/energy/{kind:power|total}"
    topic = "energy.{kind}"
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from backend.errors import FedgateError
from backend.settings_layers import coerce, read_layers
from infra.releases import KAFKA_RELEASE
from router.settings import RouterSettings, RouterSettingsError, check_router_table, router_table
from router.settings import describe as describe_router
from spark.settings import SPARK_JARS

PROJECT_ROOT = Path(__file__).resolve().parents[2]


#: Ports every federation may use from its port_base on.
PORT_BLOCK = 1000


class SettingsError(FedgateError, ValueError):
    """A setting is missing or wrong; the message names the field."""


#: Kafka brokers of each profile (kafka_brokers = 0).
PROFILE_KAFKA_BROKERS = {"single": 1, "ha": 3}
#: Nodes of each RabbitMQ cluster (the backend's and each region's gateways) in each profile.
PROFILE_RABBITMQ_CLUSTER = {"single": 1, "ha": 3}
#: The layout has room for this many brokers (infra/local/layout.py).
MAX_KAFKA_BROKERS = 5


@dataclass(frozen=True)
class LocalSettings:
    state_dir: Path = field(
        default=PROJECT_ROOT / "state",
        metadata={"doc": "Folder holding every node's config, data, logs and pid (git ignores it)."},
    )
    cache_dir: Path = field(
        default=PROJECT_ROOT / ".cache", metadata={"doc": "Folder `make setup` downloads jars into."}
    )
    regions: tuple[str, ...] = field(
        default=("local-eu", "local-us"),
        metadata={"doc": "Local regions, each a gateway cluster (one node in the single profile)."},
    )
    profile: str = field(
        default="single",
        metadata={"doc": "single: a node per engine (the demo's); ha: no single point of failure."},
    )
    kafka_brokers: int = field(
        default=0,
        metadata={"doc": "Kafka brokers (KRaft, each also a controller); 0: the profile's (single 1, ha 3)."},
    )
    gateway_cluster_nodes: int = field(
        default=0,
        metadata={
            "doc": "RabbitMQ nodes of each region's gateway cluster; 0: the profile's (single 1, ha 3)."
        },
    )
    port_base: int = field(
        default=17000,
        metadata={"doc": "First port of the block every node's ports are laid out in."},
    )
    ports: dict[str, int] = field(
        default_factory=dict,
        metadata={"doc": 'Pinned ports, "<node>.<port name>" -> port; override the layout.'},
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"doc": "Address every listener binds to (loopback by default), the gateways' MQTT aside."},
    )
    gateway_addresses: str = field(
        default="",
        metadata={
            "doc": "127.X: node m of the s-th region's gateways takes MQTT on 127.X.s.m, a host of its "
            "own, and that region's devices ask DNS from 127.X.(100+s).0/24.  Empty: X = port_base "
            "/ 100 mod 256 (two federations with other port bases do not meet)."
        },
    )
    mqtt_port: int = field(
        default=1883, metadata={"doc": "MQTT port of every gateway (on the gateway's own address)."}
    )
    mqtts_port: int = field(
        default=8883, metadata={"doc": "MQTT over TLS port of every gateway (on its own address)."}
    )
    dns_domain: str = field(
        default="fedgate.test",
        metadata={"doc": "Devices resolve mqtt.<dns_domain> at the federation's DNS server (PowerDNS)."},
    )
    dns_ttl: int = field(
        default=5, metadata={"doc": "Seconds a device keeps the DNS answer (as the cloud's dns_ttl)."}
    )
    health_check_interval: int = field(
        default=2,
        metadata={"doc": "Seconds between the DNS server's MQTT checks of each gateway (CONNACK in 2 s)."},
    )
    prometheus_scrape_interval_s: int = field(
        default=5,
        metadata={"doc": "How often the federation's Prometheus scrapes every node (0: no Prometheus)."},
    )
    prometheus_retention: str = field(default="7d", metadata={"doc": "How long Prometheus keeps samples."})
    rabbitmq_memory_mb: int = field(
        default=1024,
        metadata={"doc": "Memory high watermark of each RabbitMQ node (absolute, MB)."},
    )
    gateway_max_fds: int = field(
        default=65536,
        metadata={"doc": "File descriptor limit of gateway nodes (one per device connection)."},
    )
    mqtt_tcp_buffer: int = field(
        default=32768,
        metadata={"doc": "MQTT socket sndbuf/recbuf in bytes (the kernel default costs ~4 MB a connection)."},
    )
    kafka_heap_mb: int = field(default=512, metadata={"doc": "Kafka broker JVM heap (MB)."})
    kafka_opts: str = field(default="", metadata={"doc": "Extra JVM options for the Kafka brokers."})
    spark_java_options: str = field(default="", metadata={"doc": "Extra JVM options for the Spark job."})
    kafka_version: str = field(
        default=KAFKA_RELEASE,
        metadata={"doc": "Apache Kafka release whose jars `make setup` downloaded."},
    )
    routers: int = field(
        default=2,
        metadata={"doc": "Router processes: router-0 routes commands, all share the uplink to Kafka."},
    )
    uplink_shards: int = field(
        default=4,
        metadata={"doc": "Uplink shard queues on the backend (fixed once the backend exists)."},
    )
    uplink_batching: bool = field(
        default=True, metadata={"doc": "Gateways batch their readings (gateways/uplink_batcher_plugin)."}
    )
    router: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "The routers' own settings, the [router] table (FEDGATE_ROUTER_<NAME> over its scalars): "
            "router/settings.py defines and checks them, every router gets them unchanged."
        },
    )
    tls: bool = field(
        default=True,
        metadata={
            "doc": "TLS listeners (MQTT over TLS for devices, AMQPS) with certificates from a local CA "
            "(state/tls); the federation links then use AMQPS and check the peer's certificate."
        },
    )
    spark: int = field(
        default=1,
        metadata={"doc": "Run the Spark job that keeps the analysts' tables (1) or not (0)."},
    )
    spark_master: str = field(
        default="local[2]", metadata={"doc": "Spark master of the local job (a cluster's URL runs it there)."}
    )
    spark_driver_memory_mb: int = field(
        default=1024,
        metadata={"doc": "Spark driver memory (MB); local mode runs everything in the driver."},
    )
    spark_trigger_s: float = field(default=2.0, metadata={"doc": "Spark: how often it looks for records."})
    spark_freshness_target_s: float = field(
        default=4.0, metadata={"doc": "Spark: how long a record may wait to be a row (batches spaced to it)."}
    )
    spark_aggregate_interval_s: float = field(
        default=60.0,
        metadata={"doc": "Spark: how often the job counts its rows in the per-minute aggregates."},
    )
    spark_aggregate_after_rows: int = field(
        default=50_000, metadata={"doc": "Spark: count sooner than the interval once this many rows wait."}
    )
    spark_compact_interval_s: float = field(
        default=120.0,
        metadata={"doc": "Spark: how often the job compacts small files and expires old snapshots."},
    )
    boot_timeout: float = field(
        default=90.0,
        metadata={"doc": "Seconds a node may take to become ready before `up` gives up."},
    )
    spark_boot_timeout: float = field(
        default=240.0,
        metadata={"doc": "Seconds the Spark job may take to be ready (its JVM's start: minutes if busy)."},
    )
    rabbitmq_release: str = field(
        default="4.0",
        metadata={
            "doc": "RabbitMQ every node runs: '4.0' (Debian 13's, built into the cache by make setup on "
            "Debian 12) or '3.10' (Debian 12's own package, if installed: make setup no longer installs it); "
            "infra/local/broker.py"
        },
    )
    rabbitmq_bin_dir: Path = field(
        default=Path("/usr/lib/rabbitmq/bin"),
        metadata={"doc": "Folder with rabbitmq-server from the system's Debian package (release 3.10)."},
    )

    # --- cloud regions (infra/cloud, docs/operations.md "Cloud regions") ------------

    cloud_state_dir: Path = field(
        default=PROJECT_ROOT / "terraform-state",
        metadata={"doc": "One Terraform root module and state per cloud region (kept by `down --purge`)."},
    )
    cloud_domain: str = field(
        default="",
        metadata={"doc": "The fleet's DNS domain: devices connect to mqtt.<domain> (latency records)."},
    )
    cloud_zone_id: str = field(
        default="",
        metadata={"doc": "Route53 hosted zone of cloud_domain."},
    )
    cloud_admin_cidrs: tuple[str, ...] = field(
        default=(),
        metadata={"doc": "CIDRs allowed on the gateways' management port (operators, routers)."},
    )
    cloud_backend_cidrs: tuple[str, ...] = field(
        default=(),
        metadata={"doc": "The backend's egress CIDRs: AMQP to/from gateways is limited to these."},
    )
    cloud_backend_amqp_host: str = field(
        default="",
        metadata={"doc": "Backend AMQP host the gateways' downlink links connect to."},
    )
    cloud_backend_amqp_port: int = field(
        default=5671,
        metadata={
            "doc": "Backend port for the downlink links: AMQPS (5671) with tls, which checks the backend's "
            "certificate for backend.<cloud_domain>; AMQP (5672) without."
        },
    )
    cloud_backend_management_url: str = field(
        default="",
        metadata={"doc": "Backend management API; regions are registered there (empty: skipped)."},
    )
    cloud_backend_user: str = field(
        default="fedgate-admin",
        metadata={"doc": "Backend management API user."},
    )
    cloud_backend_password: str = field(
        default="",
        metadata={"doc": "Its password (empty: the admin password in cloud_state_dir/secrets.json)."},
    )
    cloud_node_count: int = field(
        default=3,
        metadata={"doc": "Gateway nodes per cloud region: 3 or more (a majority survives one lost node)."},
    )
    cloud_state_bucket: str = field(
        default="",
        metadata={"doc": "S3 bucket of every region's Terraform state (empty: each region's folder)."},
    )
    cloud_state_region: str = field(
        default="", metadata={"doc": "AWS region of that bucket and lock table (empty: AWS_REGION)."}
    )
    cloud_state_key_prefix: str = field(
        default="fedgate", metadata={"doc": "A region's state is <prefix>/<region>/terraform.tfstate."}
    )
    cloud_state_lock_table: str = field(
        default="", metadata={"doc": "DynamoDB table locking the state (empty: a lock object in the bucket)."}
    )
    cloud_instance_type: str = field(
        default="t3.small",
        metadata={"doc": "EC2 instance type of cloud gateway nodes (cost knob)."},
    )
    cloud_ami_id: str = field(
        default="",
        metadata={"doc": "AMI of cloud gateway nodes, a Debian 13 image (empty: newest official Debian 13)."},
    )
    aws_endpoint_url: str = field(
        default="",
        metadata={"doc": "One endpoint for every AWS API (a moto server in tests); empty: AWS."},
    )
    terraform_bin: str = field(
        default="terraform",
        metadata={"doc": "The terraform binary (FEDGATE_TERRAFORM_BIN)."},
    )
    tf_plugin_mirror: Path = field(
        default=Path("/opt/tf-plugins"),
        metadata={"doc": "Filesystem mirror of the AWS provider (FEDGATE_TF_PLUGIN_MIRROR also works)."},
    )

    # --- derived -------------------------------------------------------------

    @property
    def device_registry_file(self) -> Path:
        """The fleet's device registry (`fedgate devices`): local gateways and cloud regions read it."""
        return self.state_dir / "devices.json"

    @property
    def backend_nodes(self) -> int:
        """RabbitMQ nodes of the backend cluster."""
        return PROFILE_RABBITMQ_CLUSTER[self.profile]

    @property
    def gateway_nodes(self) -> int:
        """RabbitMQ nodes of each region's gateway cluster."""
        return self.gateway_cluster_nodes or PROFILE_RABBITMQ_CLUSTER[self.profile]

    @property
    def kafka_broker_count(self) -> int:
        return self.kafka_brokers or PROFILE_KAFKA_BROKERS[self.profile]

    @property
    def kafka_replication(self) -> int:
        """Replicas of every topic: as many as there are brokers, up to 3."""
        return min(3, self.kafka_broker_count)

    @property
    def kafka_min_insync(self) -> int:
        """Replicas holding a record before it is acknowledged (acks=all): 2 of 3."""
        return 2 if self.kafka_replication >= 3 else 1

    @property
    def kafka_jars(self) -> Path:
        return self.cache_dir / "jars" / f"kafka-{self.kafka_version}"

    @property
    def spark_jars(self) -> Path:
        return self.cache_dir / SPARK_JARS

    @property
    def address_block(self) -> str:
        """127.X of the gateways' and the devices' own addresses (see gateway_addresses)."""
        return self.gateway_addresses or f"127.{self.port_base // 100 % 256}"

    @functools.cached_property
    def router_settings(self) -> RouterSettings:
        """What the [router] table gives (its rules, topics, limits; the wiring fields are stand-ins)."""
        return check_router_table(self.router)

    def validate(self) -> LocalSettings:
        """Every field checked (infra/local/settings_check.py); SettingsError names the first wrong one."""
        from infra.local.settings_check import check_settings

        return check_settings(self)


def load_settings(
    env: dict[str, str] | None = None, config_file: Path | None = None, **overrides: Any
) -> LocalSettings:
    """Settings from defaults, the TOML file, the environment and `overrides`, validated."""
    env = dict(os.environ if env is None else env)
    path = config_file or (Path(env["FEDGATE_CONFIG"]) if "FEDGATE_CONFIG" in env else None)
    if path is None and (PROJECT_ROOT / "fedgate.toml").exists():
        path = PROJECT_ROOT / "fedgate.toml"
    known = {f.name: str(f.type) for f in fields(LocalSettings)}
    values = read_layers(
        known,
        path=path,
        env=env,
        env_prefix="FEDGATE_",
        error=SettingsError,
        section="local",
        skip_env=("router",),  # a table: its scalars come from FEDGATE_ROUTER_<NAME>, below
    )
    for key, raw in overrides.items():
        if key not in known:
            raise SettingsError(f"unknown setting {key!r}")
        values[key] = raw
    values = {key: coerce(key, known[key], raw, SettingsError) for key, raw in values.items()}
    table = values.get("router", {})
    if not isinstance(table, dict):
        raise SettingsError(f"router: a table ([router] in the config file), not {table!r}")
    try:
        values["router"] = router_table(table, env)
    except RouterSettingsError as e:
        raise SettingsError(f"router.{e}") from e
    return LocalSettings(**values).validate()


def describe_settings() -> list[tuple[str, str, str]]:
    """(env var, default, description) for every setting, for docs and --help."""
    out = []
    for f in fields(LocalSettings):
        if f.name == "router":
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        out.append((f"FEDGATE_{f.name.upper()}", str(default), f.metadata.get("doc", "")))
    # the [router] table's fields: router/settings.py's own, with its docs
    out += [(name, default, f"Router: {doc}") for name, default, doc in describe_router()]
    return out
