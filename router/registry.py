"""Which device ids exist: the fleet's registry, as the gateways hold it.

A command for a device the router has never seen connect is either for a
device that exists and has not connected yet (a new pump still in its box),
or for an id that does not exist (a typo, a decommissioned device, a
hostile sender).  The first must wait for its device; the second must be
refused with a reason, not sent to every gateway, where nobody is subscribed
and MQTT drops it.

Every registered device is a user on every gateway (`fedgate devices add`
pushes the registry there, infra/device_registry.py), so the router asks the
gateways' management APIs: `GET /api/users/<id>`.  Only for devices it has
never seen (the others are known), off the downlink's lock, and remembered:
a registered device for good, an unknown id for UNKNOWN_REMEMBERED_S (it may
be registered a moment later).  When no gateway answers, the registry cannot
say, and the router's `unknown_device` setting decides as before.
"""

from __future__ import annotations

import asyncio
import logging
import time

from backend import contract as c
from backend.rabbitmq_admin import AdminError
from router.gateways import Gateways

log = logging.getLogger(__name__)

#: How long an id no gateway knows counts as not registered before they are asked again.
UNKNOWN_REMEMBERED_S = 10.0
#: A lookup waits this long for one gateway: a command for a new device waits for it.
LOOKUP_TIMEOUT_S = 3.0


class Registry:
    def __init__(self, gateways: Gateways):
        self.gateways = gateways
        self._registered: set[str] = set()
        #: id -> when the gateways said they did not know it (time.monotonic())
        self._unknown: dict[str, float] = {}
        self._lookups: dict[str, asyncio.Future[bool | None]] = {}

    def says(self, device: str) -> bool | None:
        """What the last lookup found: registered, not registered, or None (not asked, or no
        gateway answered)."""
        if device in self._registered:
            return True
        at = self._unknown.get(device)
        if at is not None and time.monotonic() - at < UNKNOWN_REMEMBERED_S:
            return False
        return None

    async def look_up(self, device: str) -> bool | None:
        """Ask the gateways whether `device` is registered, unless remembered; one lookup per
        id at a time, however many commands for it arrive together."""
        if device in c.SERVICE_USERS:
            return False  # fedgate's own users are on the gateways too, and are no devices
        known = self.says(device)
        if known is not None or not device:
            return known
        running = self._lookups.get(device)
        if running is None:
            running = self._lookups[device] = asyncio.ensure_future(self._ask(device))
            running.add_done_callback(lambda _: self._lookups.pop(device, None))
        return await asyncio.shield(running)

    async def _ask(self, device: str) -> bool | None:
        said_no = False
        for region in list(self.gateways.regions):
            if not self.gateways.allows(region, "users"):
                continue  # its gateway refuses this router's user lookups (a monitoring user)
            try:
                found = await self.gateways.has_user(region, device, timeout=LOOKUP_TIMEOUT_S)
            except AdminError as e:
                log.debug("registry: %s could not say whether %s is registered (%s)", region, device, e)
                continue
            if found:
                self._registered.add(device)
                self._unknown.pop(device, None)
                return True
            said_no = True  # every gateway holds the whole registry; ask on for a new region's
        if said_no:
            self._unknown[device] = time.monotonic()
            if len(self._unknown) > 100_000:  # a sender trying random ids must not grow this for ever
                self._unknown.clear()
            return False
        return None

    def forget(self, device: str) -> None:
        """The device was revoked (or an operator says so): ask again next time."""
        self._registered.discard(device)
        self._unknown.pop(device, None)
