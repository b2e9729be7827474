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

    registry = DeviceRegistry(state_dir / "devices.json")
    secrets = registry.add(["pump-1", "pump-2"])   # {id: secret}, shown once
    definitions = device_users(registry.hashes())  # for every gateway
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from backend import contract as c
from backend.definitions import NodeDefinitions, Permission, TopicPermission, User

#: Device ids: they are MQTT user names and topic segments, and RabbitMQ
#: puts them into the topic regexes as they are, so no regex characters.
DEVICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

#: Reserved for fedgate's own users on the gateways.
RESERVED = frozenset({c.ADMIN_USER, c.BACKEND_LINK_USER, c.DEVICE_USER, "guest"})

#: Topic authorisation on the MQTT exchange, over AMQP routing keys (MQTT '/' is '.').
PUBLISH_PATTERN = r"^devices\.{username}\."
SUBSCRIBE_PATTERN = r"^devices\.{username}\.commands\."


class DeviceRegistryError(ValueError):
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


def device_users(hashes: Mapping[str, str], cluster_name: str = "") -> NodeDefinitions:
    """The users, permissions and topic permissions of these devices, for any gateway."""
    d = NodeDefinitions(cluster_name=cluster_name)
    mqtt_x = re.escape(c.MQTT_EXCHANGE)
    for device, h in sorted(hashes.items()):
        d.users.append(User(device, "", password_hash=h))
        # The MQTT plugin declares mqtt-subscription-<client id>qos<n> queues
        # and publishes to amq.topic; the topic permissions narrow both.
        d.permissions.append(
            Permission(
                device,
                configure="^mqtt-subscription-.*$",
                write=f"^({mqtt_x}|mqtt-subscription-.*)$",
                read=f"^({mqtt_x}|mqtt-subscription-.*)$",
            )
        )
        d.topic_permissions.append(
            TopicPermission(device, c.MQTT_EXCHANGE, write=PUBLISH_PATTERN, read=SUBSCRIBE_PATTERN)
        )
    return d


class DeviceRegistry:
    """The fleet's devices and their secrets' hashes, in a file only its owner can read."""

    def __init__(self, path: Path):
        self.path = path

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as e:
            raise DeviceRegistryError(f"{self.path}: not valid JSON ({e})") from e
        return dict(data.get("devices", {}))

    def _write(self, devices: Mapping[str, dict[str, Any]]) -> None:
        # owner-only, replaced in one step: a reader never sees half a registry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"devices": dict(sorted(devices.items()))}, indent=1))
        tmp.chmod(0o600)
        tmp.replace(self.path)

    def devices(self) -> dict[str, dict[str, Any]]:
        """id -> {"password_hash", "added_ms"}."""
        return self._read()

    def hashes(self) -> dict[str, str]:
        return {d: e["password_hash"] for d, e in self._read().items()}

    def add(self, ids: Iterable[str], *, rotate: bool = False) -> dict[str, str]:
        """Issue a secret to each new device (to each listed one with `rotate`); returns them.

        The secrets are returned once and never stored.
        """
        ids = [validate_device_id(d) for d in ids]
        devices = self._read()
        if not rotate:
            known = sorted(d for d in ids if d in devices)
            if known:
                raise DeviceRegistryError(
                    f"already registered: {', '.join(known[:5])}{' ...' if len(known) > 5 else ''} "
                    "(use --rotate to issue a new secret)"
                )
        issued = {}
        now = int(time.time() * 1000)
        for d in ids:
            issued[d] = new_secret()
            devices[d] = {"password_hash": password_hash(issued[d]), "added_ms": now}
        self._write(devices)
        return issued

    def revoke(self, ids: Iterable[str]) -> list[str]:
        """Forget these devices; returns those that were registered."""
        devices = self._read()
        gone = [d for d in ids if devices.pop(d, None) is not None]
        self._write(devices)
        return gone
