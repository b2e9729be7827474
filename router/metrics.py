"""Prometheus metrics and the router's small HTTP endpoint.

GET /metrics   Prometheus text format
GET /presence  JSON: every device's region and since when, and counts per region
GET /health    200 once the router consumes

The exposition format is simple enough to write by hand; that keeps the
router free of another dependency.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from router.lifecycle import Lifecycle

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of latency histogram buckets.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

HELP = {
    "fedgate_router_routed_total": "Commands routed to the gateway of the device's region.",
    "fedgate_router_unroutable_total": (
        "Commands the backend returned, no link to the region's gateway being up: they wait and go again."
    ),
    "fedgate_router_broadcast_total": "Commands for unknown devices sent to every region.",
    "fedgate_router_parked_total": "Commands parked for an offline or unknown device.",
    "fedgate_router_unparked_total": "Parked commands delivered after the device connected.",
    "fedgate_router_expired_total": "Parked commands that expired and were dead-lettered.",
    "fedgate_router_desired_stored_total": "Retained commands kept as their device's desired state.",
    "fedgate_router_desired_replayed_total": "Desired-state messages replayed to a connecting device.",
    "fedgate_router_sessions_closed_total": "Older sessions closed because the device connected elsewhere.",
    "fedgate_router_reparked_total": (
        "Commands parked again because their connection ended as they were sent (clean sessions)."
    ),
    "fedgate_router_resent_after_node_loss_total": (
        "Commands parked again, once, because they went to a session that opened as a gateway node "
        "of its region died (its queues may have gone with the node's)."
    ),
    "fedgate_router_leading": "1 on the router that routes commands (router/leadership.py), else 0.",
    "fedgate_router_elected_total": "Times this router took over routing commands.",
    "fedgate_router_federation_links_absent": (
        "Federation links the wiring makes that a cluster does not list, per cluster (the leader's watch)."
    ),
    "fedgate_router_federation_link_repairs_total": (
        "Policies applied anew to start federation links RabbitMQ lost, per cluster (router/link_keeper.py)."
    ),
    "fedgate_router_bridged_total": "Device messages stored in Kafka, per topic.",
    "fedgate_router_deadlettered_total": "Device messages sent to the dead-letter topic.",
    "fedgate_router_batches_total": "Uplink batches taken apart (backend/uplink_batch.py).",
    "fedgate_router_batches_malformed_total": "Uplink batches that did not parse, dead-lettered whole.",
    "fedgate_router_kafka_errors_total": "Records Kafka refused (returned to RabbitMQ).",
    "fedgate_router_kafka_sent_alone_total": (
        "Records sent again in a batch of their own after Kafka refused the batch they were in."
    ),
    "fedgate_router_kafka_delivery_seconds": "Time from produce to Kafka's delivery report.",
    "fedgate_router_presence_devices": "Devices currently connected, per region.",
    "fedgate_router_inflight": "Uplink messages on their way to Kafka.",
    "fedgate_router_fatal_errors_total": "Fatal Kafka producer errors (the router then exits).",
    "fedgate_router_outcomes_total": "Steps recorded in fedgate.command.outcomes, per outcome.",
    "fedgate_router_outcomes_failed_total": "Command outcome records Kafka refused.",
    "fedgate_router_outcomes_dropped_total": (
        "Command outcome records dropped: Kafka away and 50,000 records queued in the producer."
    ),
    "fedgate_router_region_suspect": (
        "1 while a region's gateway did not answer when last asked (its sessions are kept; "
        "its connection list is asked every 2 s until it answers)."
    ),
    "fedgate_router_presence_reconciled_total": (
        "Sessions a gateway's connection list showed otherwise than the events had: "
        "change=found (live, taken in) or ended (gone, dropped)."
    ),
    "fedgate_router_presence_unconfirmed_total": (
        "Presence events acked before Kafka confirmed their change (Kafka slow or away)."
    ),
}


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in sorted(labels.items())
    )
    return "{" + inner + "}"


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self.histograms: dict[str, list[float]] = {}
        self.hist_sum: dict[str, float] = defaultdict(float)
        self.gauges: dict[str, Callable[[], dict[tuple[tuple[str, str], ...], float]]] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += value

    def get(self, name: str, **labels: str) -> float:
        return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.counters.items() if n == name)

    def observe(self, name: str, seconds: float) -> None:
        # Called per bridged message: count into the one bucket it falls in
        # (the last is +Inf); the cumulative "le" counts are summed in render().
        counts = self.histograms.get(name)
        if counts is None:
            counts = self.histograms[name] = [0.0] * (len(BUCKETS) + 1)
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.hist_sum[name] += seconds

    def gauge(self, name: str, fn: Callable[[], dict[tuple[tuple[str, str], ...], float]]) -> None:
        self.gauges[name] = fn

    def render(self) -> str:
        lines: list[str] = []
        seen: set[str] = set()

        def head(name: str, kind: str) -> None:
            if name not in seen:
                seen.add(name)
                lines.append(f"# HELP {name} {HELP.get(name, name)}")
                lines.append(f"# TYPE {name} {kind}")

        for (name, labels), value in sorted(self.counters.items()):
            head(name, "counter")
            lines.append(f"{name}{_labels(dict(labels))} {value:g}")
        for name, counts in sorted(self.histograms.items()):
            head(name, "histogram")
            cumulative = list(itertools.accumulate(counts))
            for bound, count in zip(BUCKETS, cumulative, strict=False):
                lines.append(f'{name}_bucket{{le="{bound}"}} {count:g}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {cumulative[-1]:g}')
            lines.append(f"{name}_sum {self.hist_sum[name]:.6f}")
            lines.append(f"{name}_count {cumulative[-1]:g}")
        for name, fn in sorted(self.gauges.items()):
            head(name, "gauge")
            for labels, value in sorted(fn().items()):
                lines.append(f"{name}{_labels(dict(labels))} {value:g}")
        return "\n".join(lines) + "\n"


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
