"""Who a device is and what it may do on a gateway.

Every device has its own MQTT user, named by its device id, with a secret
issued once by `fedgate devices add` and stored only as a hash: the registry
file and every gateway keep RabbitMQ's salted SHA-256 of it, never the
secret.  A device may

  publish   only under devices/<its id>/...
  subscribe only to   devices/<its id>/commands/...

which RabbitMQ's topic authorisation enforces on the MQTT exchange, with
{username} expanded per connection.  A refused publish or subscribe closes
the device's connection and is logged by the gateway ("access refused").
Its session queues are its own alone, and the gateway's authentication
refuses a CONNECT with another device's client id (gateways/mqtt_auth_plugin).

The registry of a fleet's devices (a file) is infra/device_registry.py.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
from collections.abc import Mapping

from backend import contract as c
from backend.definitions import NodeDefinitions, Permission, TopicPermission, User
from backend.errors import FedgateError

#: Device ids: they are MQTT user names and topic segments, and RabbitMQ
#: puts them into the topic regexes as they are, so no regex characters.
DEVICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

#: Reserved for fedgate's own users on the gateways.
RESERVED = c.SERVICE_USERS

#: Topic authorisation on the MQTT exchange, over AMQP routing keys (MQTT '/' is '.').
PUBLISH_PATTERN = r"^devices\.{username}\."
SUBSCRIBE_PATTERN = r"^devices\.{username}\.commands\."


class DeviceRegistryError(FedgateError, ValueError):
    pass


def validate_device_id(device: str) -> str:
    if not DEVICE_ID.match(device):
        raise DeviceRegistryError(
            f"device id {device!r}: 1-64 letters, digits, '-' or '_', starting with a letter or digit"
        )
    if device in RESERVED:
        raise DeviceRegistryError(f"device id {device!r} is reserved")
    return device


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def password_hash(secret: str, salt: bytes | None = None) -> str:
    """RabbitMQ's rabbit_password_hashing_sha256 form: base64(salt + sha256(salt + secret))."""
    salt = os.urandom(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + secret.encode()).digest()).decode()


def verify(secret: str, stored_hash: str) -> bool:
    raw = base64.b64decode(stored_hash)
    return secrets.compare_digest(password_hash(secret, raw[:4]), stored_hash)


def session_queues_pattern(device: str) -> str:
    """A regex (unanchored) of the queues RabbitMQ's MQTT plugin keeps for a device's session."""
    own = re.escape(device)
    return f"mqtt-(subscription-{own}qos[01]|will-{own})"


def device_users(hashes: Mapping[str, str], cluster_name: str = "") -> NodeDefinitions:
    """The users, permissions and topic permissions of these devices, for any gateway."""
    d = NodeDefinitions(cluster_name=cluster_name)
    mqtt_x = re.escape(c.MQTT_EXCHANGE)
    for device, h in sorted(hashes.items()):
        d.users.append(User(device, "", password_hash=h))
        # The MQTT plugin declares the session queues mqtt-subscription-<client id>qos<0|1>
        # (and an MQTT 5 will's mqtt-will-<client id>) and publishes to amq.topic; the
        # topic permissions narrow the latter.  A device's own queues only: another's
        # session could otherwise be resumed (read) or deleted (configure) by a device
        # that claims its client id (which the gateway's authentication refuses first).
        own = session_queues_pattern(device)
        d.permissions.append(
            Permission(device, configure=f"^{own}$", write=f"^({mqtt_x}|{own})$", read=f"^({mqtt_x}|{own})$")
        )
        d.topic_permissions.append(
            TopicPermission(device, c.MQTT_EXCHANGE, write=PUBLISH_PATTERN, read=SUBSCRIBE_PATTERN)
        )
    return d
