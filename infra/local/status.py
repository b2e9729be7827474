"""What a local federation reports: a status row per node, and the endpoints clients use.

``fedgate status`` prints the rows (or their JSON); the demo, the tests and
the benchmarks read ``endpoints``.  Apart from the façade because both only
read: they ask each node how it is and never start or change anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend import contract as c
from backend.rabbitmq_admin import AdminError, prometheus_queue_messages
from infra.local import processes
from infra.local.dns_node import dns_endpoint
from infra.local.layout import ROLE_BACKEND, ROLE_DNS, ROUTER_NODE, NodeSpec, gateway_clusters, region_nodes
from infra.local.nodes import Node, RabbitNode
from infra.local.prometheus_node import PrometheusNode
from infra.local.services import KafkaNode, RouterNode, SparkNode, kafka_bootstrap
from infra.local.settings import LocalSettings
from infra.local.tls import LocalCA, tls_server_name


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
    #: the RabbitMQ version a broker node runs (its management API's overview); None for other nodes
    version: str | None = None
    detail: str = ""
    #: the node's own address for its device ports (a gateway's MQTT), None: the federation's host
    address: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def node_status(n: Node) -> NodeStatus:
    """How one node is: running or not, its pid and memory, and what it carries."""
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
        address=n.spec.address,
    )
    if pid:
        st.rss_mb = processes.rss_bytes(processes.marked_pids(n.marker)) // (1024 * 1024)
    if pid and isinstance(n, RabbitNode):
        try:
            ov = n.admin(timeout=3).overview()
            st.connections = ov.get("object_totals", {}).get("connections")
            st.messages = ov.get("queue_totals", {}).get("messages")
            if "prometheus" in n.spec.ports and (st.messages is None or n.spec.role == ROLE_BACKEND):
                # no management statistics are collected: queue depths come from Prometheus
                url = f"http://{n.host}:{n.spec.ports['prometheus']}"
                depths = prometheus_queue_messages(url, timeout=3)
                st.messages = sum(depths.values()) if st.messages is None else st.messages
                if poison := depths.get(c.POISON_QUEUE, 0):
                    st.detail = f"{poison} message(s) set aside in {c.POISON_QUEUE} (docs/operations.md)"
            st.version = ov.get("rabbitmq_version")
        except AdminError as e:
            st.state, st.detail = "unhealthy", str(e)
    elif pid and isinstance(n, KafkaNode):
        st.state = "running" if n.ready() else "unhealthy"
    elif pid and isinstance(n, SparkNode):
        # for the job: records in its last micro-batch
        p = n.progress()
        queries: dict[str, Any] = p.get("queries", {})
        st.messages = next((q.get("input_rows") for q in queries.values()), None)
        if not n.ready():
            st.state = "starting" if not p else "unhealthy"
            st.detail = p.get("state", "no progress report yet")
    elif pid and isinstance(n, RouterNode):
        # for a router: devices it sees connected, and messages on their way to Kafka
        try:
            m = n.metrics()
            st.connections = int(m.get("fedgate_router_presence_devices", 0))
            st.messages = int(m.get("fedgate_router_inflight", 0))
            if "fedgate_router_leading" in m:
                st.detail = "routes commands" if m["fedgate_router_leading"] else "stands by for commands"
        except OSError as e:
            st.state, st.detail = "unhealthy", str(e)
    return st


def status_rows(nodes: list[Node]) -> list[NodeStatus]:
    return [node_status(n) for n in nodes]


@dataclass
class ClusterStatus:
    """One engine's cluster: the backend's RabbitMQ nodes, a region's gateways, Kafka's brokers."""

    name: str
    members: list[str]
    running: list[str]
    #: quorum queues with a replica offline or missing (RabbitMQ), partitions whose in-sync
    #: replicas are fewer than their replicas (Kafka); None when no member answered
    under_replicated: int | None
    #: what is under-replicated, the first few
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def cluster_rows(nodes: list[Node], rows: list[NodeStatus]) -> list[ClusterStatus]:
    """Each cluster of the federation: its members, which run, and what lacks a replica."""
    state = {r.name: r.state for r in rows}
    out = []
    specs = [n.spec for n in nodes]
    groups = {"backend": region_nodes(specs, ROLE_BACKEND)} | {
        f"gateways {r}": members for r, members in gateway_clusters(specs).items()
    }
    by_name = {n.name: n for n in nodes}
    for name, cluster in groups.items():
        members = [by_name[s.name] for s in cluster]
        running = [m for m in members if state.get(m.name) == "running"]
        under, detail = _under_replicated_queues(running, len(members))
        out.append(ClusterStatus(name, [m.name for m in members], [m.name for m in running], under, detail))
    brokers = [n for n in nodes if isinstance(n, KafkaNode)]
    if brokers:
        running = [b for b in brokers if state.get(b.name) == "running"]
        under, detail = _under_replicated_partitions(kafka_bootstrap(nodes)) if running else (None, "")
        out.append(
            ClusterStatus("kafka", [b.name for b in brokers], [b.name for b in running], under, detail)
        )
    return out


def _under_replicated_queues(running: list[Node], size: int) -> tuple[int | None, str]:
    for n in running:
        assert isinstance(n, RabbitNode)
        try:
            queues = [q for q in n.admin(timeout=3).queues() if q.get("type") == "quorum"]
        except AdminError:
            continue
        short = [
            q["name"] for q in queues if len(q.get("online") or []) < max(size, len(q.get("members") or []))
        ]
        return len(short), ", ".join(short[:3]) + (" ..." if len(short) > 3 else "")
    return None, ""


def _under_replicated_partitions(bootstrap: str) -> tuple[int | None, str]:
    from confluent_kafka.admin import AdminClient

    try:
        md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=5)
    except Exception as e:  # noqa: BLE001 -- confluent-kafka raises KafkaException and others
        return None, f"no broker answered ({e})"
    short = [
        f"{t}[{p}]"
        for t, tm in md.topics.items()
        for p, pm in tm.partitions.items()
        if len(pm.isrs) < len(pm.replicas)
    ]
    return len(short), ", ".join(short[:3]) + (" ..." if len(short) > 3 else "")


def format_clusters(clusters: list[ClusterStatus]) -> str:
    """The clusters under the node table of `fedgate status`."""
    lines = []
    for cl in clusters:
        under = "?" if cl.under_replicated is None else str(cl.under_replicated)
        what = "under-replicated partitions" if cl.name == "kafka" else "under-replicated quorum queues"
        down = sorted(set(cl.members) - set(cl.running))
        lines.append(
            f"{cl.name}: {len(cl.running)}/{len(cl.members)} running"
            + (f" ({', '.join(down)} down)" if down else "")
            + f"; {what}: {under}"
            + (f" ({cl.detail})" if cl.detail else "")
        )
    return "\n".join(lines)


def _gateway_ports(spec: NodeSpec, settings: LocalSettings) -> dict[str, Any]:
    """A gateway node's ports, and `address`: where its MQTT ports listen (its own address)."""
    keys = ("mqtt", "amqp", "management", *(("mqtts", "management_tls") if settings.tls else ()))
    return {**{k: spec.ports[k] for k in keys}, "address": spec.bind_address("mqtt", settings.host)}


