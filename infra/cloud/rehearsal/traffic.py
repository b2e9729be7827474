"""The routers the backend module deploys, carrying a region's traffic into Kafka, and the
Spark job it deploys, turning that traffic into tables.

On the backend cluster the rehearsal booted: the backend's definitions are applied as
`make gateway` applies them in the cloud (infra/cloud/registration.py, with the routers'
user), two router instances install and start from their rendered cloud-init
(services.py), and readings arrive on the backend's telemetry exchange as a region's
federation link delivers them.  Checked as an operator would: both routers healthy on their
metrics port, every reading in Kafka (read over SASL_SSL, as the routers write), one router
SIGKILLed after it bridged -- the other takes its shards and nothing is lost -- and the one
left stops cleanly on SIGTERM.  Then the Spark job installs from the release with its jars,
reaches its catalog database by the RDS endpoint's name (a PostgreSQL server on the bridge),
keeps its tables in moto's S3, and every reading becomes one telemetry_raw row, read as an
analyst in the VPC would (pyiceberg through the catalog, no Spark); it exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pika
from prometheus_client.parser import text_string_to_metric_families

from backend import contract as c
from backend.errors import FedgateError
from backend.kafka_read import read_records
from backend.polling import wait_until
from backend.rabbitmq_admin import RabbitAdmin
from infra.cloud import registration
from infra.cloud.rehearsal.hosts import Host
from infra.cloud.rehearsal.render import CloudConfig
from infra.cloud.rehearsal.services import AWS_ENV, RehearsalKafka, ServiceInstance
from infra.local.postgres import PostgresServer

#: the region the readings come from (the x-received-from hop a gateway link adds)
REGION = "eu-west-1"
#: readings before and after a router is killed
BATCH = 100
ROUTER_TOML = "/etc/fedgate/router.toml"

Progress = Callable[[str], None]


class TrafficError(FedgateError):
    """The routers did not carry the traffic; the message says what was missing."""


def internal_balancer(router_cloud: CloudConfig) -> str:
    """The internal load balancer's DNS name, as the rendered router.toml names it."""
    toml = tomllib.loads(router_cloud.files[ROUTER_TOML].content)
    host = urlparse(toml["backend_management"]["management_url"]).hostname
    if not host:
        raise TrafficError("router.toml names no backend management URL")
    return host


def _get(url: str, timeout: float = 3) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def bridged(host: Host) -> float:
    """fedgate_router_bridged_total on the router's metrics port (0 when it does not answer)."""
    _, text = _get(f"http://{host.address}:9100/metrics")
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "fedgate_router_bridged_total"
    )


