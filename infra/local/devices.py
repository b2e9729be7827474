"""The fleet's devices on the local gateways: add, revoke, sync device users.

The registry file (infra/device_registry.py) is the truth; these functions
bring every running local gateway in line with it.  A gateway that is not
running gets the whole registry when it is next wired (wiring.py).  Apart
from the façade because the same three operations exist for cloud regions,
which reach their gateways differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from backend.devices import device_users
from infra.device_registry import (
    DeviceRegistry,
    DeviceUpdate,
    GatewayTarget,
    push_to_gateways,
    sync_gateways,
)
from infra.local.layout import FederationError
from infra.local.nodes import RabbitNode

Gateways = Callable[[], list[RabbitNode]]


def running(gateways: Gateways) -> Iterator[GatewayTarget]:
    """(region, node, management API) of one running gateway node of each region: a
    cluster's nodes share their users (and its management API lists and closes the
    connections of all of them), so each change is made once a region, not once a node; a
    region with no node running gets the whole registry when it is next wired."""
    regions: set[str] = set()
    for gw in gateways():
        region = gw.spec.region or gw.name
        if region not in regions and gw.is_running():
            regions.add(region)
            yield region, gw.name, gw.admin()


def _raise_failed(update: DeviceUpdate, done: str) -> None:
    if update.failed:
        why = "; ".join(f"{region}: {reason}" for region, reason in sorted(update.failed.items()))
        raise FederationError(f"{done}, but not on every gateway ({why}); run `fedgate devices sync`")


def add_devices(
    registry: DeviceRegistry, gateways: Gateways, ids: Iterable[str], *, rotate: bool = False
) -> dict[str, str]:
    """Register devices and make them users of every running gateway; returns their secrets.

    FederationError (after registering) when a gateway did not take them.
    """
    issued = registry.add(ids, rotate=rotate)
    hashes = registry.hashes()
    update = push_to_gateways(running(gateways), device_users({d: hashes[d] for d in issued}), [])
    _raise_failed(update, f"registered {len(issued)} device(s)")
    return issued


def revoke_devices(registry: DeviceRegistry, gateways: Gateways, ids: Iterable[str]) -> dict[str, int]:
    """Forget devices, delete their users on every running gateway and close their
    connections; returns the connections closed per device."""
    update = push_to_gateways(running(gateways), None, registry.revoke(list(ids)))
    _raise_failed(update, f"revoked {len(update.closed)} device(s)")
    return update.closed


def sync_devices(registry: DeviceRegistry, gateways: Gateways) -> dict[str, list[str]]:
    """Make every running gateway's device users exactly the registry's; returns the
    device users removed per region (revoked while that gateway was down)."""
    update = sync_gateways(running(gateways), registry.hashes())
    _raise_failed(update, "synced")
    return update.removed
