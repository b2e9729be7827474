"""The fleet's devices on the local gateways: add, revoke, sync device users.

The registry file (infra/device_registry.py) is the truth; these functions
bring every running local gateway in line with it.  A gateway that is not
running gets the whole registry when it is next wired (wiring.py).  Apart
from the façade because the same three operations exist for cloud regions,
which reach their gateways differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from backend.devices import device_users
from infra.device_registry import DeviceRegistry, apply_to_gateway, sync_gateway
from infra.local.nodes import RabbitNode

Gateways = Callable[[], list[RabbitNode]]


def add_devices(
    registry: DeviceRegistry, gateways: Gateways, ids: Iterable[str], *, rotate: bool = False
) -> dict[str, str]:
    """Register devices and make them users of every running gateway; returns their secrets.

    A gateway started later gets them when it is wired.
    """
    issued = registry.add(ids, rotate=rotate)
    hashes = registry.hashes()
    fleet = device_users({d: hashes[d] for d in issued})
    for gw in gateways():
        if gw.is_running():
            apply_to_gateway(gw.admin(), fleet, [])
    return issued


def revoke_devices(registry: DeviceRegistry, gateways: Gateways, ids: Iterable[str]) -> dict[str, int]:
    """Forget devices, delete their users on every running gateway and close their
    connections; returns the connections closed per device."""
    gone = registry.revoke(list(ids))
    closed = dict.fromkeys(gone, 0)
    for gw in gateways():
        if gw.is_running():
            for d, n in apply_to_gateway(gw.admin(), None, gone).items():
                closed[d] += n
    return closed


def sync_devices(registry: DeviceRegistry, gateways: Gateways) -> dict[str, list[str]]:
    """Make every running gateway's device users exactly the registry's; returns the
    device users removed per region (revoked while that gateway was down)."""
    hashes = registry.hashes()
    return {
        gw.spec.region or gw.name: sync_gateway(gw.admin(), hashes) for gw in gateways() if gw.is_running()
    }
