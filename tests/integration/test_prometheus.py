"""The federation's Prometheus (infra/local/prometheus_node.py) scrapes every node as it runs.

Tried: the session federation at rest, its Spark job running.  Checked as an operator would
in Prometheus's UI: every target up, every job there, the series the alert rules read
present with sane values, and no node or region down."""

from __future__ import annotations

import pytest

from backend.polling import wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.kafka,
    pytest.mark.spark,
    pytest.mark.usefixtures("spark_job"),
]

JOBS = {"rabbitmq", "rabbitmq_queues", "router", "kafka", "spark", "dns", "powerdns", "prometheus"}


def _value(prom, expr: str) -> float | None:
    return prom.client.scalar(expr)


def test_every_node_is_scraped_and_what_the_alerts_read_is_there(federation):
    prom = federation.node("prometheus")
    interval = federation.settings.prometheus_scrape_interval_s
    unhealthy: list[str] = []

    def all_up() -> bool:
        nonlocal unhealthy
        targets = prom.api("targets")["activeTargets"]
        unhealthy = [
            f"{t['labels']['job']}/{t['labels'].get('node')}: {t['lastError']}"
            for t in targets
            if t["health"] != "up"
        ]
        return {t["labels"]["job"] for t in targets} >= JOBS and not unhealthy

    assert wait_until(all_up, 4 * interval + 10, 1), f"targets not up: {unhealthy}"
    nodes = {n.name for n in federation.nodes() if n.spec.role in ("backend", "gateway")}
    assert _value(prom, 'count(up{job="rabbitmq"})') == len(nodes)
    # each region's gateway up, as the region-down alert reads it
    regions = {n.spec.region for n in federation.nodes() if n.spec.role == "gateway"}
    assert wait_until(
        lambda: _value(prom, "count(region:fedgate_gateway_nodes_up:sum > 0)") == len(regions), 30, 1
    )
    assert _value(prom, "sum(fedgate_router_leading)") == 1
    assert _value(prom, 'sum(rabbitmq_federation_links{status="running"})') >= 2 * len(regions)
    assert _value(prom, "sum(kafka_server_replicamanager_underreplicatedpartitions)") == 0
    assert _value(prom, 'count(rabbitmq_detailed_queue_messages{queue=~"fedgate\\\\.uplink\\\\..*"})') >= 1
    assert _value(prom, "fedgate_spark_batches_total") is not None
    # the DNS server finds each region's gateways healthy
    gateways = [n for n in federation.nodes() if n.spec.role == "gateway"]
    assert _value(prom, "count(fedgate_dns_gateway_up == 1)") == len(gateways)
    assert _value(prom, "pdns_auth_backend_queries") is not None
    # nothing is down (other tests' dead-lettered commands may page meanwhile: not looked at);
    # a node an earlier test stopped and started again is resolved at the next evaluation
    down: list[str] = []

    def nothing_down() -> bool:
        nonlocal down
        down = [
            a["labels"]["alertname"]
            for a in prom.alerts()
            if a["state"] == "firing"
            and (a["labels"]["alertname"].endswith("Down") or a["labels"]["severity"] == "critical")
        ]
        return not down

    assert wait_until(nothing_down, 3 * interval, 1), f"alerts firing at rest: {down}"
