"""The router's typed settings, from a TOML file and FEDGATE_ROUTER_* variables.

Validated at start: a wrong value fails at once with the field's name.

Two kinds of field.  The *wiring* (metadata ``wiring``: where the backend,
Kafka and the gateways are, which router of how many this process is) is the
deployment's to fill in for each process.  Every other field is the router's
own behaviour (mapping rules, parking, limits): a deployment takes it from
its operator as one table and passes it through unchanged -- the local
federation's ``[router]`` table in fedgate.toml (``router_table`` reads and
checks it), rendered into each process's router.toml next to the wiring.

    # router.toml
    amqp_url = "amqp://fedgate-admin:...@127.0.0.1:17020/%2F"
    kafka_bootstrap = "127.0.0.1:17010"
    unknown_device = "broadcast"          # or "park"

    [gateways.local-eu]                   # management API of each region's gateway
    management_url = "http://127.0.0.1:17102"

    [[rules]]                             # first match wins
    pattern = "devices/{device}/{stream:telemetry|events|state|replies|acks}/..."
    topic = "telemetry.{stream}"
    key = "{device}"
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from backend import contract as c
from backend.kafka_security import KafkaSecurity, KafkaSecurityError
from backend.settings_layers import coerce, read_layers
from router.access import (
    GatewayAccess,
    ManagementAccess,
    RouterSettingsError,
    parse_gateways,
    parse_management,
)
from router.topics import DEFAULT_RULES, Rule, RuleError, kafka_topics, parse_rules


@dataclass(frozen=True)
class RouterSettings:
    amqp_url: str = field(
        metadata={"doc": "AMQP URL of the backend (the router's own user).", "wiring": True}
    )
    kafka_bootstrap: str = field(metadata={"doc": "Kafka bootstrap servers.", "wiring": True})
    # how the router's Kafka clients authenticate (backend/kafka_security.py)
    kafka_security_protocol: str = field(
        default="PLAINTEXT", metadata={"doc": "PLAINTEXT, SSL or SASL_SSL (MSK: SASL_SSL).", "wiring": True}
    )
    kafka_sasl_mechanism: str = field(
        default="SCRAM-SHA-512", metadata={"doc": "SCRAM-SHA-512 or SCRAM-SHA-256.", "wiring": True}
    )
    kafka_sasl_username: str = field(default="", metadata={"doc": "SCRAM user.", "wiring": True})
    kafka_sasl_password: str = field(default="", metadata={"doc": "SCRAM password.", "wiring": True})
    kafka_ca_file: str = field(
        default="", metadata={"doc": "PEM CA of the brokers (empty: the system's).", "wiring": True}
    )
    amqp_failover_urls: tuple[str, ...] = field(
        default=(),
        metadata={
            "doc": "AMQP URLs of the backend cluster's other nodes: the router moves to the next "
            "when its node dies.",
            "wiring": True,
        },
    )
    gateways: tuple[GatewayAccess, ...] = field(
        default=(),
        metadata={
            "doc": "Each region's gateway management API (presence rebuild, closing sessions).",
            "wiring": True,
        },
    )
    backend_management: ManagementAccess | None = field(
        default=None,
        metadata={
            "doc": "The backend cluster's management API (management_url, user, password): the "
            "leader watches its federation links (router/link_keeper.py).",
            "wiring": True,
        },
    )
    rules: tuple[Rule, ...] = field(
        default=DEFAULT_RULES,
        metadata={
            "doc": "MQTT topic -> Kafka topic/key rules, first match wins ([[rules]] tables of pattern, "
            "topic, key; they replace the default rule, so list it last to keep it; docs/router.md)."
        },
    )
    unknown_device: str = field(
        default="broadcast",
        metadata={
            "doc": "A command for a device never seen when no gateway answers whether it is registered "
            "(a registered one is parked, another dead-lettered): 'broadcast' to every region, or 'park'."
        },
    )
    park_ttl_s: float = field(
        default=3600.0, metadata={"doc": "How long a parked message waits for its device."}
    )
    ack_timeout_s: float = field(
        default=10.0,
        metadata={
            "doc": "A command sent to a device that subscribes at QoS 0 is sent again when it is not "
            "acknowledged (devices/<id>/acks) within this long, or at once on the device's next session."
        },
    )
    presence_reconcile_s: float = field(
        default=30.0,
        metadata={
            "doc": "Every this many seconds, each answering gateway's connection list is checked against "
            "presence: a session no event brought back (its gateway stopped answering for a while) is taken "
            "in and gets what waited for it; one no list shows any more is dropped.  0: never."
        },
    )
    link_repair_after_s: float = field(
        default=20.0,
        metadata={
            "doc": "A federation link absent from its cluster this long gets its policy applied anew, "
            "which starts it (RabbitMQ 4.0 can lose a link when its node dies after another restarted; "
            "router/link_keeper.py).  0: never."
        },
    )
    regions_poll_s: float = field(
        default=5.0,
        metadata={
            "doc": "How often the router reads the regions registered in the backend (needs "
            "backend_management; router/region_watch.py): a region joining or leaving reaches it "
            "within this.  0: only the config's [gateways]."
        },
    )
    max_payload_bytes: int = field(
        default=256 * 1024, metadata={"doc": "Uplink payloads above this are dead-lettered."}
    )
    command_prefetch: int = field(
        default=1000,
        metadata={
            "doc": "Commands (and acknowledgements) taken from the backend at once: commands that wait for "
            "Kafka (parked, desired state, tracked for a QoS 0 device) hold one each until Kafka confirms, "
            "so while Kafka is away, commands to connected devices flow until this many wait."
        },
    )
    max_inflight: int = field(
        default=2000, metadata={"doc": "Uplink messages on their way to Kafka at once (prefetch)."}
    )
    kafka_stall_s: float = field(
        default=120.0,
        metadata={
            "doc": "A producer whose oldest record waited this long for its delivery report while Kafka "
            "answers is stalled: /health fails and the router exits 1 for its supervisor to start a "
            "fresh one (its shards go to the other routers meanwhile).  0: off."
        },
    )
    kafka_linger_ms: int = field(
        default=5, metadata={"doc": "The producers' linger.ms: 5 for the gateways' batches, 25 unbatched."}
    )
    kafka_debug: str = field(
        default="",
        metadata={
            "doc": "librdkafka debug contexts of the router's producers (e.g. 'broker,topic,msg,eos'), "
            "written to the router's log: for a producer that stalls; empty: off."
        },
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
        default="127.0.0.1",
        metadata={"doc": "Address of the metrics/presence HTTP endpoint.", "wiring": True},
    )
    metrics_port: int = field(
        default=0,
        metadata={"doc": "Port of the metrics/presence HTTP endpoint (0: off).", "wiring": True},
    )
    router_id: str = field(
        default="router-0",
        metadata={"doc": "Name of this router process (queues, logs).", "wiring": True},
    )
    downlink: bool = field(
        default=True,
        metadata={
            "doc": "Whether this process stands for routing commands: of those that do, one "
            "leads and the others take over when it dies (router/leadership.py).",
            "wiring": True,
        },
    )
    uplink: bool = field(
        default=True,
        metadata={"doc": "Whether this process bridges telemetry to Kafka.", "wiring": True},
    )
    uplink_shards: int = field(
        default=c.UPLINK_SHARDS,
        metadata={"doc": "Uplink shard queues on the backend.", "wiring": True},
    )
    router_index: int = field(
        default=0, metadata={"doc": "This router's index among router_count.", "wiring": True}
    )
    router_count: int = field(
        default=1,
        metadata={
            "doc": "Routers sharing the uplink: router i reads the shards s with s % count == i while "
            "it runs, and stands by on the others (router/bridge.py).",
            "wiring": True,
        },
    )

    shard_owner: str = field(
        default="index",
        metadata={
            "doc": "How the routers share the uplink shards: 'index' (router_index of router_count "
            "reads the shards s with s % count == index) or 'rendezvous' (each shard goes to the "
            "running router whose hash of its router_id and the shard is highest: nothing to "
            "number, as for routers on an autoscaling group; router/shards.py).",
            "wiring": True,
        },
    )

    @property
    def my_shards(self) -> list[int]:
        """The shards this router reads while its peers run ('index'; 'rendezvous' decides
        among the running routers' priorities)."""
        return [s for s in range(self.uplink_shards) if s % self.router_count == self.router_index]

    @property
    def regions(self) -> list[str]:
        return [g.region for g in self.gateways]

    def kafka_topics(self) -> list[str]:
        """Every Kafka topic the bridge writes to (router.topics.kafka_topics): created at start,
        and exactly what the Spark job subscribes to."""
        return kafka_topics(self.rules, self.unmatched_topic, self.deadletter_topic)

    @property
    def kafka_security(self) -> KafkaSecurity:
        return KafkaSecurity.of(self)

    @property
    def kafka_client(self) -> dict[str, str]:
        """What every Kafka client of the router starts from: where Kafka is, how to log in."""
        return {"bootstrap.servers": self.kafka_bootstrap, **self.kafka_security.librdkafka()}

    @property
    def amqp_urls(self) -> tuple[str, ...]:
        """Every backend node's AMQP URL, amqp_url first."""
        return (self.amqp_url, *self.amqp_failover_urls)

    def validate(self) -> RouterSettings:
        for name, url in [
            ("amqp_url", self.amqp_url),
            *(("amqp_failover_urls", u) for u in self.amqp_failover_urls),
        ]:
            if not url.startswith(("amqp://", "amqps://")):
                raise RouterSettingsError(f"{name}: must start with amqp:// or amqps://, got {url!r}")
        if not self.kafka_bootstrap:
            raise RouterSettingsError("kafka_bootstrap: missing")
        try:
            self.kafka_security.validate()
        except KafkaSecurityError as e:
            raise RouterSettingsError(str(e)) from e
        if self.unknown_device not in ("broadcast", "park"):
            raise RouterSettingsError(f"unknown_device: 'broadcast' or 'park', got {self.unknown_device!r}")
        if self.shard_owner not in ("index", "rendezvous"):
            raise RouterSettingsError(f"shard_owner: 'index' or 'rendezvous', got {self.shard_owner!r}")
        if not 0 <= self.router_index < self.router_count:
            raise RouterSettingsError(f"router_index: {self.router_index} not in 0..{self.router_count - 1}")
        if self.router_count > self.uplink_shards:
            raise RouterSettingsError(
                f"router_count: {self.router_count} routers cannot share {self.uplink_shards} shards"
            )
        for name in (
            "park_ttl_s",
            "ack_timeout_s",
            "max_payload_bytes",
            "max_inflight",
            "command_prefetch",
            "kafka_partitions",
            "kafka_replication",
        ):
            if getattr(self, name) <= 0:
                raise RouterSettingsError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("link_repair_after_s", "presence_reconcile_s", "regions_poll_s", "kafka_stall_s"):
            if getattr(self, name) < 0:
                raise RouterSettingsError(f"{name}: must be 0 (off) or positive, got {getattr(self, name)}")
        if self.kafka_linger_ms < 0:
            raise RouterSettingsError(f"kafka_linger_ms: must be 0 or positive, got {self.kafka_linger_ms}")
        if not 0 <= self.metrics_port <= 65535:
            raise RouterSettingsError(f"metrics_port: {self.metrics_port} is not a TCP port")
        return self


#: The router's own behaviour: every field but the wiring (the [router] table's keys).
BEHAVIOUR = tuple(f.name for f in fields(RouterSettings) if not f.metadata.get("wiring"))
#: Every field's type, as the layers' coercion names it.
_KINDS = {f.name: str(f.type) for f in fields(RouterSettings)}
#: Tables: only a config file can hold them, not a FEDGATE_ROUTER_* variable.
_TABLES = ("gateways", "backend_management", "rules")
_ENV_PREFIX = "FEDGATE_ROUTER_"
#: The one part of a table a variable may set: the backend management password, so that a
#: deployment keeps it out of the config file (the cloud's comes from Secrets Manager).
BACKEND_MANAGEMENT_PASSWORD_ENV = f"{_ENV_PREFIX}BACKEND_MANAGEMENT_PASSWORD"
#: What the wiring gets while a [router] table is checked on its own.
_STAND_IN_WIRING = {"amqp_url": "amqp://stand-in", "kafka_bootstrap": "stand-in:0"}


def load_router_settings(path: Path | None = None, env: Mapping[str, str] | None = None) -> RouterSettings:
    """The settings of one router process: its router.toml, then FEDGATE_ROUTER_<NAME> variables."""
    values = read_layers(
        _KINDS,
        path=path,
        env=os.environ if env is None else env,
        env_prefix=_ENV_PREFIX,
        error=RouterSettingsError,
        skip_env=_TABLES,
    )
    password = (os.environ if env is None else env).get(BACKEND_MANAGEMENT_PASSWORD_ENV)
    if password and isinstance(values.get("backend_management"), dict):
        values["backend_management"] = {**values["backend_management"], "password": password}
    return _settings(values)


def router_table(table: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A deployment's table of router settings (the local federation's [router]) with the
    FEDGATE_ROUTER_<NAME> variables in `env` over its scalar fields, checked as the router
    checks its settings at start: a wrong value raises RouterSettingsError naming the field.

    What it returns is the table to hand to every router process unchanged; nothing in it is
    defaulted (a field it lacks keeps the router's own default).  Wiring fields have no place
    in it: the deployment fills them in for each process.
    """
    for key in table:
        if key not in BEHAVIOUR:
            if key in {f.name for f in fields(RouterSettings)}:
                raise RouterSettingsError(
                    f"{key}: set by the deployment for each router process, not in the router table"
                )
            raise RouterSettingsError(f"unknown setting {key!r}")
    from_env = read_layers(
        BEHAVIOUR,
        path=None,
        env=os.environ if env is None else env,
        env_prefix=_ENV_PREFIX,
        error=RouterSettingsError,
        skip_env=_TABLES,
    )
    out = {**table, **{k: coerce(k, _KINDS[k], raw, RouterSettingsError) for k, raw in from_env.items()}}
    check_router_table(out)
    return out


def check_router_table(table: Mapping[str, Any]) -> RouterSettings:
    """The router settings `table` gives, checked (RouterSettingsError names the field); its
    wiring fields hold stand-ins: read only the table's own (rules, topics, limits)."""
    return _settings({**dict(table), **_STAND_IN_WIRING})


def _settings(values: dict[str, Any]) -> RouterSettings:
    try:
        if "rules" in values:
            values["rules"] = parse_rules(values["rules"])
    except RuleError as e:
        raise RouterSettingsError(f"rules: {e}") from e
    except (TypeError, AttributeError) as e:
        raise RouterSettingsError(f"rules: a list of tables with pattern, topic and key ({e})") from e
    if "gateways" in values:
        values["gateways"] = parse_gateways(values["gateways"])
    if "backend_management" in values:
        values["backend_management"] = parse_management(values["backend_management"])
    for key, kind in _KINDS.items():
        if key in values and kind in ("int", "float", "bool", "tuple[str, ...]"):
            values[key] = coerce(key, kind, values[key], RouterSettingsError)
    for required in ("amqp_url", "kafka_bootstrap"):
        if required not in values:
            raise RouterSettingsError(f"{required}: missing (config file or {_ENV_PREFIX}{required.upper()})")
    return RouterSettings(**values).validate()


def describe() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) of the router's own settings (BEHAVIOUR), for `fedgate settings`."""
    out = []
    for f in fields(RouterSettings):
        if f.name not in BEHAVIOUR:
            continue
        default = f.default if f.default is not MISSING else "(required)"
        if f.name == "rules":
            name = "[[router.rules]]"
            default = "; ".join(f"{r.pattern} -> {r.topic}" for r in DEFAULT_RULES)
        else:
            name = _ENV_PREFIX + f.name.upper()
        out.append((name, str(default), f.metadata.get("doc", "")))
    return out
