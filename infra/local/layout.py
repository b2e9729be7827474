"""Where every node of a local federation sits (names, roles, ports) and the files that record it.

``port_layout`` turns the settings (and what federation.json recorded) into
the list of nodes with their ports.  It is pure arithmetic on the settings,
separate from starting anything, so the CLI and the unit tests can ask for
the layout of a federation that is not running.  ``StateFiles`` reads and
writes the state folder's records::

    state/
      federation.json   the nodes, their roles, regions and ports (status --json reads it)
      secrets.json      generated passwords (mode 600)
      home/             HOME of the Erlang nodes (.erlang.cookie)
      nodes/<node>/     config, data, logs and pid of each node
      tls/              the local CA and the nodes' certificates
      warehouse/        the Spark job's tables
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend import contract as c
from backend.errors import FedgateError
from infra.local.settings import LocalSettings
from infra.secrets_file import SecretsFile

ROLE_EPMD = "epmd"
ROLE_BACKEND = "backend"
ROLE_GATEWAY = "gateway"
ROLE_KAFKA = "kafka"
ROLE_ROUTER = "router"
ROLE_SPARK = "spark"
ROLE_DNS = "dns"
ROLE_PROMETHEUS = "prometheus"

#: Offsets of each node's ports from port_base.
EPMD_OFFSET = 0
#: `sasl`: the SASL_SSL (SCRAM) listener beside the plaintext one (with tls, infra/local/services.py)
KAFKA_OFFSETS = {"bootstrap": 10, "controller": 11, "sasl": 12}
#: each broker's metrics (infra/local/kafka_metrics.py): a block of their own, a port a broker
KAFKA_METRICS_OFFSET = 80
#: `management_tls`: the management API over HTTPS (with tls, gateways/templates/tls.conf)
BACKEND_OFFSETS = {
    "amqp": 20,
    "management": 21,
    "dist": 22,
    "prometheus": 23,
    "amqps": 24,
    "management_tls": 25,
}
GATEWAY_BASE_OFFSET = 100
GATEWAY_STRIDE = 10
GATEWAY_OFFSETS = {
    "mqtt": 0,
    "amqp": 1,
    "management": 2,
    "dist": 3,
    "prometheus": 4,
    "mqtts": 5,
    "amqps": 6,
    "management_tls": 7,
}

#: Kafka brokers after the first ("kafka-2", ...): KAFKA_OFFSETS moved by this much per broker.
KAFKA_EXTRA_OFFSET = 50
KAFKA_EXTRA_STRIDE = 3
#: Backend nodes after the first ("backend-2", ...): BACKEND_OFFSETS moved by this much per node.
BACKEND_EXTRA_OFFSET = 60
BACKEND_EXTRA_STRIDE = 6
#: Gateway nodes after a region's first ("gw-local-eu-n2", ...): a block of their own, a slot of
#: GATEWAY_EXTRA_STRIDE per region (the region's first node's slot number), GATEWAY_STRIDE a node;
#: a cluster of more than 3 nodes a region makes the slots as wide as its extra nodes need
#: (gateway_extra_stride), up to the port block's end (GATEWAY_EXTRA_PORTS for all regions).
GATEWAY_EXTRA_OFFSET = 600
GATEWAY_EXTRA_STRIDE = 20
GATEWAY_EXTRA_PORTS = 400
ROUTER_OFFSETS = {"metrics": 30}
#: the DNS server devices resolve mqtt.<domain> at (infra/dns)
DNS_OFFSETS = {"dns": 8, "metrics": 5, "webserver": 6}
DNS_NODE = "dns"
#: the federation's Prometheus (infra/local/prometheus_node.py)
PROMETHEUS_OFFSETS = {"http": 9}
PROMETHEUS_NODE = "prometheus"
SPARK_OFFSETS = {"driver": 40, "block_manager": 41, "connect": 42, "metrics": 43}
SPARK_NODE = "spark"
BACKEND_NODE = "backend"
#: the router that routes commands (the others only bridge the uplink)
ROUTER_NODE = "router-0"
KAFKA_NODE = "kafka"
EPMD_NODE = "epmd"


@dataclass
class NodeSpec:
    """A node of the local federation as recorded in state/federation.json."""

    name: str
    role: str
    region: str | None
    ports: dict[str, int]
    #: an address of the node's own for what devices reach -- a gateway's MQTT listeners, like
    #: a host of its own -- or None: the federation's host (settings.host) for everything
    address: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "role": self.role, "region": self.region, "ports": self.ports}
        return {**out, "address": self.address} if self.address else out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeSpec:
        ports = {k: int(v) for k, v in d["ports"].items()}
        return cls(d["name"], d["role"], d.get("region"), ports, d.get("address"))

    def bind_address(self, port: str, host: str) -> str:
        """Where its `port` listens: the node's own address for MQTT, `host` for the rest."""
        return self.address if self.address and port in DEVICE_PORTS else host


