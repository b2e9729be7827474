"""What the backend node is: its rabbitmq.conf, its descriptor limit, what "ready" means.

The backend is a RabbitMQ node without device listeners.  Whoever runs it
(the local driver as a process today) asks this file what goes into its
config; how the process is started stays with the driver.  The cloud node
renders the same template (templates/rabbitmq.conf) through Terraform.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from string import Template

from backend.contract import BACKEND_CLUSTER_NAME
from backend.rabbitmq_admin import AdminError, RabbitAdmin

TEMPLATES = Path(__file__).resolve().parent / "templates"

#: file descriptor limit of the backend node: federation links, routers, the management API
BACKEND_MAX_FDS = 8192


def conf_for_release(conf: str, release: str) -> str:
    """A rendered rabbitmq.conf for the release that reads it: 3.10 knows no deprecated
    features, so the lines that deny them (4.0's) are left out."""
    if release != "3.10":
        return conf
    return "\n".join(ln for ln in conf.splitlines() if not ln.startswith("deprecated_features.")) + "\n"


def cluster_formation_conf(nodes: tuple[str, ...]) -> str:
    """rabbitmq.conf lines that make `nodes` (Erlang node names) one cluster as they boot: each
    joins the others it finds; "" for a single node.  (Cloud nodes discover their peers through
    the autoscaling group instead: infra/terraform.)"""
    if len(nodes) < 2:
        return ""
    lines = [
        "",
        "# One cluster of these nodes (rendered by fedgate): each joins the others at its first boot.",
        "cluster_formation.peer_discovery_backend = classic_config",
        *(f"cluster_formation.classic_config.nodes.{i} = {n}" for i, n in enumerate(nodes, 1)),
        # a node that boots while the others are still down waits for them instead of
        # forming a cluster of its own
        "cluster_formation.discovery_retry_limit = 60",
        "cluster_formation.discovery_retry_interval = 1000",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class BackendNodeConfig:
    """The backend node's configuration: listeners, memory, first user."""

    host: str
    #: amqp, management and prometheus (amqps: the TLS listener, added apart)
    ports: Mapping[str, int]
    admin_user: str
    admin_password: str
    memory_mb: int
    max_fds: int = BACKEND_MAX_FDS
    #: the RabbitMQ release the node runs (conf_for_release)
    broker_release: str = "4.0"
    #: the Erlang node names of every node of the backend cluster, this one included; with more
    #: than one, the nodes find each other by this list (peer discovery's classic config)
    cluster_nodes: tuple[str, ...] = ()

    @property
    def cluster_name(self) -> str:
        return BACKEND_CLUSTER_NAME

    @property
    def enabled_plugins(self) -> Path:
        return TEMPLATES / "enabled_plugins"

    def enabled_plugins_text(self) -> str:
        return self.enabled_plugins.read_text()

    def rabbitmq_conf(self) -> str:
        """The node's rabbitmq.conf (without TLS listeners)."""
        p = self.ports
        conf = Template((TEMPLATES / "rabbitmq.conf").read_text()).substitute(
            cluster_name=self.cluster_name,
            host=self.host,
            amqp_port=p["amqp"],
            management_port=p["management"],
            prometheus_port=p["prometheus"],
            memory_mb=self.memory_mb,
            admin_user=self.admin_user,
            admin_password=self.admin_password,
        )
        return conf_for_release(conf + cluster_formation_conf(self.cluster_nodes), self.broker_release)

    def ready(self, admin: RabbitAdmin) -> bool:
        """The virtual hosts are up."""
        try:
            admin.get("health/checks/virtual-hosts")
        except AdminError:
            return False
        return True
