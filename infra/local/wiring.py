"""Wiring a local federation: the definitions applied to its RabbitMQ nodes, and its links.

The definitions themselves are the same a cloud region gets (backend/wiring.py,
gateways/wiring.py); this file says where the local nodes are (link
endpoints: AMQP, or AMQPS checked against the local CA), applies them through
each node's management API, and watches the federation links until they run.
Apart from booting because adding and removing a region re-wire a running
federation too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend import region_registry
from backend.contract import ADMIN_USER
from backend.devices import device_users
from backend.polling import wait_until
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from backend.wiring import AmqpEndpoint, GatewayLink, backend_definitions
from gateways.wiring import gateway_definitions
from infra.device_registry import DeviceRegistry
from infra.local import configs
from infra.local.layout import BACKEND_NODE, ROLE_BACKEND, ROLE_GATEWAY, gateway_clusters, region_nodes
from infra.local.nodes import Node, RabbitNode, erlang_node_name
from infra.local.settings import LocalSettings
from infra.local.tls import LocalCA, tls_server_name


def link_endpoint(settings: LocalSettings, tls_dir: Path, node: Node) -> AmqpEndpoint:
    """Where a federation link reaches `node`: AMQPS checked against the local CA (TLS on)."""
    host = settings.host
    if not settings.tls:
        return AmqpEndpoint(host, node.spec.ports["amqp"])
    return AmqpEndpoint(
        host,
        node.spec.ports["amqps"],
        tls=True,
        ca_file=str(LocalCA(tls_dir).ensure_ca()),
        server_name=tls_server_name(host),
    )


def wire(
    nodes: list[Node],
    *,
    settings: LocalSettings,
    secrets: dict[str, Any],
    registry: DeviceRegistry,
    tls_dir: Path,
    progress: Callable[[str], None],
) -> None:
    """Apply the federation definitions to every RabbitMQ node of `nodes` and wait for the links."""
    sec = secrets
    backends = cluster(nodes, ROLE_BACKEND)
    backend = backends[0]
    if len(backends) > 1:
        wait_for_cluster(backend, [n.name for n in backends], progress)
    backend_eps = [link_endpoint(settings, tls_dir, n) for n in backends]
    links = []
    for region in gateway_clusters(n.spec for n in nodes):
        members = cluster(nodes, ROLE_GATEWAY, region)
        gw = members[0]  # definitions are the cluster's: applied through its first node
        if len(members) > 1:
            wait_for_cluster(gw, [n.name for n in members], progress)
        gw.admin().apply(
            gateway_definitions(
                region,
                backend_eps[0],
                backend_others=backend_eps[1:],
                upstream_queue_type="quorum" if len(backend_eps) > 1 else "classic",
                uplink_batching=settings.uplink_batching,
                gateway_queue_type="quorum" if len(members) > 1 else "classic",
                admin_password=sec["admin"],
                backend_link_password=sec["backend_link"],
                gateway_password=sec["gateways"][region],
            )
        )
        fleet = registry.hashes()
        if fleet:
            gw.admin().import_users(device_users(fleet))
        links.append(
            GatewayLink(
                region,
                link_endpoint(settings, tls_dir, gw),
                sec["gateways"][region],
                others=tuple(link_endpoint(settings, tls_dir, m) for m in members[1:]),
                uplink_batching=settings.uplink_batching,
            )
        )
    backend.admin().apply(
        backend_definitions(
            links,
            admin_password=sec["admin"],
            backend_link_password=sec["backend_link"],
            router_password=sec["router"],
            uplink_shards=settings.uplink_shards,
        )
    )
    # what the routers learn the regions from, at run time (router/region_watch.py)
    region_registry.sync(backend.admin(), configs.gateway_tables(settings, sec, nodes))
    progress("federation wired; waiting for links")
    wait_for_links(nodes, timeout=60)


def cluster(nodes: list[Node], role: str, region: str | None = None) -> list[RabbitNode]:
    """The RabbitMQ nodes of one cluster (the backend's or a region's gateways), the first first."""
    names = [s.name for s in region_nodes((n.spec for n in nodes), role, region)]
    by_name = {n.name: n for n in nodes if isinstance(n, RabbitNode)}
    return [by_name[name] for name in names]


def wait_for_cluster(first: RabbitNode, members: list[str], progress: Callable[[str], None]) -> None:
    """Block until every node of the cluster `first` belongs to runs in it (peer discovery
    joins them as they boot): quorum queues declared then get a replica on each."""
    want = {erlang_node_name(m) for m in members}
    running: set[str] = set()

    def all_running() -> bool:
        nonlocal running
        try:
            running = {n["name"] for n in first.admin(timeout=5).get("nodes") if n.get("running")}
        except AdminError:
            running = set()
        return want <= running

    if not wait_until(all_running, 120, 0.5):
        raise TimeoutError(f"{first.name}'s cluster: {sorted(running)} running, not {sorted(want)}")
    progress(f"{first.name}: a cluster of {len(want)} running nodes")


def cluster_admin(node: RabbitNode, timeout: float = 10.0) -> RabbitAdmin:
    """The management API of `node`'s cluster: that node first, the next member when it does
    not answer (as the router and `fedgate status` ask a cluster)."""
    members = [node.spec, *(m for m in node.cluster_members() if m.name != node.name)]
    urls = [f"http://{node.host}:{m.ports['management']}" for m in members]
    return RabbitAdmin(urls, ADMIN_USER, node.secrets["admin"], timeout=timeout)


def link_states(nodes: list[Node]) -> dict[str, list[tuple[str, str]]]:
    """Federation links per RabbitMQ cluster, keyed by its first node's name:
    (upstream:exchange@node that runs it, status).  A cluster's management API lists the links
    of all its nodes, so each cluster is asked once, through its first node, or the next member
    when that one does not answer (a node just restarted can refuse or time out for a while)."""
    out: dict[str, list[tuple[str, str]]] = {}
    firsts = {BACKEND_NODE} | {m[0].name for m in gateway_clusters(n.spec for n in nodes).values()}
    for n in nodes:
        if not isinstance(n, RabbitNode) or n.name not in firsts:
            continue
        try:
            links = cluster_admin(n, timeout=5).federation_links()
        except AdminError as e:
            # the cause belongs in a timeout's message: a cluster that does not answer and
            # one that lists no link are two different faults
            out[n.name] = [(f"no answer: {e}", "unknown")]
            continue
        out[n.name] = [
            (
                f"{lk.get('upstream')}:{lk.get('upstream_exchange') or lk.get('exchange')}"
                f"@{str(lk.get('node', '?')).split('@')[0]}",
                lk.get("status", "?"),
            )
            for lk in links
        ]
    return out


def wait_for_links(nodes: list[Node], timeout: float = 60) -> None:
    """Block until every federation link is running: 2 per region on the backend, 1 on each
    region's gateways."""
    gateways = [members[0].name for members in gateway_clusters(n.spec for n in nodes).values()]
    want = {BACKEND_NODE: 2 * len(gateways), **dict.fromkeys(gateways, 1)}
    missing: dict[str, str] = {}
    last_states: dict[str, list[tuple[str, str]]] = {}

    def all_running() -> bool:
        nonlocal missing
        states = link_states(nodes)
        missing = {
            node: f"{sum(1 for _, s in states.get(node, []) if s == 'running')}/{n} running"
            for node, n in want.items()
            if sum(1 for _, s in states.get(node, []) if s == "running") < n
        }
        last_states.update(states)
        return not missing

    if not wait_until(all_running, timeout, 0.25):
        raise TimeoutError(
            f"federation links not running after {timeout:.0f}s: {missing}"
            f" (links listed: { {n: last_states.get(n) for n in missing} })"
        )
