"""Where a router reaches the management APIs: each region's gateways, the backend.

A `[gateways.<region>]` table comes from the router's config or from the
backend's region registry (router/region_watch.py); both are read here.  Its
keys: management_url (a URL, or every node's), user, password, and for an
https URL the nodes' CA (ca_file, or ca_pem: the PEM itself) and the name their
certificates carry (server_name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend import contract as c
from backend.errors import FedgateError
from backend.rabbitmq_admin import RabbitAdmin


class RouterSettingsError(FedgateError, ValueError):
    pass


def _urls(value: object) -> tuple[str, ...]:
    """A management_url: one URL, or a list of the cluster nodes' URLs."""
    urls = (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"not a URL or a list of URLs: {value!r}")
    return urls


@dataclass(frozen=True)
class Tls:
    """How an https management_url's certificate is checked: against the nodes' CA (a file, or
    the PEM itself, as the backend's region registry carries it), for the name the nodes'
    certificates carry (`server_name`; empty: the URL's host)."""

    ca_file: str = ""
    ca_pem: str = ""
    server_name: str = ""

    @classmethod
    def of(cls, table: Mapping[str, Any]) -> Tls:
        fields = {k: table.get(k, "") for k in ("ca_file", "ca_pem", "server_name")}
        if not all(isinstance(v, str) for v in fields.values()):
            raise ValueError(f"ca_file, ca_pem and server_name are strings: {fields!r}")
        return cls(**fields)

    def admin(self, urls: tuple[str, ...], user: str, password: str) -> RabbitAdmin:
        return RabbitAdmin(
            urls, user, password, ca_file=self.ca_file, ca_pem=self.ca_pem, server_name=self.server_name
        )


@dataclass(frozen=True)
class GatewayAccess:
    region: str
    #: the management API of every node of the region's gateway cluster (any one answers for all)
    management_urls: tuple[str, ...]
    user: str
    password: str
    tls: Tls = Tls()

    def admin(self) -> RabbitAdmin:
        return self.tls.admin(self.management_urls, self.user, self.password)


@dataclass(frozen=True)
class ManagementAccess:
    """A cluster's management API: every node's URL (any one answers for all)."""

    management_urls: tuple[str, ...]
    user: str
    password: str
    tls: Tls = Tls()

    def admin(self) -> RabbitAdmin:
        return self.tls.admin(self.management_urls, self.user, self.password)


def parse_gateways(tables: Mapping[str, Any]) -> tuple[GatewayAccess, ...]:
    """`[gateways.<region>]` tables (a config's, or the backend's registry's) -> GatewayAccess."""
    try:
        return tuple(
            GatewayAccess(
                c.validate_region(region),
                _urls(g["management_url"]),
                g.get("user", c.ADMIN_USER),
                g.get("password", ""),
                Tls.of(g),
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
            _urls(table["management_url"]),
            table.get("user", c.ADMIN_USER),
            table.get("password", ""),
            Tls.of(table),
        )
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise RouterSettingsError(
            f"backend_management: needs management_url, a URL or a list of the nodes' ({e})"
        ) from e