#: The ports devices reach, on a gateway's own address.
DEVICE_PORTS = ("mqtt", "mqtts")


def gateway_address(block: str, slot: int, member: int) -> str:
    """Node `member` (1-based) of the gateways in region slot `slot` (0-based): 127.X.(slot+1).m."""
    return f"{block}.{slot + 1}.{member}"


def client_network(block: str, slot: int) -> str:
    """The network the devices of region slot `slot` ask DNS from: 127.X.(101+slot).0/24."""
    return f"{block}.{101 + slot}.0/24"


def client_network_of(gateway: NodeSpec, block: str, port_base: int) -> str:
    """The client network of the region whose first gateway node is `gateway`.

    Read from the node's recorded address (127.X.(slot+1).1 -> 127.X.(101+slot).0/24), so a
    command run with only the state folder named -- the port base and address block of its
    own settings the defaults -- still finds it; a node recorded before gateways had
    addresses of their own falls back to the layout's arithmetic on `block` and `port_base`.
    """
    if gateway.address:
        a, b, slot_plus_one, _ = gateway.address.split(".")
        return client_network(f"{a}.{b}", int(slot_plus_one) - 1)
    return client_network(block, gateway_slot(gateway, port_base))


def gateway_slot(spec: NodeSpec, port_base: int) -> int:
    """The region slot of a gateway node (its layout place, kept by its AMQP port)."""
    first = spec.ports["amqp"] - port_base - GATEWAY_OFFSETS["amqp"]
    if first >= GATEWAY_EXTRA_OFFSET:
        return (first - GATEWAY_EXTRA_OFFSET) // GATEWAY_EXTRA_STRIDE
    return (first - GATEWAY_BASE_OFFSET) // GATEWAY_STRIDE


def gateway_extra_stride(cluster_nodes: int) -> int:
    """Ports of one region's slot in the extra gateway nodes' block."""
    return max(GATEWAY_EXTRA_STRIDE, GATEWAY_STRIDE * (cluster_nodes - 1))


def ports_text(spec: NodeSpec) -> str:
    """A node's ports for messages: "amqp 5672, management 15672"."""
    return ", ".join(f"{k} {v}" for k, v in spec.ports.items())


def member_name(first: str, member: int) -> str:
    """Node `member` (1-based) of the cluster whose first node is `first`: the first keeps its
    single-profile name (backend, kafka), the others add their number (backend-2, kafka-3)."""
    return first if member == 1 else f"{first}-{member}"


def member_number(first: str, name: str) -> int:
    return 1 if name == first else int(name.rsplit("-", 1)[1])


def kafka_node_name(broker: int) -> str:
    """The node of Kafka broker `broker` (1-based; its KRaft node.id): kafka, kafka-2, ..."""
    return member_name(KAFKA_NODE, broker)


def kafka_broker_id(name: str) -> int:
    return member_number(KAFKA_NODE, name)


def gateway_node_name(region: str, member: int = 1) -> str:
    """Node `member` (1-based) of `region`'s gateway cluster: gw-local-eu, gw-local-eu-n2, ...
    ("-n": a region's own name may end in a number)."""
    first = "gw-" + c.validate_region(region)
    return first if member == 1 else f"{first}-n{member}"


def region_nodes(specs: Iterable[NodeSpec], role: str, region: str | None = None) -> list[NodeSpec]:
    """The nodes of one RabbitMQ cluster (the backend's, or a region's gateways), the first
    first: it is the one the cluster's definitions are applied through."""
    return sorted(
        (s for s in specs if s.role == role and s.region == region), key=lambda s: (len(s.name), s.name)
    )


