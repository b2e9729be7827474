"""Declarative RabbitMQ objects: what a node must hold, as plain data.

The federation wiring (backend/wiring.py, gateways/wiring.py) returns these;
an applier (backend/rabbitmq_admin.py) makes a live node match them through the
management API.  Keeping the wiring as data lets the local driver and the
cloud driver share it and lets unit tests check it without a broker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class User:
    """A user; with `password_hash` (RabbitMQ's salted SHA-256 form) the password is never sent."""

    name: str
    password: str
    tags: tuple[str, ...] = ()
    password_hash: str = ""


@dataclass(frozen=True)
class Permission:
    """Regexes over resource names, as RabbitMQ's configure/write/read."""

    user: str
    configure: str
    write: str
    read: str


@dataclass(frozen=True)
class TopicPermission:
    """Regexes over routing keys a user may publish (write) and bind/subscribe (read) on an
    exchange; RabbitMQ expands {username} in them."""

    user: str
    exchange: str
    write: str
    read: str


@dataclass(frozen=True)
class Exchange:
    name: str
    type: str = "topic"
    durable: bool = True
    internal: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Queue:
    name: str
    durable: bool = True
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Binding:
    source: str
    destination: str
    destination_type: str  # "queue" or "exchange"
    routing_key: str


@dataclass(frozen=True)
class Parameter:
    """A runtime parameter, e.g. a federation upstream or upstream set."""

    component: str
    name: str
    value: Any


@dataclass(frozen=True)
class Policy:
    name: str
    pattern: str
    apply_to: str
    definition: dict[str, Any]
    priority: int = 0


@dataclass
class NodeDefinitions:
    """Everything fedgate declares on one node (vhost "/")."""

    cluster_name: str
    users: list[User] = field(default_factory=list)
    permissions: list[Permission] = field(default_factory=list)
    topic_permissions: list[TopicPermission] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    queues: list[Queue] = field(default_factory=list)
    bindings: list[Binding] = field(default_factory=list)
    parameters: list[Parameter] = field(default_factory=list)
    policies: list[Policy] = field(default_factory=list)
