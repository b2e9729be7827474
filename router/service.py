"""The router service: presence, downstream routing and the Kafka bridge in one asyncio process.

    python -m router --config router.toml      (the local driver starts it this way)

Start-up order: Kafka topics (created ahead of time) -> the desired-state
and parking tables (read back from Kafka) -> AMQP -> presence rebuilt from
the gateways -> consumers.  Fails fast, with one clear line, when the
backend or Kafka cannot be reached.

SIGTERM (or SIGINT) shuts down in a fixed order: stop intake (cancel the
consumers) -> drain in-flight messages (each acked once Kafka has it) ->
flush the producer -> close the channels -> close the connection -> exit 0.
A fatal Kafka producer error does the same after /health turned 503, and
exits 1, for the supervisor to start a fresh router.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from pathlib import Path

import aio_pika
import aio_pika.exceptions

from backend.errors import FedgateError
from router.backend_connection import CONNECTION_ERRORS, QuietChannelRestore, connect_cluster
from router.bridge import UplinkBridge
from router.downlink import Downlink
from router.garbage import collect_garbage_for_throughput
from router.kafka import (
    AsyncProducer,
    KafkaUnavailable,
    ensure_topics,
    one_record_per_batch,
    producer_config,
    with_debug_log,
)
from router.leadership import Leadership
from router.lifecycle import Lifecycle
from router.link_keeper import LinkKeeper
from router.metrics import CONTENT_TYPE, HttpEndpoint, Metrics, json_response
from router.outcomes import OUTCOMES_TOPIC, CommandOutcomes
from router.parking import ParkingLot
from router.presence import PresenceTable
from router.region_watch import RegionWatch, merged
from router.settings import RouterSettings, RouterSettingsError, load_router_settings
from router.stores import (
    COMPACTED,
    DESIRED_TOPIC,
    PARKED_TOPIC,
    PRESENCE_TOPIC,
    DesiredState,
    KafkaTable,
    PresenceStore,
)

log = logging.getLogger("router")


class StartupError(FedgateError):
    pass


class Router(Lifecycle):
    def __init__(self, settings: RouterSettings):
        super().__init__()
        self.settings = settings
        self.metrics = Metrics()
        self.presence = PresenceTable()
        config = with_debug_log(
            producer_config(settings.kafka_client, **{"linger.ms": settings.kafka_linger_ms}),
            settings.kafka_debug,
        )

        def producer(config: dict[str, object]) -> AsyncProducer:
            return AsyncProducer(
                config,
                on_fatal=self._producer_failed,
                stall_after_s=settings.kafka_stall_s,
                on_stall=self._producer_failed,
            )

        self.producer = producer(config)
        self.producer_alone = producer(one_record_per_batch(config))
        #: why the router cannot go on (a fatal or stalled Kafka producer): /health fails, run() exits 1
        self.failed: str | None = None
        self.failed_event = asyncio.Event()
        self.bridge = UplinkBridge(settings, self.producer, self.metrics, self.producer_alone)
        self.desired_table = KafkaTable(
            settings.kafka_client, DESIRED_TOPIC, self.producer, settings.router_id
        )
        self.parked_table = KafkaTable(settings.kafka_client, PARKED_TOPIC, self.producer, settings.router_id)
        self.presence_table = KafkaTable(
            settings.kafka_client, PRESENCE_TOPIC, self.producer, settings.router_id
        )
        self.downlink = Downlink(
            settings,
            self.presence,
            ParkingLot(self.parked_table, settings.park_ttl_s),
            DesiredState(self.desired_table),
            self.producer,
            self.metrics,
            PresenceStore(self.presence_table),
            outcomes=CommandOutcomes(self.producer, self.metrics, settings),
        )
        #: the settings of the config file (SIGHUP replaces them); `settings` adds the regions
        #: registered in the backend to their gateways
        self.configured = settings
        bm = settings.backend_management
        backend_admin = bm.admin() if bm else None
        #: the regions registered in the backend, followed (router/region_watch.py)
        self.region_watch = (
            RegionWatch(backend_admin, settings.regions_poll_s, self._apply_regions, self.metrics)
            if backend_admin is not None and settings.regions_poll_s > 0
            else None
        )
        #: the leader's watch over the federation links (router/link_keeper.py)
        self.link_keeper = LinkKeeper(
            backend_admin,
            lambda: self.downlink.gateways.clients,
            settings.link_repair_after_s,
            self.metrics,
        )
        #: which router routes commands (router/leadership.py); all with `downlink` stand
        self.leadership = Leadership(
            settings.amqp_urls, settings.router_id, self.metrics, self._elected, self._deposed
        )
        self.http: HttpEndpoint | None = None
        self.connection: aio_pika.abc.AbstractRobustConnection | None = None
        self.ready = False
        self.metrics.gauge(
            "fedgate_router_presence_devices",
            lambda: {(("region", r),): float(n) for r, n in self.presence.per_region().items()},
        )
        self.metrics.gauge("fedgate_router_inflight", lambda: {(): float(self.bridge.inflight)})
        self.metrics.gauge(
            "fedgate_router_uplink_reconnects_total",
            lambda: {(): float(self.bridge.connection.reconnects if self.bridge.connection else 0)},
        )

    async def _start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        topics = self.bridge.kafka_topics()
        try:
            await loop.run_in_executor(
                None,
                lambda: ensure_topics(
                    s.kafka_client, topics, s.kafka_partitions, s.kafka_replication, timeout=20
                ),
            )
            await loop.run_in_executor(
                None,
                lambda: ensure_topics(
                    s.kafka_client,
                    [DESIRED_TOPIC, PARKED_TOPIC, PRESENCE_TOPIC],
                    1,
                    s.kafka_replication,
                    timeout=20,
                    configs={t: COMPACTED for t in (DESIRED_TOPIC, PARKED_TOPIC, PRESENCE_TOPIC)},
                ),
            )
            await loop.run_in_executor(
                None,
                lambda: ensure_topics(
                    s.kafka_client, [OUTCOMES_TOPIC], s.kafka_partitions, s.kafka_replication, timeout=20
                ),
            )
        except KafkaUnavailable as e:
            raise StartupError(str(e)) from e
        await self.producer.start()
        await self.producer_alone.start()
        if s.downlink:
            try:
                for table in (self.desired_table, self.parked_table, self.presence_table):
                    await table.start()
            except (RuntimeError, TimeoutError) as e:
                raise StartupError(str(e)) from e
        try:
            self.connection = await connect_cluster(s.amqp_urls, timeout=10)
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as e:
            raise StartupError(
                f"backend AMQP at {', '.join(_redact(u) for u in s.amqp_urls)} unreachable: {e}"
            ) from e
        if self.region_watch is not None:
            # before presence is rebuilt: it asks every region's gateways
            await self.region_watch.start()
        if s.metrics_port:
            self.http = HttpEndpoint(
                s.metrics_host,
                s.metrics_port,
                {
                    "/metrics": lambda q: (200, CONTENT_TYPE, self.metrics.render()),
                    "/presence": self._presence_json,
                    "/regions": lambda q: json_response(
                        {"regions": self.settings.regions, "configured": self.configured.regions}
                    ),
                    "/health": self.health,
                },
            )
            await self.http.start()
        if s.downlink:
            presence = await self.connection.channel()
            assert isinstance(presence, aio_pika.abc.AbstractRobustChannel)  # from connect_robust
            await self.downlink.start(presence)
            # presence is current: stand for routing commands (the leader's channel raises on
            # returns, router/sending.py, instead of having them confirmed and dropped)
            await self.leadership.start()
        if s.uplink:
            try:
                await self.bridge.start()  # on a connection of its own (router/uplink_connection.py)
            except CONNECTION_ERRORS as e:
                raise StartupError(f"uplink shards on the backend: {e}") from e
        self.ready = True
        log.info(
            "router %s ready: %s%s; %d devices present",
            s.router_id,
            "downlink " if s.downlink else "",
            "uplink->kafka" if s.uplink else "",
            len(self.presence),
        )

    async def _elected(
        self, channel: aio_pika.abc.AbstractChannel, connection: aio_pika.abc.AbstractConnection
    ) -> None:
        """This router leads: it routes commands and watches the federation links."""
        await self.downlink.lead(channel, connection)
        self.link_keeper.lead()

    async def _deposed(self) -> None:
        await self.link_keeper.stand_by()
        await self.downlink.stand_by()

    def reload(self, settings: RouterSettings) -> None:
        """Take a new config's set of gateways (regions) without a restart; other settings
        need one."""
        self.configured = settings
        self._apply_regions()

    def _apply_regions(self) -> None:
        """Route, broadcast and rebuild with the config's regions and the registered ones."""
        registered = self.region_watch.registered if self.region_watch is not None else None
        settings = dataclasses.replace(
            self.configured, gateways=merged(self.configured.gateways, registered or ())
        )
        before = set(self.settings.regions)
        self.settings = settings
        self.downlink.set_gateways(settings)
        after = set(settings.regions)
        if before != after:
            log.info(
                "regions %s (added %s, removed %s)",
                sorted(after),
                sorted(after - before),
                sorted(before - after),
            )

    def _presence_json(self, query: str) -> tuple[int, str, str]:
        device = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("device")
        sessions = [self.presence.get(device)] if device else self.presence.sessions()
        return json_response(
            {
                "devices": [
                    {
                        "device": x.client_id,
                        "region": x.region,
                        "node": x.node,
                        "connected_at": x.connected_at / 1000.0,
                    }
                    for x in sessions
                    if x is not None
                ],
                "per_region": dict(self.presence.per_region()),
                "total": len(self.presence),
            }
        )

    def health(self, query: object = None) -> tuple[int, str, str]:
        """/health: 200 once routing, 503 while starting, and 503 with the reason once failed."""
        if self.failed:
            return 503, "text/plain", f"failed: {self.failed}\n"
        if self.ready:
            return 200, "text/plain", "ok\n"
        return 503, "text/plain", "starting\n"

    def _producer_failed(self, err: object) -> None:
        """A fatal producer error or a stall (router/kafka.py): nothing more reaches Kafka, so
        the router says so on /health and exits for its supervisor to start it again (what it
        had not acked, RabbitMQ redelivers to the next one)."""
        if self.failed:
            return
        self.failed = f"Kafka producer: {err}"
        self.ready = False
        self.metrics.inc("fedgate_router_fatal_errors_total")
        self.failed_event.set()

    async def _stop(self) -> None:
        """Stop intake, drain, flush, close -- in that order (Lifecycle makes it safe twice)."""
        self.ready = False
        log.info("stopping: intake")
        # uplink first: its deliveries are held from now on, and what is in flight drains
        await self.bridge.stop_intake()
        await self.link_keeper.stand_by()
        if self.region_watch is not None:
            await self.region_watch.stop()
        await self.downlink.stop()
        # the next router leads from here (what this one had not acked goes to it)
        await self.leadership.stop()
        await self.bridge.stop()
        left = await self.producer.flush(10) + await self.producer_alone.flush(1)
        log.info(
            "stopping: producer flushed (%d left), closing AMQP (%d held deliveries go back to their shards)",
            left,
            self.bridge.held,
        )
        if self.connection is not None:
            await self.connection.close()
        for part in (
            self.producer,
            self.producer_alone,
            self.desired_table,
            self.parked_table,
            self.presence_table,
            self.http,
        ):
            if part is not None:
                await part.stop()
        log.info("stopped")


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


async def run(settings: RouterSettings, config: Path | None = None) -> int:
    router = Router(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload() -> None:
        try:
            new = load_router_settings(config)
        except RouterSettingsError as e:
            log.error("reload refused, keeping the running settings: %s", e)
            return
        router.reload(new)

    # SIGHUP: re-read the config file (a region was added or removed).
    loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        await router.start()
    except StartupError as e:
        log.error("cannot start: %s", e)
        await router.stop()
        return 1
    collect_garbage_for_throughput()
    stopped, failed = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(router.failed_event.wait())
    await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
    for waiting in (stopped, failed):
        waiting.cancel()
    await router.stop()
    if router.failed:
        log.error("exiting: %s", router.failed)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router", description="fedgate router")
    p.add_argument("--config", type=Path, help="router TOML file")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    logging.getLogger("aio_pika.tools").addFilter(QuietChannelRestore())
    try:
        settings = load_router_settings(args.config)
    except RouterSettingsError as e:
        print(f"router: settings: {e}", file=sys.stderr)
        return 2
    return asyncio.run(run(settings, args.config))


if __name__ == "__main__":
    sys.exit(main())