def _publish(url: str, start: int, count: int) -> None:
    """Readings `start`..`start+count` on the backend's telemetry exchange, as the region's
    federation link delivers them (its hop in x-received-from), each confirmed."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for n in range(start, start + count):
            hop = {
                "uri": "amqp://gateway",
                "exchange": c.MQTT_EXCHANGE,
                "redelivered": False,
                "cluster-name": REGION,
            }
            ch.basic_publish(
                c.TELEMETRY_EXCHANGE,
                c.mqtt_topic_to_routing_key(c.device_telemetry_topic(f"rehearsal-{n % 10}")),
                json.dumps({"n": n}).encode(),
                pika.BasicProperties(delivery_mode=2, headers={c.RECEIVED_FROM_HEADER: [hop]}),
                mandatory=True,
            )
    finally:
        conn.close()


def check_routers(
    net_hosts: list[Host],
    routers: list[Host],
    router_cloud: CloudConfig,
    kafka: RehearsalKafka,
    *,
    moto_url: str,
    imds_url: str,
    admin_password: str,
    router_password: str,
    work_dir: Path,
    report: Any,
    progress: Progress,
) -> None:
    node = net_hosts[0].address
    admin = RabbitAdmin(f"http://{node}:15672", c.ADMIN_USER, admin_password)
    registration.register_regions(
        admin,
        [],
        admin_password=admin_password,
        backend_link_password=secrets.token_urlsafe(18),
        router_password=router_password,
    )
    balancer = internal_balancer(router_cloud)
    progress(f"backend definitions applied (user {c.ROUTER_USER}); {balancer} -> the three nodes")
    instances = []
    for host in routers:
        host.resolve({balancer: [h.address for h in net_hosts]})
        instances.append(
            ServiceInstance(host, work_dir / "instances" / host.netns, router_cloud, kafka.overrides())
        )
    report.router_overrides = sorted(kafka.overrides())
    try:
        for i in instances:
            t0 = time.monotonic()
            i.install(moto_url, imds_url)
            env = i.env()
            report.routers[i.name] = {
                "router_id": env.get("FEDGATE_ROUTER_ROUTER_ID", ""),
                "code": i.running_code(),
                "installed_in_s": round(time.monotonic() - t0, 1),
            }
            i.start()
            router_id = report.routers[i.name]["router_id"]
            progress(f"{i.name} ({i.host.address}): installed the release, {router_id} starting")
        _wait_healthy(instances, report, progress)
        url = f"amqp://{c.ADMIN_USER}:{admin_password}@{node}:5672/%2F"
        _publish(url, 0, BATCH)
        first = _read_back(kafka, BATCH)
        by = {i.name: bridged(i.host) for i in instances}
        report.bridged_before_kill = by
        victim = max(instances, key=lambda i: by[i.name])
        victim.kill()
        report.router_killed = victim.name
        progress(
            f"{len(first)} of {BATCH} readings in Kafka; {victim.name}, which bridged them, killed (SIGKILL)"
        )
        _publish(url, BATCH, BATCH)
        got = _read_back(kafka, 2 * BATCH)
        report.kafka_readings = len(got)
        report.kafka_regions = sorted({region for region in got.values()})
        if set(got) != set(range(2 * BATCH)):
            raise TrafficError(f"{len(got)} of {2 * BATCH} readings in Kafka after {victim.name} died")
        progress(f"{2 * BATCH} of {2 * BATCH} readings in Kafka with {victim.name} dead")
        for i in instances:
            if i is not victim:
                report.router_exit_codes[i.name] = i.stop()
        progress(f"the router left stopped on SIGTERM: exit {report.router_exit_codes}")
    finally:
        for i in instances:
            i.kill()


def _wait_healthy(
    instances: list[ServiceInstance], report: Any, progress: Progress, timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout  # one for all the routers
    for i in instances:
        if not wait_until(partial(_healthy, i), deadline - time.monotonic(), 1):
            raise TrafficError(f"{i.name}: the router is not healthy after {timeout:.0f} s; see {i.log}")
        report.routers_healthy.append(i.name)
    progress(f"routers healthy: {', '.join(report.routers_healthy)}")


def _healthy(i: ServiceInstance) -> bool:
    if _get(f"http://{i.host.address}:9100/health")[0] == 200:
        return True
    if not i.alive():
        raise TrafficError(f"{i.name}: the router exited at start; see {i.log}")
    return False


def _read_back(kafka: RehearsalKafka, expect: int) -> dict[int, str]:
    """Reading number -> region header of every rehearsal reading in Kafka (over SASL_SSL)."""
    records = read_records(
        kafka.sasl_bootstrap,
        c.KAFKA_TELEMETRY_TOPIC,
        lambda m, _h: b'"n"' in (m.value() or b""),
        expect,
        timeout=90,
        security=kafka.security,
    )
    return {json.loads(m.value())["n"]: h.get(c.KAFKA_REGION_HEADER, "") for m, h in records}


SPARK_TOML = "/etc/fedgate/spark.toml"

#: what an analyst's reader in the VPC sees: the rehearsal's readings in telemetry_raw, read
#: without Spark (pyiceberg through the catalog database, the files from S3)
_READ_ROWS = """
import json, sys
from spark.reading import duckdb_with_tables
from spark.settings import SparkSettings
con = duckdb_with_tables(SparkSettings.load(sys.argv[1]))
print(json.dumps(con.execute(
    "SELECT count(*), count(DISTINCT message_id) FROM telemetry_raw WHERE device LIKE 'rehearsal-%'"
).fetchall()[0]))
"""


def catalog_endpoint(spark_cloud: CloudConfig) -> tuple[str, int, str, str]:
    """(host, port, database, user) of the catalog database the rendered spark.toml names."""
    toml = tomllib.loads(spark_cloud.files[SPARK_TOML].content)
    found = re.fullmatch(r"jdbc:postgresql://([^:/]+):(\d+)/(\w+)", toml.get("catalog_uri", ""))
    if not found:
        raise TrafficError(
            f"spark.toml's catalog_uri is not a PostgreSQL database: {toml.get('catalog_uri')!r}"
        )
    return found.group(1), int(found.group(2)), found.group(3), toml.get("catalog_user", "")


def check_spark(
    gateway: str,
    host: Host,
    spark_cloud: CloudConfig,
    kafka: RehearsalKafka,
    *,
    moto_url: str,
    imds_url: str,
    catalog_password: str,
    work_dir: Path,
    report: Any,
    progress: Progress,
    expect: int = 2 * BATCH,
    timeout: float = 720,
) -> None:
    """The Spark job the backend module deploys turns the readings the routers put in Kafka
    into telemetry_raw rows, its catalog in PostgreSQL where RDS would be, its tables in S3."""
    db_host, db_port, database, user = catalog_endpoint(spark_cloud)
    instance = ServiceInstance(host, work_dir / "instances" / host.netns, spark_cloud, {})
    # what differs from EC2: moto's S3 (with the credentials an instance profile gives), the
    # rehearsal's CA for Kafka, the jars where this instance's folder has them
    instance.overrides = {
        "FEDGATE_SPARK_KAFKA_CA_FILE": str(kafka.local_ca.ca_cert),
        "FEDGATE_SPARK_S3_ENDPOINT": moto_url,
        "FEDGATE_SPARK_JARS_DIR": instance.path("/opt/fedgate/jars"),
        **AWS_ENV,
        # the rehearsing machine's JVM options for Spark, when it names any (the tests': C1 only)
        **{k: v for k in ("FEDGATE_SPARK_JAVA_OPTIONS",) if (v := os.environ.get(k))},
    }
    report.spark_overrides = sorted(instance.overrides)
    # RDS's stand-in: a PostgreSQL server where the endpoint's name resolves inside the instance
    with PostgresServer(gateway, db_port, user=user, database=database, password=catalog_password) as catalog:
        report.catalog_server_dir = str(catalog.dir)
        host.resolve({db_host: [gateway]})
        progress(f"PostgreSQL at {gateway}:{db_port} for {db_host}; {host.netns} installing the Spark job")
        t0 = time.monotonic()
        instance.install(moto_url, imds_url)
        report.spark_installed_in_s = round(time.monotonic() - t0, 1)
        report.spark_code = instance.running_code()
        instance.start()
        try:
            env = {**instance.env(), "PATH": os.environ["PATH"]}
            toml = instance.path(SPARK_TOML)
            deadline = time.monotonic() + timeout
            rows = ids = 0
            while rows < expect:
                if not instance.alive():
                    raise TrafficError(f"{host.netns}: the Spark job exited; see {instance.log}")
                if time.monotonic() > deadline:
                    raise TrafficError(f"{rows} of {expect} readings in telemetry_raw after {timeout:.0f} s")
                time.sleep(10)  # each look is a Python process reading the catalog
                # from inside the instance: the RDS endpoint's name resolves in the VPC only
                done = subprocess.run(
                    host.command([sys.executable, "-c", _READ_ROWS, toml]),
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                if done.returncode == 0:
                    rows, ids = json.loads(done.stdout.strip().splitlines()[-1])
            report.spark_rows, report.spark_ids = rows, ids
            report.spark_rows_in_s = round(time.monotonic() - t0, 1)
            progress(f"{rows} rows ({ids} message ids) in telemetry_raw, read through the catalog database")
        finally:
            report.spark_exit_code = instance.stop()
        progress(f"the Spark job stopped on SIGTERM: exit {report.spark_exit_code}")
