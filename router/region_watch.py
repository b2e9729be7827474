"""The regions registered in the backend, followed at run time (backend/region_registry.py).

Every router (leading or not) asks the backend's management API every
`regions_poll_s` for the registered regions and, when they changed, tells
the router, which reads `registered` and routes, broadcasts and rebuilds
presence with it at once -- as a SIGHUP with a new config would, but nothing
has to send one: `make gateway`
and `make gateway-destroy` reach running routers, here and in the cloud.

A region in the router's own config (`[gateways.<region>]`) keeps its
config's access; the registry adds the others.  The backend not answering
keeps the regions the router knows (a management API down is not a region
gone); a malformed entry is skipped, logged once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from backend import region_registry
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from router.access import GatewayAccess, RouterSettingsError, parse_gateways
from router.lifecycle import Lifecycle, cancel_task
from router.metrics import Metrics
from router.tasks import every

log = logging.getLogger(__name__)


class RegionWatch(Lifecycle):
    def __init__(
        self,
        admin: RabbitAdmin,
        poll_s: float,
        on_change: Callable[[], None],
        metrics: Metrics,
    ):
        super().__init__()
        self.admin = admin
        self.poll_s = poll_s
        self.on_change = on_change
        #: the registered regions last read (None: never read yet)
        self.registered: tuple[GatewayAccess, ...] | None = None
        self._malformed: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        metrics.gauge("fedgate_router_region_registry_failures_total", lambda: {(): float(self._failures)})

    def read(self) -> tuple[GatewayAccess, ...]:
        """The registered regions whose entry parses (blocking: run it in an executor)."""
        out: list[GatewayAccess] = []
        for region, table in sorted(region_registry.registered(self.admin).items()):
            try:
                out.extend(parse_gateways({region: table}))
            except RouterSettingsError as e:
                if region not in self._malformed:
                    log.error("registered region %s skipped: %s", region, e)
                    self._malformed.add(region)
        return tuple(out)

    async def poll(self) -> None:
        """Read the registry once; hand a change to on_change."""
        try:
            now = await asyncio.get_running_loop().run_in_executor(None, self.read)
        except AdminError as e:
            self._failures += 1
            log.warning("registered regions unreadable, keeping %s: %s", self._names(self.registered), e)
            return
        if now != self.registered:
            log.info("registered regions: %s (were %s)", self._names(now), self._names(self.registered))
            self.registered = now
            self.on_change()

    @staticmethod
    def _names(gateways: tuple[GatewayAccess, ...] | None) -> list[str] | None:
        return None if gateways is None else [g.region for g in gateways]

    async def _start(self) -> None:
        """The first read (before presence is rebuilt: it asks every region), then a poll each
        `poll_s`."""
        await self.poll()
        self._task = self.spawn(self._run(), "region-watch")

    async def _run(self) -> None:
        # a bug here must not end the watch
        await every(
            self.poll_s, self.poll, "reading the registered regions failed", logger=log, traceback=True
        )

    async def _stop(self) -> None:
        task, self._task = self._task, None
        await cancel_task(task)


def merged(
    configured: tuple[GatewayAccess, ...], registered: tuple[GatewayAccess, ...]
) -> tuple[GatewayAccess, ...]:
    """The config's regions, then the registered ones the config lacks."""
    own = {g.region for g in configured}
    return (*configured, *(g for g in registered if g.region not in own))
