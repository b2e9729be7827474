"""Every kind of region behind one interface, and the table that picks a region's driver.

A region is local (``local-<name>``: a gateway node on this machine,
``infra/local``) or an AWS region (``eu-west-1``: a gateway cluster that
Terraform stamps out, ``infra/cloud``).  The command line talks to both
through `RegionDriver` and never asks which kind a region is:

    driver = driver_for("local-ap", settings, progress=print)
    print(driver.add("local-ap").summary())
    rows = [row for d in all_drivers(settings) for row in d.regions()]

`DRIVERS` maps a kind to its driver class by import path, the way kombu's
``TRANSPORT_ALIASES`` maps a transport name to its class: a command that
needs no cloud region never imports boto3 or python-terraform.
`region_kind` says which kind a region name is (infra/cloud/regions.py
knows AWS's names).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from backend import contract as c
from backend.definitions import NodeDefinitions
from infra.cloud.regions import is_local
from infra.device_registry import DeviceUpdate, GatewayTarget, push_to_gateways, sync_gateways
from infra.local.settings import LocalSettings

if TYPE_CHECKING:
    from infra.local.driver import LocalFederation, NodeStatus

Progress = Callable[[str], None]
Confirm = Callable[[str], bool]


@dataclass
class RegionRow:
    """One line of `fedgate regions`."""

    region: str
    kind: str
    gateway: str
    state: str
    mqtt: str
    connections: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Summary(Protocol):
    def summary(self) -> str:
        """What `fedgate gateway add` prints once the region runs."""
        ...


class RegionDriver(Protocol):
    """What the command line needs of a kind of region."""

    #: "local" or "cloud": the key in DRIVERS, and the KIND column of `fedgate regions`
    kind: str

    def add(self, region: str, *, auto_approve: bool = False) -> Summary:
        """Make the region part of the federation (idempotent); `auto_approve` skips confirmation."""
        ...

    def remove(self, region: str, *, auto_approve: bool = False) -> None:
        """Take the region out of the federation and leave nothing of it behind."""
        ...

    def regions(self) -> list[RegionRow]:
        """This kind's regions and their gateways, for `fedgate regions`."""
        ...

    def push_devices(self, added: NodeDefinitions | None, revoked: list[str]) -> DeviceUpdate:
        """New or re-keyed device users onto every running gateway, revoked ones off them."""
        ...

    def sync_devices(self, hashes: Mapping[str, str]) -> DeviceUpdate:
        """Make every running gateway's device users exactly the registry's."""
        ...


#: kind -> "module:Class"; every class takes (settings, progress=None, confirm=None).
DRIVERS: dict[str, str] = {
    "local": "infra.regions:LocalRegions",
    "cloud": "infra.cloud.driver:CloudDriver",
}


def region_kind(region: str) -> str:
    """The kind of driver a region name belongs to (the name is not checked here)."""
    return "local" if is_local(region) else "cloud"


@functools.cache
def driver_class(kind: str) -> Callable[..., RegionDriver]:
    module, _, name = DRIVERS[kind].partition(":")
    cls: Callable[..., RegionDriver] = getattr(importlib.import_module(module), name)
    return cls


def open_driver(
    kind: str, settings: LocalSettings, progress: Progress | None = None, confirm: Confirm | None = None
) -> RegionDriver:
    return driver_class(kind)(settings, progress=progress, confirm=confirm)


def driver_for(
    region: str, settings: LocalSettings, progress: Progress | None = None, confirm: Confirm | None = None
) -> RegionDriver:
    """The driver of `region`'s kind; InvalidRegionError if the name breaks the naming rule."""
    return open_driver(region_kind(c.validate_region(region)), settings, progress, confirm)


def all_drivers(
    settings: LocalSettings, progress: Progress | None = None, confirm: Confirm | None = None
) -> list[RegionDriver]:
    """One driver of every kind, in DRIVERS' order (local first)."""
    return [open_driver(kind, settings, progress, confirm) for kind in DRIVERS]


# --- the local kind ------------------------------------------------------------------------


def format_status(rows: list[NodeStatus]) -> str:
    """The node table of `fedgate up`, `status` and `gateway add local-…`."""
    header = ("NODE", "ROLE", "REGION", "PORTS", "STATE", "PID", "CONNS", "MSGS", "RSS_MB", "VERSION")
    lines = [header]
    for r in rows:
        ports = " ".join(
            f"{k}={r.address}:{v}" if r.address and k in ("mqtt", "mqtts") else f"{k}={v}"
            for k, v in r.ports.items()
            if k not in ("dist", "controller")
        )
        lines.append(
            (
                r.name,
                r.role,
                r.region or "-",
                ports,
                r.state,
                "-" if r.pid is None else str(r.pid),
                "-" if r.connections is None else str(r.connections),
                "-" if r.messages is None else str(r.messages),
                "-" if r.rss_mb is None else str(r.rss_mb),
                r.version or "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(col.ljust(w) for col, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


@dataclass
class StatusTable:
    """A local region's add result: the federation's nodes as they run now."""

    rows: list[NodeStatus]

    def summary(self) -> str:
        return format_status(self.rows)


class LocalRegions:
    """RegionDriver over LocalFederation: local-<name> regions, one gateway node each."""

    kind = "local"

    def __init__(
        self, settings: LocalSettings, progress: Progress | None = None, confirm: Confirm | None = None
    ):
        self.settings = settings
        self.progress: Progress = progress or (lambda msg: None)

    @functools.cached_property
    def federation(self) -> LocalFederation:
        from infra.local.driver import LocalFederation

        return LocalFederation(self.settings, progress=self.progress)

    def add(self, region: str, *, auto_approve: bool = False) -> StatusTable:
        return StatusTable(self.federation.add_region(region))

    def remove(self, region: str, *, auto_approve: bool = False) -> None:
        from infra.local import processes
        from infra.local.driver import FederationError, gateway_node_name

        fed = self.federation
        members = [g.name for g in fed.gateways() if g.spec.region == region] or [gateway_node_name(region)]
        fed.remove_region(region)
        for node in members:
            left = processes.marked_pids(processes.marker(fed.state_dir, node))
            if left:
                raise FederationError(f"processes of {node} still running: {left}")

    def regions(self) -> list[RegionRow]:
        return [
            RegionRow(
                region=r.region or r.name,
                kind=self.kind,
                gateway=r.name,
                state=r.state,
                mqtt=f"{self.settings.host}:{r.ports.get('mqtt')}",
                connections=r.connections,
            )
            for r in self.federation.status()
            if r.role == "gateway"
        ]

    def push_devices(self, added: NodeDefinitions | None, revoked: list[str]) -> DeviceUpdate:
        """A gateway that is not running is skipped: it gets the registry when it is wired."""
        return push_to_gateways(self._running_gateways(), added, revoked)

    def sync_devices(self, hashes: Mapping[str, str]) -> DeviceUpdate:
        return sync_gateways(self._running_gateways(), hashes)

    def _running_gateways(self) -> Iterator[GatewayTarget]:
        from infra.local.devices import running

        return running(self.federation.gateways)