def endpoints(
    settings: LocalSettings, secrets: dict[str, Any], nodes: list[Node], tls_dir: Path
) -> dict[str, Any]:
    """Connection details for clients (demo, tests, benchmarks)."""
    sec = secrets
    host = settings.host
    backends = region_nodes((n.spec for n in nodes), ROLE_BACKEND)
    b = backends[0].ports
    router = next((n for n in nodes if isinstance(n, RouterNode) and n.name == ROUTER_NODE), None)
    return {
        "host": host,
        "backend": {
            "amqp": b["amqp"],
            "management": b["management"],
            "url": f"amqp://{c.ADMIN_USER}:{sec['admin']}@{host}:{b['amqp']}/%2F",
            # every node's (a cluster: backend.amqp.connect tries them in turn)
            "urls": [f"amqp://{c.ADMIN_USER}:{sec['admin']}@{host}:{n.ports['amqp']}/%2F" for n in backends],
        },
        # a region's first node's ports, and under "nodes" every node's of its cluster
        "gateways": {
            region: {
                **_gateway_ports(members[0], settings),
                "nodes": [{"name": m.name, **_gateway_ports(m, settings)} for m in members],
            }
            for region, members in gateway_clusters(n.spec for n in nodes).items()
        },
        "kafka": {
            "bootstrap": kafka_bootstrap(nodes),
            # with tls: SASL_SSL, the SCRAM user fedgate-client (secrets.json's kafka_client)
            "sasl_bootstrap": ",".join(
                n.sasl_bootstrap for n in nodes if isinstance(n, KafkaNode) and n.sasl_bootstrap
            ),
        },
        # where devices resolve their gateway (infra/local/dns_node.py)
        "dns": next(
            (
                dns_endpoint(settings, n.spec, [m.spec for m in nodes])
                for n in nodes
                if n.spec.role == ROLE_DNS
            ),
            None,
        ),
        "router": {"metrics": router.metrics_url if router else None},
        # every router's, by name: any of them may be the one routing commands
        "routers": {n.name: n.metrics_url for n in nodes if isinstance(n, RouterNode)},
        # the federation's Prometheus (infra/local/prometheus_node.py), None when it runs none
        "prometheus": next((n.url for n in nodes if isinstance(n, PrometheusNode)), None),
        "admin": {"user": c.ADMIN_USER, "password": sec["admin"]},
        # devices check the gateways' certificates against this CA (MQTT over TLS)
        "tls": {"ca": str(LocalCA(tls_dir).ca_cert), "server_name": tls_server_name(host)}
        if settings.tls
        else None,
    }
