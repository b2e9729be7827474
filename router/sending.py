"""Publishing a command to one region's downlink exchange, confirmed.

The backend's federation link for each gateway carries what is published to
`contract.downlink_exchange(region)` to that gateway, which hands it to the
device's session.  Only the leading router (router/leadership.py) sends: it
hands its channel in with `use`, and `stand_by` takes it back.
"""

from __future__ import annotations

import logging

import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from backend import contract as c
from router.commands import downlink_message
from router.metrics import Metrics
from router.outcomes import CommandOutcomes
from router.routing import Command

log = logging.getLogger(__name__)


class RegionMissing(Exception):
    """A region this router was told about has no downlink exchange (it was removed)."""


class RegionUnreachable(RegionMissing):
    """The backend returned a command (mandatory publish): nothing is bound to the region's
    downlink exchange, so no federation link would carry it to the gateway."""


class NotLeading(Exception):
    """This router stood down while sending: the next leader gets the command again."""


class RegionSender:
    def __init__(self, regions: list[str], metrics: Metrics, outcomes: CommandOutcomes | None = None):
        self.regions = set(regions)
        self.metrics = metrics
        #: a command the backend took for a region is `routed` (router/outcomes.py)
        self.outcomes = outcomes
        #: the leader's channel (publisher confirms, returns raise); None while standing by
        self._channel: AbstractChannel | None = None
        self._connection: AbstractConnection | None = None
        self._exchanges: dict[str, AbstractExchange] = {}

    @property
    def leading(self) -> bool:
        return self._channel is not None

    def use(self, channel: AbstractChannel | None, connection: AbstractConnection | None = None) -> None:
        """Send on `channel` (of `connection`) from now on; None: stop sending."""
        self._channel, self._connection = channel, connection
        self._exchanges.clear()

    def set_regions(self, regions: list[str]) -> None:
        self.regions = set(regions)
        for region in list(self._exchanges):
            if region not in self.regions:
                del self._exchanges[region]

    async def _exchange(self, region: str) -> AbstractExchange:
        channel, connection = self._channel, self._connection
        if channel is None or connection is None:
            raise NotLeading(region)
        if region not in self._exchanges:
            # Checked on a channel of its own: a passive declare of a missing exchange
            # closes its channel, and the leader's carries the commands consumer.
            probe = await connection.channel()
            try:
                await probe.declare_exchange(c.downlink_exchange(region), passive=True)
            finally:
                if not probe.is_closed:
                    await probe.close()
            self._exchanges[region] = await channel.get_exchange(c.downlink_exchange(region), ensure=False)
        return self._exchanges[region]

    async def send(
        self, region: str, cmd: Command, payload: bytes, *, broadcast: bool = False, delivery: str = ""
    ) -> None:
        """Publish to a region's downlink and wait for the backend's confirm; `delivery` (on
        record with `routed`) says how the device's session takes it (Subscriptions.delivery).

        Raises RegionMissing when the region's downlink exchange does not exist
        (a region removed while this router still knew it): retrying could
        never succeed, and requeueing would block the command queue.
        """
        if region not in self.regions:
            raise RegionMissing(region)
        try:
            ex = await self._exchange(region)
        except aiormq.exceptions.ChannelNotFoundEntity as e:
            self._exchanges.pop(region, None)
            log.error("region %s: no downlink exchange on the backend (%s)", region, e)
            self.metrics.inc("fedgate_router_region_missing_total", region=region)
            raise RegionMissing(region) from e
        message = downlink_message(cmd, payload, broadcast=broadcast)
        try:
            # mandatory, on a channel that raises on returns: a confirm alone would also
            # come for a command that no link carries on and the backend dropped
            await ex.publish(message, routing_key=c.mqtt_topic_to_routing_key(cmd.topic), mandatory=True)
        except aiormq.exceptions.PublishError as e:
            self.metrics.inc("fedgate_router_unroutable_total", region=region)
            log.log(
                logging.INFO if broadcast else logging.WARNING,
                "region %s: the backend returned a command for %s (%s): no link to its gateway is up",
                region,
                cmd.device,
                getattr(e.frame, "reply_text", e),
            )
            raise RegionUnreachable(region) from e
        if self.outcomes is not None and not broadcast:
            self.outcomes.of(cmd.device, cmd.topic, payload, "routed", region=region, delivery=delivery)