def gateway_clusters(specs: Iterable[NodeSpec]) -> dict[str, list[NodeSpec]]:
    """Each region's gateway cluster (as region_nodes orders it), regions in the order met."""
    specs = list(specs)
    regions = dict.fromkeys(s.region for s in specs if s.role == ROLE_GATEWAY and s.region)
    return {r: region_nodes(specs, ROLE_GATEWAY, r) for r in regions}


class FederationError(FedgateError):
    """`up` could not bring the federation up; nothing it started is left running."""


def port_layout(settings: LocalSettings, recorded: dict[str, NodeSpec] | None = None) -> list[NodeSpec]:
    """Every node of the federation with its ports.

    Nodes already recorded in federation.json keep their ports (a region added
    later does not move the others); new ones get theirs from the layout;
    ``settings.ports`` pins any single port.
    """
    recorded = recorded or {}
    base = settings.port_base
    backends = sum(s.role == ROLE_BACKEND for s in recorded.values())
    if backends and backends != settings.backend_nodes:
        raise FederationError(
            f"this federation's backend has {backends} node(s) and the settings ask for "
            f"{settings.backend_nodes} (profile {settings.profile!r}); `fedgate down --purge` first "
            "to change the profile"
        )
    brokers = sum(s.role == ROLE_KAFKA for s in recorded.values())
    if brokers and brokers != settings.kafka_broker_count:
        raise FederationError(
            f"this federation runs {brokers} Kafka broker(s) and the settings ask for "
            f"{settings.kafka_broker_count} (profile {settings.profile!r}): a Kafka cluster does not "
            "grow or shrink here; `fedgate down --purge` first to change the profile"
        )

    def spec(
        name: str,
        role: str,
        region: str | None,
        offsets: dict[str, int],
        start: int,
        address: str | None = None,
        **fixed: int,
    ) -> NodeSpec:
        if name in recorded:
            address = recorded[name].address  # a node recorded without one keeps the host
        # a port kind added since the node was recorded (an upgrade) gets its layout place
        ports = {k: start + off for k, off in offsets.items()} | fixed
        if address is not None:  # a host of its own: the standard device ports
            ports.update(mqtt=settings.mqtt_port, mqtts=settings.mqtts_port)
        if name in recorded:
            ports.update(recorded[name].ports)
        for k in ports:
            pinned = settings.ports.get(f"{name}.{k}")
            if pinned:
                ports[k] = pinned
        return NodeSpec(name, role, region, ports, address)

    specs = [
        spec(EPMD_NODE, ROLE_EPMD, None, {"epmd": 0}, base + EPMD_OFFSET),
        spec(BACKEND_NODE, ROLE_BACKEND, None, BACKEND_OFFSETS, base),
    ]
    for i in range(2, settings.backend_nodes + 1):
        start = base + BACKEND_EXTRA_OFFSET + BACKEND_EXTRA_STRIDE * (i - 2) - BACKEND_OFFSETS["amqp"]
        specs.append(spec(member_name(BACKEND_NODE, i), ROLE_BACKEND, None, BACKEND_OFFSETS, start))
    gateways_recorded = {
        s.region: gateway_slot(s, base)
        for s in recorded.values()
        if s.role == ROLE_GATEWAY and s.name == gateway_node_name(s.region or "")
    }
    members = {
        s.region
        for s in recorded.values()
        if s.role == ROLE_GATEWAY and s.name != gateway_node_name(s.region or "")
    }
    if gateways_recorded and (len(members) > 0) != (settings.gateway_nodes > 1):
        raise FederationError(
            f"this federation's gateways run {'as clusters' if members else 'one node a region'} and the "
            f"settings ask for {settings.gateway_nodes} node(s) a region (profile {settings.profile!r}); "
            "`fedgate down --purge` first to change the profile"
        )
    used_slots = set(gateways_recorded.values())
    next_slot = 0
    # Gateways recorded but no longer configured stay part of the federation
    # until they are removed explicitly: `up` must never orphan a running node.
    extra = [r for r in gateways_recorded if r and r not in settings.regions]
    for region in [*settings.regions, *extra]:
        if region in gateways_recorded:
            slot = gateways_recorded[region]
        else:
            while next_slot in used_slots:
                next_slot += 1
            slot = next_slot
            used_slots.add(slot)
        start = base + GATEWAY_BASE_OFFSET + GATEWAY_STRIDE * slot
        block = settings.address_block
        first = gateway_address(block, slot, 1)
        specs.append(spec(gateway_node_name(region), ROLE_GATEWAY, region, GATEWAY_OFFSETS, start, first))
        for m in range(2, settings.gateway_nodes + 1):
            stride = gateway_extra_stride(settings.gateway_nodes)
            start = base + GATEWAY_EXTRA_OFFSET + stride * slot + GATEWAY_STRIDE * (m - 2)
            address = gateway_address(block, slot, m)
            specs.append(
                spec(gateway_node_name(region, m), ROLE_GATEWAY, region, GATEWAY_OFFSETS, start, address)
            )
    metrics = base + KAFKA_METRICS_OFFSET
    specs.append(spec(KAFKA_NODE, ROLE_KAFKA, None, KAFKA_OFFSETS, base, metrics=metrics))
    for i in range(2, settings.kafka_broker_count + 1):
        start = base + KAFKA_EXTRA_OFFSET + KAFKA_EXTRA_STRIDE * (i - 2) - KAFKA_OFFSETS["bootstrap"]
        specs.append(
            spec(kafka_node_name(i), ROLE_KAFKA, None, KAFKA_OFFSETS, start, metrics=metrics + i - 1)
        )
    for i in range(settings.routers):
        specs.append(spec(f"router-{i}", ROLE_ROUTER, None, ROUTER_OFFSETS, base + i))
    if settings.spark:
        specs.append(spec(SPARK_NODE, ROLE_SPARK, None, SPARK_OFFSETS, base))
    specs.append(spec(DNS_NODE, ROLE_DNS, None, DNS_OFFSETS, base))
    if settings.prometheus_scrape_interval_s:
        specs.append(spec(PROMETHEUS_NODE, ROLE_PROMETHEUS, None, PROMETHEUS_OFFSETS, base))

    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise FederationError(f"two nodes would be named {', '.join(twice)}: rename a region")
    seen: dict[tuple[str, int], str] = {}
    for s in specs:
        for k, p in s.ports.items():
            where = (s.bind_address(k, settings.host), p)
            if where in seen:
                raise FederationError(f"port {p} is given to both {seen[where]} and {s.name}.{k}")
            seen[where] = f"{s.name}.{k}"
    return specs


