"""What a gateway node is: its rabbitmq.conf, its descriptor limit, what "ready" means.

A gateway is a RabbitMQ node with the MQTT listener.  Whoever runs one (the
local driver as a process today) asks this file what goes into its config;
how the process is started stays with the driver.  The cloud nodes render the
same template (templates/rabbitmq.conf) through Terraform.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from string import Template

from backend.contract import gateway_cluster_name
from backend.node import cluster_formation_conf, conf_for_release
from backend.rabbitmq_admin import AdminError, RabbitAdmin

TEMPLATES = Path(__file__).resolve().parent / "templates"
#: fedgate's authentication backend of gateways (an Erlang plugin, built by whoever runs the node)
MQTT_AUTH_PLUGIN = Path(__file__).resolve().parent / "mqtt_auth_plugin"
#: the batcher of a gateway's readings, with uplink batching (backend/uplink_batch.py)
UPLINK_BATCHER_PLUGIN = Path(__file__).resolve().parent / "uplink_batcher_plugin"


@dataclass(frozen=True)
class GatewayNodeConfig:
    """A gateway node's configuration: listeners, MQTT socket buffers, memory, first user."""

    region: str
    host: str
    #: where devices reach it: MQTT (and MQTT over TLS) listen here, the rest on `host`
    mqtt_host: str
    #: amqp, management, prometheus and mqtt (mqtts and amqps: the TLS listeners, added apart)
    ports: Mapping[str, int]
    admin_user: str
    admin_password: str
    memory_mb: int
    #: MQTT sndbuf/recbuf: without explicit buffers the kernel default costs ~4 MB a connection
    mqtt_tcp_buffer: int
    #: file descriptor limit of the node: one per device connection
    max_fds: int
    #: the RabbitMQ release the node runs (backend.node.conf_for_release)
    broker_release: str = "4.0"
    #: the Erlang node names of every node of the region's gateway cluster, this one included;
    #: with more than one, the nodes find each other by this list (peer discovery's classic config)
    cluster_nodes: tuple[str, ...] = ()
    #: the node runs fedgate's uplink batcher (gateways/uplink_batcher_plugin)
    uplink_batching: bool = False

    @property
    def cluster_name(self) -> str:
        return gateway_cluster_name(self.region)

    @property
    def erl_args(self) -> str:
        """Emulator flags of a gateway node, after RabbitMQ's own.

        `+MMmcs 0`: the memory segment allocator keeps no freed carriers
        cached (RabbitMQ's default keeps 30 per allocator instance). A wave
        of device connects leaves carriers behind that otherwise stay
        resident: measured here with 2,000 QoS 0 devices, ~4 KB less per
        device on a fresh gateway and ~10 KB less at the margin
        (docs/benchmarks.md); the price is an mmap/munmap where a cached
        carrier would have done.

        `+swt very_high` (and its dirty-scheduler twins): a scheduler with work wakes a
        sleeping one only once its run queue is long, not at once.  A gateway's load is
        many small jobs (a reading, a PUBACK, a confirm), and each eager wake-up was a
        thread switch in the kernel, which perf put at ~45 % of the gateway's samples.
        Measured A/B on one gateway with 500 devices (docs/benchmarks.md): 0.391 -> 0.348
        cores at 500 readings/s, 0.628 -> 0.548 at 2,000/s, p99 unchanged.  One file holds
        them for local and cloud nodes
        (templates/erl_args; Terraform's gateway-region module reads it too).
        """
        return (TEMPLATES / "erl_args").read_text().strip()

    @property
    def enabled_plugins(self) -> Path:
        return TEMPLATES / "enabled_plugins"

    def enabled_plugins_text(self) -> str:
        text = self.enabled_plugins.read_text()
        if not self.uplink_batching:
            return text
        return text.replace("].", ",fedgate_uplink_batcher].", 1)

    @property
    def plugin_sources(self) -> list[Path]:
        """fedgate's own plugins the node loads (enabled in enabled_plugins): each a folder
        with <app>.app and src/*.erl, compiled by the Erlang that runs the node.

        mqtt_auth_plugin: the gateway's authentication backend, RabbitMQ's internal
        users with one more check: a device connects with its own MQTT client id only
        (rabbitmq.conf's auth_backends; docs/security.md).  uplink_batcher_plugin: with
        uplink batching, the batcher of the node's device readings."""
        return [MQTT_AUTH_PLUGIN, *([UPLINK_BATCHER_PLUGIN] if self.uplink_batching else [])]

    def rabbitmq_conf(self) -> str:
        """The node's rabbitmq.conf (without TLS listeners)."""
        p = self.ports
        conf = Template((TEMPLATES / "rabbitmq.conf").read_text()).substitute(
            region=self.region,
            cluster_name=self.cluster_name,
            host=self.host,
            mqtt_host=self.mqtt_host,
            amqp_port=p["amqp"],
            management_port=p["management"],
            prometheus_port=p["prometheus"],
            mqtt_port=p["mqtt"],
            mqtt_tcp_buffer=self.mqtt_tcp_buffer,
            memory_mb=self.memory_mb,
            admin_user=self.admin_user,
            admin_password=self.admin_password,
        )
        return conf_for_release(conf + cluster_formation_conf(self.cluster_nodes), self.broker_release)

    def ready(self, admin: RabbitAdmin) -> bool:
        """The virtual hosts are up and devices can connect: a gateway opens its MQTT
        listener only once its client-id tracker is up."""
        try:
            admin.get("health/checks/virtual-hosts")
        except AdminError:
            return False
        return listener_open(self.mqtt_host, self.ports["mqtt"])


def listener_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
