"""Where a router reaches the management APIs: each region's gateways, the backend.

A `[gateways.<region>]` table comes from the router's config or from the
backend's region registry (router/region_watch.py); both are read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend import contract as c
from backend.errors import FedgateError


class RouterSettingsError(FedgateError, ValueError):
    pass


def _urls(value: object) -> tuple[str, ...]:
    """A management_url: one URL, or a list of the cluster nodes' URLs."""
    urls = (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"not a URL or a list of URLs: {value!r}")
    return urls


@dataclass(frozen=True)
class GatewayAccess:
    region: str
    #: the management API of every node of the region's gateway cluster (any one answers for all)
    management_urls: tuple[str, ...]
    user: str
    password: str


@dataclass(frozen=True)
class ManagementAccess:
    """A cluster's management API: every node's URL (any one answers for all)."""

    management_urls: tuple[str, ...]
    user: str
    password: str


def parse_gateways(tables: Mapping[str, Any]) -> tuple[GatewayAccess, ...]:
    """`[gateways.<region>]` tables (a config's, or the backend's registry's) -> GatewayAccess."""
    try:
        return tuple(
            GatewayAccess(
                c.validate_region(region),
                _urls(g["management_url"]),
                g.get("user", c.ADMIN_USER),
                g.get("password", ""),
            )
            for region, g in tables.items()
        )
    except c.InvalidRegionError as e:
        raise RouterSettingsError(f"gateways: {e}") from e
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise RouterSettingsError(
            f"gateways: each needs management_url, a URL or a list of its nodes' ({e})"
        ) from e


def parse_management(table: Mapping[str, Any]) -> ManagementAccess:
    """The `backend_management` table -> ManagementAccess."""
    try:
        return ManagementAccess(
            _urls(table["management_url"]), table.get("user", c.ADMIN_USER), table.get("password", "")
        )
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise RouterSettingsError(
            f"backend_management: needs management_url, a URL or a list of the nodes' ({e})"
        ) from e
