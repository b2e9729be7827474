"""The router's typed settings, from a TOML file and FEDGATE_ROUTER_* variables.

Validated at start: a wrong value fails at once with the field's name.

    # router.toml
    amqp_url = "amqp://fedgate-admin:...@127.0.0.1:17020/%2F"
    kafka_bootstrap = "127.0.0.1:17010"
    unknown_device = "broadcast"          # or "park"

    [gateways.local-eu]                   # management API of each region's gateway
    management_url = "http://127.0.0.1:17102"

    [[rules]]                             # first match wins
    pattern = "devices/{device}/{stream:telemetry|events|state}/..."
    topic = "telemetry.{stream}"
    key = "{device}"
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from backend import contract as c
from backend.errors import FedgateError
from backend.settings_layers import coerce, read_layers
from router.topics import DEFAULT_RULES, Rule, RuleError, parse_rules


class RouterSettingsError(FedgateError, ValueError):
    pass


@dataclass(frozen=True)
class GatewayAccess:
    region: str
    management_url: str
    user: str
    password: str


@dataclass(frozen=True)
class RouterSettings:
    amqp_url: str = field(metadata={"doc": "AMQP URL of the backend (the router's own user)."})
    kafka_bootstrap: str = field(metadata={"doc": "Kafka bootstrap servers."})
    gateways: tuple[GatewayAccess, ...] = field(
        default=(),
        metadata={"doc": "Each region's gateway management API (presence rebuild, closing sessions)."},
    )
    rules: tuple[Rule, ...] = field(
        default=DEFAULT_RULES, metadata={"doc": "MQTT topic -> Kafka topic/key rules."}
    )
    unknown_device: str = field(
        default="broadcast",
        metadata={"doc": "A command for a device never seen: 'broadcast' to every region, or 'park'."},
    )
    park_ttl_s: float = field(
        default=3600.0, metadata={"doc": "How long a parked message waits for its device."}
    )
    max_payload_bytes: int = field(
        default=256 * 1024, metadata={"doc": "Uplink payloads above this are dead-lettered."}
    )
    max_inflight: int = field(
        default=2000, metadata={"doc": "Uplink messages on their way to Kafka at once (prefetch)."}
    )
    kafka_partitions: int = field(default=6, metadata={"doc": "Partitions of the topics the router creates."})
    kafka_replication: int = field(
        default=1, metadata={"doc": "Replication factor of the topics the router creates."}
    )
    unmatched_topic: str = field(default=c.KAFKA_UNMATCHED_TOPIC, metadata={"doc": "Catch-all Kafka topic."})
    deadletter_topic: str = field(
        default=c.KAFKA_DEADLETTER_TOPIC, metadata={"doc": "Dead-letter Kafka topic."}
    )
    metrics_host: str = field(
        default="127.0.0.1", metadata={"doc": "Address of the metrics/presence HTTP endpoint."}
    )
    metrics_port: int = field(
        default=0, metadata={"doc": "Port of the metrics/presence HTTP endpoint (0: off)."}
    )
    router_id: str = field(
        default="router-0", metadata={"doc": "Name of this router process (queues, logs)."}
    )
    downlink: bool = field(
        default=True,
        metadata={"doc": "Whether this process routes commands (one router does; others bridge)."},
    )
    uplink: bool = field(default=True, metadata={"doc": "Whether this process bridges telemetry to Kafka."})
    uplink_shards: int = field(
        default=c.UPLINK_SHARDS, metadata={"doc": "Uplink shard queues on the backend."}
    )
    router_index: int = field(default=0, metadata={"doc": "This router's index among router_count."})
    router_count: int = field(
        default=1,
        metadata={"doc": "Routers sharing the uplink: router i reads the shards s with s % count == i."},
    )

    @property
    def my_shards(self) -> list[int]:
        return [s for s in range(self.uplink_shards) if s % self.router_count == self.router_index]

    @property
    def regions(self) -> list[str]:
        return [g.region for g in self.gateways]

    def validate(self) -> RouterSettings:
        if not self.amqp_url.startswith(("amqp://", "amqps://")):
            raise RouterSettingsError(f"amqp_url: must start with amqp:// or amqps://, got {self.amqp_url!r}")
        if not self.kafka_bootstrap:
            raise RouterSettingsError("kafka_bootstrap: missing")
        if self.unknown_device not in ("broadcast", "park"):
            raise RouterSettingsError(f"unknown_device: 'broadcast' or 'park', got {self.unknown_device!r}")
        if not 0 <= self.router_index < self.router_count:
            raise RouterSettingsError(f"router_index: {self.router_index} not in 0..{self.router_count - 1}")
        if self.router_count > self.uplink_shards:
            raise RouterSettingsError(
                f"router_count: {self.router_count} routers cannot share {self.uplink_shards} shards"
            )
        for name in (
            "park_ttl_s",
            "max_payload_bytes",
            "max_inflight",
            "kafka_partitions",
            "kafka_replication",
        ):
            if getattr(self, name) <= 0:
                raise RouterSettingsError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0 <= self.metrics_port <= 65535:
            raise RouterSettingsError(f"metrics_port: {self.metrics_port} is not a TCP port")
        for g in self.gateways:
            try:
                c.validate_region(g.region)
            except c.InvalidRegionError as e:
                raise RouterSettingsError(f"gateways: {e}") from e
        return self


def load_router_settings(path: Path | None = None, env: dict[str, str] | None = None) -> RouterSettings:
    known = {f.name: str(f.type) for f in fields(RouterSettings)}
    values = read_layers(
        known,
        path=path,
        env=os.environ if env is None else env,
        env_prefix="FEDGATE_ROUTER_",
        error=RouterSettingsError,
        skip_env=("gateways", "rules"),  # tables: only a config file can hold them
    )
    try:
        if "rules" in values:
            values["rules"] = parse_rules(values["rules"])
    except RuleError as e:
        raise RouterSettingsError(f"rules: {e}") from e
    if "gateways" in values:
        gws = values["gateways"]
        try:
            values["gateways"] = tuple(
                GatewayAccess(region, g["management_url"], g.get("user", c.ADMIN_USER), g.get("password", ""))
                for region, g in gws.items()
            )
        except (KeyError, AttributeError, TypeError) as e:
            raise RouterSettingsError(f"gateways: each needs management_url ({e})") from e
    for key, kind in known.items():
        if key in values and kind in ("int", "float", "bool"):
            values[key] = coerce(key, kind, values[key], RouterSettingsError)
    for required in ("amqp_url", "kafka_bootstrap"):
        if required not in values:
            raise RouterSettingsError(
                f"{required}: missing (config file or FEDGATE_ROUTER_{required.upper()})"
            )
    return RouterSettings(**values).validate()
