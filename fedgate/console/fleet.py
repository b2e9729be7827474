"""What the fleet console shows, gathered from where an operator's tools would read it:

- the federation's Prometheus: which nodes answer (gateways per region, routers, Kafka, the
  Spark job), readings per second through each hop, what waits in which queue, who leads,
  the tables' freshness, the alerts firing;
- the DNS server: what it answers each region's client network now;
- Kafka's `fedgate.command.outcomes` topic: the last commands and their last step
  (CommandTail, a consumer of its own that follows the topic).

Each source that does not answer is named in the view's `errors`; the others still show.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
import urllib.error
from collections import OrderedDict
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from backend import contract as c
from backend.kafka_read import end_offsets, throwaway_consumer
from infra.dns.query import DnsQueryError, DnsServer, ask_server
from infra.local.prometheus_node import PrometheusApi as Prometheus

#: the queues whose depth the console shows when not empty (a PromQL regex): the federation
#: links', the uplink shards, the commands waiting for a router, the poison queue
WATCHED_QUEUES = r"federation: .*|fedgate\.uplink\..*|fedgate\.router\.commands|fedgate\.poison"
#: how many commands the console lists, newest first
COMMANDS_SHOWN = 15
#: outcome records read back from each partition's end when the console starts
COMMANDS_READ_BACK = 200


class CommandTail:
    """The last commands' steps, from a consumer that follows the outcomes topic in a thread
    of its own (a console open for hours reads each record once)."""

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        #: command id -> its steps so far (oldest first), the most recently stepped last
        self.commands: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self.error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="console-commands", daemon=True)

    def start(self) -> CommandTail:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)  # a Kafka call in flight ends by itself (a daemon thread)

    def last(self, n: int = COMMANDS_SHOWN) -> list[dict[str, Any]]:
        with self._lock:
            recent = list(self.commands.items())[-n:]
        return [
            {
                "command_id": cid,
                **steps[-1],
                # the region it went to (its acknowledgement names none)
                "region": next((s["region"] for s in reversed(steps) if s["region"]), ""),
                "steps": [s["outcome"] for s in steps],
            }
            for cid, steps in reversed(recent)
        ]

    def _run(self) -> None:
        consumer: Consumer | None = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = throwaway_consumer(self.bootstrap, "console")
                    ends = end_offsets(consumer, c.KAFKA_COMMAND_OUTCOMES_TOPIC)
                    consumer.assign(
                        [
                            TopicPartition(
                                c.KAFKA_COMMAND_OUTCOMES_TOPIC, p, max(0, end - COMMANDS_READ_BACK)
                            )
                            for p, end in ends.items()
                        ]
                    )
                for m in consumer.consume(500, timeout=1.0):
                    if m.error() is None and m.value():
                        self._add(json.loads(m.value()))
                self.error = ""
            except (KafkaException, RuntimeError, ValueError) as e:
                self.error = f"Kafka: {e}"
                if consumer is not None:
                    consumer.close()
                    consumer = None
                self._stop.wait(2)
        if consumer is not None:
            consumer.close()

    def _add(self, record: dict[str, Any]) -> None:
        cid = str(record.get("command_id", ""))
        step = {k: record.get(k, "") for k in ("device", "topic", "outcome", "region", "reason", "at")}
        with self._lock:
            steps = self.commands.pop(cid, [])
            steps.append(step)
            self.commands[cid] = steps
            while len(self.commands) > 10 * COMMANDS_SHOWN:
                self.commands.popitem(last=False)


def _dns_answers(dns: dict[str, Any] | None) -> dict[str, list[str]]:
    """What the DNS server answers each region's client network now (asked from its first
    address, as a device there would)."""
    if not dns:
        return {}
    server = DnsServer(dns["host"], dns["port"])
    out = {}
    for region, cidr in dns["client_networks"].items():
        source = str(ipaddress.ip_network(cidr).network_address + 1)
        out[region] = ask_server(server, dns["name"], source)[0]
    return out


#: every node Prometheus scrapes whose health the console shows
UP = 'up{job=~"rabbitmq|router|kafka|spark"}'


def _flows(p: Prometheus, view: dict[str, Any]) -> None:
    """Readings through each hop, what waits where, the tables, the alerts: into `view`."""
    queues = p.vector(f"rabbitmq_detailed_queue_messages{{queue=~{json.dumps(WATCHED_QUEUES)}}} > 0")
    view["hops"] = [
        {
            "hop": "gateways -> routers -> Kafka",
            "per_s": p.scalar("sum(rate(fedgate_router_reading_latency_seconds_count[1m]))"),
        },
        {
            "hop": "into Kafka (every topic)",
            "per_s": p.scalar("sum(rate(kafka_server_brokertopicmetrics_messagesin_total[1m]))"),
        },
        {
            "hop": "Kafka -> tables",
            "per_s": p.scalar('sum(rate(fedgate_spark_records_total{table="telemetry_raw"}[1m]))'),
        },
    ]
    view["latency_p99_s"] = p.by("region:fedgate_reading_latency_seconds:p99_5m", "region")
    view["waiting"] = [
        {"node": m.get("node", ""), "queue": m.get("queue", ""), "messages": v} for m, v in queues
    ]
    behind = p.scalar("sum(fedgate_spark_records_behind)")
    if behind:
        view["waiting"].append({"node": "spark", "queue": "Kafka records not read yet", "messages": behind})
    view["tables"] = {
        "last_commit_age_s": p.scalar("time() - max(fedgate_spark_last_commit_timestamp_seconds)"),
        "freshness_p95_s": p.scalar(
            "histogram_quantile(0.95, sum by (le) (rate(fedgate_spark_freshness_seconds_bucket[5m])))"
        ),
        "records_behind": behind,
    }
    view["alerts"] = [
        {
            "name": a["labels"]["alertname"],
            "severity": a["labels"].get("severity", ""),
            "state": a["state"],
            "summary": a.get("annotations", {}).get("summary", ""),
        }
        for a in p.get("alerts")["alerts"]
    ]


def fleet_view(endpoints: dict[str, Any], commands: CommandTail | None) -> dict[str, Any]:
    """The console's whole picture of the fleet now (the page's /api/fleet)."""
    errors: list[str] = []
    view: dict[str, Any] = {"at_ms": int(time.time() * 1000), "regions": [], "errors": errors}
    addresses = {n["address"]: region for region, g in endpoints["gateways"].items() for n in g["nodes"]}
    try:
        answers = _dns_answers(endpoints.get("dns"))
    except (DnsQueryError, OSError) as e:
        answers = {}
        errors.append(f"DNS: {e}")
    # what Prometheus says; without it the regions still show, their state unknown
    up: dict[tuple[str, str], bool] = {}
    devices: dict[str, float] = {}
    readings: dict[str, float] = {}
    leading: dict[str, float] = {}
    shards: dict[str, list[str]] = {}
    prom_url = endpoints.get("prometheus")
    if not prom_url:
        errors.append("no Prometheus in this federation (prometheus_scrape_interval_s = 0)")
    else:
        p = Prometheus(prom_url)
        try:
            up = {(m.get("job", ""), m.get("node", "")): v == 1 for m, v in p.vector(UP)}
            # as the router that routes commands sees them (the others follow the same events)
            devices = p.by(
                "sum by (region) (fedgate_router_presence_devices * on (node) group_left () "
                "fedgate_router_leading)",
                "region",
            )
            readings = p.by("region:fedgate_readings:rate1m", "region")
            leading = p.by("fedgate_router_leading", "node")
            # the shards each router read in the last minute (single active consumer per shard)
            for m, _ in p.vector(
                "sum by (node, shard) (rate(fedgate_router_shard_deliveries_total[1m])) > 0"
            ):
                shards.setdefault(m.get("node", ""), []).append(m.get("shard", ""))
            _flows(p, view)
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            errors.append(f"Prometheus ({prom_url}): {e}")
    for region, g in endpoints["gateways"].items():
        gateways = [{"node": n["name"], "up": up.get(("rabbitmq", n["name"]))} for n in g["nodes"]]
        n_up = sum(bool(x["up"]) for x in gateways)
        if any(x["up"] is None for x in gateways):
            state = "unknown"  # Prometheus did not say (yet)
        else:
            state = "up" if n_up == len(gateways) else ("down" if n_up == 0 else "degraded")
        view["regions"].append(
            {
                "name": region,
                "state": state,
                "gateways": gateways,
                "devices": int(devices.get(region, 0)),
                "readings_per_s": readings.get(region),
                "dns_network": (endpoints.get("dns") or {}).get("client_networks", {}).get(region, ""),
                "dns_answer": [f"{a} ({addresses.get(a, '?')})" for a in answers.get(region, [])],
            }
        )
    view["routers"] = [
        {"node": node, "up": ok, "leading": leading.get(node, 0) == 1, "shards": sorted(shards.get(node, []))}
        for (job, node), ok in sorted(up.items())
        if job == "router"
    ]
    view["engines"] = [
        {"node": node, "job": job, "up": ok}
        for (job, node), ok in sorted(up.items())
        if job in ("kafka", "spark")
    ]
    if commands is not None:
        view["commands"] = commands.last()
        if commands.error:
            errors.append(commands.error)
    return view