@dataclass(frozen=True)
class StateFiles:
    """The records of one state folder: federation.json, secrets.json, the Erlang nodes' home."""

    state_dir: Path

    @property
    def record_file(self) -> Path:
        return self.state_dir / "federation.json"

    @property
    def secrets_file(self) -> Path:
        return self.state_dir / "secrets.json"

    @property
    def warehouse(self) -> Path:
        """Where the Spark job keeps the analysts' tables (and its checkpoints)."""
        return self.state_dir / "warehouse"

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    def recorded(self) -> dict[str, NodeSpec]:
        """The nodes federation.json names ({} before the first `up`)."""
        try:
            data = json.loads(self.record_file.read_text())
        except FileNotFoundError:
            return {}
        return {n["name"]: NodeSpec.from_json(n) for n in data["nodes"]}

    def write_record(self, specs: list[NodeSpec], host: str) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "state_dir": str(self.state_dir),
            "host": host,
            "secrets_file": str(self.secrets_file),
            "nodes": [s.to_json() for s in specs],
        }
        tmp = self.record_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.record_file)

    def secrets(self, regions: Iterable[str]) -> dict[str, Any]:
        """Generated credentials, created once per state dir (one per gateway of `regions`)."""
        return SecretsFile(self.secrets_file).ensure(
            ("admin", "backend_link", "router", "erlang_cookie", "kafka_client"),
            {"gateways": regions},
        )

    def forget_gateway(self, region: str) -> None:
        """Drop a removed region's gateway password."""
        SecretsFile(self.secrets_file).forget(region, ("gateways",))

    def prepare_home(self, cookie: str) -> None:
        """HOME of the Erlang nodes, with the federation's cookie."""
        home = self.state_dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        path = home / ".erlang.cookie"
        if not path.exists():
            path.write_text(cookie)
            path.chmod(0o400)
