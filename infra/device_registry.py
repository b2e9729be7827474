"""The fleet's devices and their secrets' hashes, in a file only its owner can read.

    registry = DeviceRegistry(state_dir / "devices.json")
    secrets = registry.add(["pump-1", "pump-2"])   # {id: secret}, shown once
    definitions = device_users(registry.hashes())  # for every gateway

What a device id may be and what each device may do: backend/devices.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend import contract as c
from backend.definitions import NodeDefinitions
from backend.devices import (
    PUBLISH_PATTERN,
    DeviceRegistryError,
    device_users,
    new_secret,
    password_hash,
    validate_device_id,
)
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from infra.secrets_file import write_private_json


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
        write_private_json(self.path, {"devices": dict(sorted(devices.items()))})

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


#: How long a gateway's management API may take to answer before a device update
#: gives that gateway up (`fedgate devices sync` repairs it later).  Without this
#: check a node that runs but does not answer (stopped, hung) would hold the
#: definitions import for its whole timeout (RabbitAdmin.IMPORT_TIMEOUT_S).
ANSWER_TIMEOUT_S = 5.0


def check_answers(admin: RabbitAdmin, timeout: float | None = None) -> None:
    """Raise AdminError (retriable) unless the management API answers within `timeout`
    (default ANSWER_TIMEOUT_S)."""
    try:
        admin.request("GET", "whoami", timeout=timeout or ANSWER_TIMEOUT_S)
    except AdminError as e:
        raise AdminError(
            f"its management API at {admin.base_url} does not answer ({e})",
            retriable=e.retriable,
            status=e.status,
        ) from e


def apply_to_gateway(
    admin: RabbitAdmin, added: NodeDefinitions | None, revoked: Iterable[str]
) -> dict[str, int]:
    """New or re-keyed device users in one request, then revoked ones deleted with their
    connections closed; returns the connections closed per revoked device.

    A gateway whose management API does not answer fails fast (check_answers).
    """
    check_answers(admin)
    if added is not None and added.users:
        admin.import_users(added)
    return {device: admin.remove_user(device, "device revoked") for device in revoked}


def sync_gateway(admin: RabbitAdmin, hashes: Mapping[str, str]) -> list[str]:
    """Make a gateway's device users exactly the registry's; returns the ones removed.

    Every registered device is added or updated in one request.  A device
    user the registry no longer has (revoked while this gateway could not be
    reached) is deleted and its connections closed.  Device users are told
    apart from fedgate's own by their topic permission.
    """
    check_answers(admin)
    if hashes:
        admin.import_users(device_users(hashes))
    stale = sorted(admin.users_with_topic_write(c.MQTT_EXCHANGE, PUBLISH_PATTERN) - set(hashes))
    for device in stale:
        admin.remove_user(device, "device revoked")
    return stale


@dataclass
class DeviceUpdate:
    """What a device push or sync did on one driver's running gateways."""

    #: revoked device -> its connections the gateways listed and closed
    closed: dict[str, int] = field(default_factory=dict)
    #: region -> device users a sync removed (revoked while that gateway was unreachable)
    removed: dict[str, list[str]] = field(default_factory=dict)
    #: region -> why its gateways were not updated; `fedgate devices sync` repairs them
    failed: dict[str, str] = field(default_factory=dict)


#: (region, gateway name, its management API) of each gateway to update
GatewayTarget = tuple[str, str, RabbitAdmin]


def push_to_gateways(
    gateways: Iterable[GatewayTarget], added: NodeDefinitions | None, revoked: list[str]
) -> DeviceUpdate:
    """New device users onto each gateway, revoked ones off it (their connections closed);
    a gateway that does not answer is named in `failed`, and the others still get the change."""
    update = DeviceUpdate(closed=dict.fromkeys(revoked, 0))
    for region, gateway, admin in gateways:
        try:
            closed = apply_to_gateway(admin, added, revoked)
        except AdminError as e:
            update.failed[region] = f"gateway {gateway}: {e}"
            continue
        for device, n in closed.items():
            update.closed[device] += n
    return update


def sync_gateways(gateways: Iterable[GatewayTarget], hashes: Mapping[str, str]) -> DeviceUpdate:
    """Each gateway's device users made exactly the registry's; failures named as in push."""
    update = DeviceUpdate()
    for region, gateway, admin in gateways:
        try:
            update.removed[region] = sync_gateway(admin, hashes)
        except AdminError as e:
            update.failed[region] = f"gateway {gateway}: {e}"
    return update
