"""The regions of a federation, registered in its backend: routers learn them there at run time.

A region is registered when it joins (the local driver's wiring, the cloud
driver's registration after `make gateway`) and deregistered when it leaves,
as a RabbitMQ global runtime parameter of the backend cluster named
`fedgate-region.<region>`.  Its value is what a router needs to reach the
region's gateways -- the table a router.toml's `[gateways.<region>]` holds
(management_url: every node's, user, password).  Routers poll these
(router/region_watch.py): a region added or removed reaches every running
router within a poll, without a restart or a signal.  In the cloud nothing can
signal them: they run on the backend's instances, the region is applied from
an operator's machine.

Why the backend: every router already holds its management API (the link
keeper), and the region's other backend objects (its upstream, its downlink
exchange, its link user) are declared there in the same step, by the same
administrator.  RabbitMQ lets only administrators read global parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from backend.rabbitmq_admin import RabbitAdmin

log = logging.getLogger(__name__)

PREFIX = "fedgate-region."


def parameter_name(region: str) -> str:
    return PREFIX + region


def _path(region: str) -> str:
    return f"global-parameters/{quote(parameter_name(region), safe='')}"


def register(admin: RabbitAdmin, region: str, gateway: Mapping[str, Any]) -> None:
    """Register `region` with its `[gateways.<region>]` table (idempotent: replaces it)."""
    admin.request("PUT", _path(region), {"name": parameter_name(region), "value": dict(gateway)})


def deregister(admin: RabbitAdmin, region: str) -> bool:
    """Forget `region`; False if it was not registered."""
    return admin.delete(_path(region))


def registered(admin: RabbitAdmin) -> dict[str, dict[str, Any]]:
    """Every registered region's `[gateways.<region>]` table, by region."""
    out: dict[str, dict[str, Any]] = {}
    for p in admin.get("global-parameters") or []:
        name = str(p.get("name", ""))
        if name.startswith(PREFIX) and isinstance(p.get("value"), dict):
            out[name[len(PREFIX) :]] = p["value"]
    return out


def sync(admin: RabbitAdmin, gateways: Mapping[str, Mapping[str, Any]]) -> None:
    """Make the registered regions exactly `gateways` (region -> its table)."""
    held = registered(admin)
    for region, table in gateways.items():
        if held.get(region) != dict(table):
            register(admin, region, table)
    for region in held.keys() - gateways.keys():
        deregister(admin, region)
        log.info("region %s deregistered", region)
