"""Prometheus metrics and the router's small HTTP endpoint.

GET /metrics   Prometheus text format (prometheus_client's exposition)
GET /presence  JSON: every device's region and since when, and counts per region
GET /health    200 once the router consumes

Every series the router exports is declared in CATALOG, with its type, HELP
and labels, and named by Prometheus's conventions (counters end in `_total`,
durations are seconds).  The hot path (a counter per reading, a histogram
observation per reading) stays plain Python arithmetic: prometheus_client's
own Counter takes a lock and looks its labels up per call, and the router
counts ~5 of them per reading; Metrics is a prometheus_client collector that
turns its numbers into metric families only when scraped.  Beside them the
registry holds prometheus_client's process, platform and GC collectors and
`fedgate_build_info`.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import logging
import platform
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from router.lifecycle import Lifecycle

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the Kafka delivery histogram's buckets: a produce is ms.
KAFKA_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: ... of a reading's way from its gateway to Kafka: ms when all is well, minutes while a
#: federation link or Kafka is down (the readings wait, none is lost).
READING_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: ... of a command's way to its outcome: ms to a connected device, up to the command's
#: expiry (hours) for one parked until its device connects.
COMMAND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 600.0, 3600.0)


@dataclass(frozen=True)
class Spec:
    """A metric the router exports: its Prometheus type, HELP and label names."""

    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _counter(help_: str, *labels: str) -> Spec:
    return Spec("counter", help_, labels)


def _gauge(help_: str, *labels: str) -> Spec:
    return Spec("gauge", help_, labels)


#: Every series of the router, by its exposed name (docs/operations.md, "Observing the fleet").
CATALOG: dict[str, Spec] = {
    # --- uplink: device messages into Kafka ----------------------------------------------
    "fedgate_router_bridged_total": _counter("Device messages stored in Kafka, per topic.", "topic"),
    "fedgate_router_deadlettered_total": _counter(
        "Device messages and commands sent to the dead-letter topic with their reason.", "topic"
    ),
    "fedgate_router_batches_total": _counter("Uplink batches taken apart (backend/uplink_batch.py)."),
    "fedgate_router_shard_deliveries_total": _counter(
        "Deliveries from each uplink shard (a batch or a message each): the shards this router reads "
        "(single active consumer: the others' go to their router).",
        "shard",
    ),
    "fedgate_router_batches_malformed_total": _counter(
        "Uplink batches that did not parse, dead-lettered whole."
    ),
    "fedgate_router_kafka_errors_total": _counter(
        "Records Kafka refused (their deliveries go back to RabbitMQ)."
    ),
    "fedgate_router_kafka_sent_alone_total": _counter(
        "Records sent again in a batch of their own after Kafka refused the batch they were in."
    ),
    "fedgate_router_kafka_delivery_seconds": Spec(
        "histogram", "Time from a record's produce to Kafka's delivery report.", (), KAFKA_BUCKETS
    ),
    "fedgate_router_reading_latency_seconds": Spec(
        "histogram",
        "Time from a reading's gateway (its batch's first reading reaching the gateway's batcher) "
        "to Kafka storing its record, per region: what a freshness objective is made of.",
        ("region",),
        READING_BUCKETS,
    ),
    "fedgate_router_inflight": _gauge("Uplink messages on their way to Kafka."),
    "fedgate_router_uplink_reconnects_total": _counter(
        "Times the router's uplink connection to the backend was lost."
    ),
    "fedgate_router_fatal_errors_total": _counter("Fatal Kafka producer errors (the router then exits)."),
    # --- downlink: commands to devices ------------------------------------------------------
    "fedgate_router_routed_total": _counter(
        "Commands routed to the gateway of the device's region.", "region"
    ),
    "fedgate_router_held_total": _counter(
        "Commands held for a connected device that has not subscribed yet, per region.", "region"
    ),
    "fedgate_router_returned_total": _counter(
        "Commands a region's gateway did not take (no session there): they go again.", "region"
    ),
    "fedgate_router_unroutable_total": _counter(
        "Commands the backend returned, no link to the region's gateway being up: they wait and go again.",
        "region",
    ),
    "fedgate_router_region_missing_total": _counter(
        "Commands for a region the backend has no downlink exchange for, per region.", "region"
    ),
    "fedgate_router_broadcast_total": _counter("Commands for unknown devices sent to every region."),
    "fedgate_router_parked_total": _counter("Commands parked for an offline or unknown device."),
    "fedgate_router_unparked_total": _counter(
        "Parked commands delivered after the device connected, per region.", "region"
    ),
    "fedgate_router_reparked_total": _counter(
        "Commands parked again because their connection ended as they were sent (clean sessions)."
    ),
    "fedgate_router_expired_total": _counter("Parked commands that expired and were dead-lettered."),
    "fedgate_router_desired_stored_total": _counter(
        "Retained commands kept as their device's desired state."
    ),
    "fedgate_router_desired_replayed_total": _counter(
        "Desired-state messages replayed to a connecting device, per region.", "region"
    ),
    "fedgate_router_acked_total": _counter(
        "Commands waiting for their device's acknowledgement that it acknowledged."
    ),
    "fedgate_router_acks_refused_total": _counter(
        "Acknowledgement messages from devices that did not parse (stored in Kafka all the same)."
    ),
    "fedgate_router_resent_total": _counter("Commands sent again, their device's acknowledgement overdue."),
    "fedgate_router_resent_after_node_loss_total": _counter(
        "Commands parked again, once, because they went to a session that opened as a gateway node "
        "of its region died (its queues may have gone with the node's)."
    ),
    "fedgate_router_command_seconds": Spec(
        "histogram",
        "Time from a command's acceptance by this router to an outcome, per outcome: routed (the "
        "region's gateway has it), acknowledged (by the device), deadlettered.",
        ("outcome",),
        COMMAND_BUCKETS,
    ),
    "fedgate_router_outcomes_total": _counter(
        "Steps recorded in fedgate.command.outcomes, per outcome.", "outcome"
    ),
    "fedgate_router_outcomes_failed_total": _counter("Command outcome records Kafka refused."),
    "fedgate_router_outcomes_dropped_total": _counter(
        "Command outcome records dropped: Kafka away and 50,000 records queued in the producer."
    ),
    # --- leadership, regions, federation links ----------------------------------------------
    "fedgate_router_leading": _gauge("1 on the router that routes commands (router/leadership.py), else 0."),
    "fedgate_router_elected_total": _counter("Times this router took over routing commands."),
    "fedgate_router_region_suspect": _gauge(
        "1 while a region's gateway did not answer when last asked (its sessions are kept; "
        "its connection list is asked every 2 s until it answers).",
        "region",
    ),
    "fedgate_router_region_registry_failures_total": _counter(
        "Failed reads of the region registry (the backend's fedgate.regions queue)."
    ),
    "fedgate_router_gateway_refusals_total": _counter(
        "Calls a region's gateway refused the router's user, per region and call.", "region", "call"
    ),
    "fedgate_router_sessions_closed_total": _counter(
        "Older sessions closed because the device connected elsewhere, per region.", "region"
    ),
    "fedgate_router_federation_links_absent": _gauge(
        "Federation links the wiring makes that a cluster does not list, per cluster (the leader's watch).",
        "cluster",
    ),
    "fedgate_router_federation_link_repairs_total": _counter(
        "Policies applied anew to start federation links RabbitMQ lost, per cluster (router/link_keeper.py).",
        "cluster",
    ),
    # --- presence ---------------------------------------------------------------------------
    "fedgate_router_presence_devices": _gauge("Devices currently connected, per region.", "region"),
    "fedgate_router_presence_reconciled_total": _counter(
        "Sessions a gateway's connection list showed otherwise than the events had: "
        "change=found (live, taken in) or ended (gone, dropped).",
        "change",
    ),
    "fedgate_router_presence_unconfirmed_total": _counter(
        "Presence events acked before Kafka confirmed their change (Kafka slow or away)."
    ),
    "fedgate_router_presence_refused_total": _counter(
        "Presence events refused and logged with the reason, not applied."
    ),
    "fedgate_router_presence_malformed_total": _counter(
        "Presence events that did not parse, dropped and logged."
    ),
    # --- the build --------------------------------------------------------------------------
    "fedgate_build_info": _gauge(
        "1, labelled with the fedgate version and Python the router runs.", "version", "python"
    ),
}

Labels = tuple[tuple[str, str], ...]
#: a series' key: its name and its labels, sorted
Series = tuple[str, Labels]


def _version() -> str:
    try:
        return metadata.version("fedgate")
    except metadata.PackageNotFoundError:  # run from a clone without installing it
        return "unknown"


class Metrics(Collector):
    """The router's numbers, exported through prometheus_client (`registry`, `render`)."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, Labels], float] = defaultdict(float)
        #: (name, labels) -> per bucket (the last is +Inf) the observations that fell in it
        self.histograms: dict[tuple[str, Labels], list[float]] = {}
        self.hist_sum: dict[tuple[str, Labels], float] = defaultdict(float)
        self.gauges: dict[str, Callable[[], dict[Labels, float]]] = {}
        #: each histogram's bucket bounds (CATALOG's), looked up once
        self._bounds: dict[str, tuple[float, ...]] = {}
        #: (name, label, value) -> its series (labelled)
        self._labelled: dict[tuple[str, str, str], Series] = {}
        self.gauge(
            "fedgate_build_info",
            lambda: {(("python", platform.python_version()), ("version", _version())): 1.0},
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        # a registry of its own per router (tests run several in one process), with what
        # prometheus_client's default registry would hold
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += value

    @staticmethod
    def series(name: str, **labels: str) -> Series:
        """A series' key, built once where a hot path counts it per reading (inc_series,
        observe_series): sorting its labels per call cost ~1 us of the ~3 us a call took."""
        return (name, tuple(sorted(labels.items())))

    def labelled(self, name: str, label: str, value: str) -> Series:
        """series(name, label=value), built once per value (a handful of topics, shards)."""
        key = (name, label, value)
        found = self._labelled.get(key)
        if found is None:
            found = self._labelled[key] = self.series(name, **{label: value})
        return found

    def inc_series(self, series: Series, value: float = 1.0) -> None:
        self.counters[series] += value

    def get(self, name: str, **labels: str) -> float:
        return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.counters.items() if n == name)

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        self.observe_series((name, tuple(sorted(labels.items())) if labels else ()), seconds)

    def observe_series(self, series: Series, seconds: float) -> None:
        # Called per reading: count into the one bucket it falls in (the last is +Inf); the
        # cumulative "le" counts are summed when scraped.
        counts = self.histograms.get(series)
        if counts is None:
            counts = self.histograms[series] = [0.0] * (len(CATALOG[series[0]].buckets) + 1)
            self._bounds[series[0]] = CATALOG[series[0]].buckets
        counts[bisect.bisect_left(self._bounds[series[0]], seconds)] += 1
        self.hist_sum[series] += seconds

    def observations(self, name: str, **labels: str) -> float:
        """How many times `name` (a histogram) was observed with `labels`."""
        return sum(self.histograms.get((name, tuple(sorted(labels.items()))), ()))

    def gauge(self, name: str, fn: Callable[[], dict[Labels, float]]) -> None:
        """Export `name` (a gauge, or a counter kept elsewhere) as `fn` says when scraped:
        {labels: value}."""
        self.gauges[name] = fn

    def collect(self) -> Iterator[Metric]:
        families: dict[str, tuple[Metric, tuple[str, ...]]] = {}

        def add(name: str, labels: Labels, *value: Any) -> None:
            if name not in families:
                spec = CATALOG.get(name) or Spec("gauge", f"{name} (not in router/metrics.py's CATALOG)")
                names = spec.labels if name in CATALOG else tuple(k for k, _ in labels)
                kind = {"counter": CounterMetricFamily, "histogram": HistogramMetricFamily}.get(
                    spec.kind, GaugeMetricFamily
                )
                # a counter family is named without its _total, which its sample gets back
                family = name.removesuffix("_total") if spec.kind == "counter" else name
                families[name] = (kind(family, spec.help, labels=list(names)), names)
            metric, names = families[name]
            given = dict(labels)
            metric.add_metric([str(given.get(n, "")) for n in names], *value)  # type: ignore[attr-defined]

        for (name, labels), value in sorted(self.counters.items()):
            add(name, labels, value)
        for (name, labels), counts in sorted(self.histograms.items()):
            bounds = [str(b) for b in CATALOG[name].buckets] + ["+Inf"]
            add(
                name,
                labels,
                list(zip(bounds, itertools.accumulate(counts), strict=True)),
                self.hist_sum[(name, labels)],
            )
        for name, fn in sorted(self.gauges.items()):
            for labels, value in sorted(fn().items()):
                add(name, labels, value)
        yield from (metric for metric, _ in families.values())

    def render(self) -> str:
        return generate_latest(self.registry).decode()


#: The content type of render()'s text: the classic text format, which every Prometheus reads.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class HttpEndpoint(Lifecycle):
    """A minimal HTTP/1.0 server for /metrics, /presence and /health."""

    def __init__(self, host: str, port: int, routes: dict[str, Callable[[str], tuple[int, str, str]]]):
        super().__init__()
        self.host, self.port = host, port
        self.routes = routes
        self._server: asyncio.base_events.Server | None = None

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)).strip():
                pass
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else "/"
            route, _, query = path.partition("?")
            handler = self.routes.get(route)
            if handler is None:
                status, ctype, body = 404, "text/plain", f"no such path {route}\n"
            else:
                status, ctype, body = handler(query)
            data = body.encode()
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}.get(status, "")
            writer.write(
                f"HTTP/1.0 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except (TimeoutError, ConnectionError) as e:
            log.debug("metrics client: %s", e)
        finally:
            writer.close()


def json_response(obj: Any) -> tuple[int, str, str]:
    return 200, "application/json", json.dumps(obj, indent=2) + "\n"
