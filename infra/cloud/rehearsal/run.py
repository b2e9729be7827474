"""The whole rehearsal: render, boot three instances, check the cluster as an operator would.

What is checked, and why each matters on EC2:
1. every instance named its node rabbit@<its private address> through IMDSv2 (a node
   named otherwise would not be the peer AWS discovery lists: it would boot alone);
2. the three nodes form ONE cluster, and each of them says so (no node alone);
3. a quorum queue declared through one node has a replica on each of the three;
4. (backend) the routers the module deploys install from the release and carry a region's
   readings into Kafka, also when one of them is killed, and the Spark job it deploys turns
   them into table rows (traffic.py);
5. one instance killed (SIGKILL, as a terminated instance): the queue keeps every message it
   had confirmed and confirms new ones through another node, and the two left still see
   each other and the lost node as a member that is down.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pika

from backend.errors import FedgateError
from backend.polling import wait_until
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from infra.cloud.rehearsal.hosts import HostNetwork
from infra.cloud.rehearsal.imds import MetadataService
from infra.cloud.rehearsal.instance import Instance
from infra.cloud.rehearsal.moto import MotoServer, debian_image
from infra.cloud.rehearsal.render import BACKEND, GATEWAY, CloudConfig, Example, example_user_data
from infra.cloud.rehearsal.services import RehearsalKafka
from infra.cloud.rehearsal.traffic import check_routers, check_spark
from infra.cloud.release import build_release
from infra.cloud.toolchain import detect
from infra.local.broker import broker_runtime
from infra.local.settings import LocalSettings

#: the backend example's administrator (backend/main.tf renders it into rabbitmq.conf)
ADMIN_USER = "fedgate-admin"
NODES = 3
#: the routers the backend rehearsal deploys (the module's default router_count), and the
#: Spark job's one instance after them
ROUTERS = 2
#: what is rehearsed: each cluster kind, the example it is planned from, in which AWS region
CLUSTERS: dict[str, tuple[Example, str]] = {
    "backend": (BACKEND, "eu-central-1"),
    "gateway": (GATEWAY, "eu-west-1"),
}
QUEUE = "rehearsal.quorum"
#: an m6i.large's image, as the module looks it up
IMAGE = debian_image(
    "ami-0de13a0d64000002", "debian-13-amd64-20251006-2257", "x86_64", "2025-10-06T22:57:00.000Z"
)

Progress = Callable[[str], None]


class RehearsalError(FedgateError):
    """The rehearsal found the cloud's nodes would not work; the message says what failed."""


@dataclass
class RehearsalOptions:
    #: where the instances' folders and the rendered example go
    work_dir: Path
    #: the instances' subnet (network namespaces of this machine, never a real network)
    subnet: str = "10.254.80.0/24"
    #: names of the namespaces and the bridge (<prefix>-n1.., <prefix>-br)
    prefix: str = "fgrh"
    #: seconds for the three nodes to form their cluster
    form_timeout_s: float = 240.0
    #: which clusters (CLUSTERS), one after the other
    clusters: tuple[str, ...] = tuple(CLUSTERS)
    #: the backend: also apply its routers (from a release) and carry traffic through them
    routers: bool = True


@dataclass
class Report:
    """What the rehearsal saw, for people (lines) and tests (--json)."""

    node_names: dict[str, str] = field(default_factory=dict)
    imds_requests: list[list[str]] = field(default_factory=list)
    cluster_seen_by: dict[str, list[str]] = field(default_factory=dict)
    formed_in_s: float = 0.0
    queue_members: list[str] = field(default_factory=list)
    killed: str = ""
    confirmed_before_kill: int = 0
    confirmed_after_kill: int = 0
    consumed: int = 0
    #: gateways: the MQTT listeners of the nodes left answered a CONNECT (CONNACK return code)
    mqtt_after_kill: dict[str, int] = field(default_factory=dict)
    running_after_kill: dict[str, list[str]] = field(default_factory=dict)
    peer_discovery: list[str] = field(default_factory=list)
    # the backend's routers (traffic.py): per instance its router id, where its code runs from
    routers: dict[str, dict[str, Any]] = field(default_factory=dict)
    routers_healthy: list[str] = field(default_factory=list)
    #: the router environment variables the rehearsal sets over what the module rendered
    router_overrides: list[str] = field(default_factory=list)
    bridged_before_kill: dict[str, float] = field(default_factory=dict)
    router_killed: str = ""
    kafka_readings: int = 0
    kafka_regions: list[str] = field(default_factory=list)
    router_exit_codes: dict[str, int | None] = field(default_factory=dict)
    # the backend's Spark job (traffic.py)
    spark_overrides: list[str] = field(default_factory=list)
    spark_code: str = ""
    spark_installed_in_s: float = 0.0
    spark_rows: int = 0
    spark_ids: int = 0
    spark_rows_in_s: float = 0.0
    spark_exit_code: int | None = None
    #: the folder of the catalog database's stand-in server, which must be gone after the run
    catalog_server_dir: str = ""


def rehearsal_conf(rendered: str, node_names: list[str]) -> tuple[str, list[str]]:
    """The rendered rabbitmq.conf with AWS peer discovery replaced by the nodes AWS would have
    listed (classic_config), and the lines replaced.  Every other line is kept as rendered."""
    replaced = [
        line
        for line in rendered.splitlines()
        if line.startswith("cluster_formation.peer_discovery_backend")
        or line.startswith("cluster_formation.aws.")
    ]
    if not any("= aws" in line for line in replaced):
        raise RehearsalError("the rendered rabbitmq.conf does not discover peers through AWS")
    kept = [line for line in rendered.splitlines() if line not in replaced]
    listed = [f"cluster_formation.classic_config.nodes.{i + 1} = {n}" for i, n in enumerate(node_names)]
    lines = [
        *kept,
        "# cloud rehearsal: the autoscaling group's instances as AWS peer discovery would list them",
        "cluster_formation.peer_discovery_backend = classic_config",
        *listed,
        "",
    ]
    return "\n".join(lines), replaced


def rehearse(settings: LocalSettings, options: RehearsalOptions, progress: Progress) -> dict[str, Report]:
    """For each cluster: render its cloud-init, then boot it and check the cluster (and, on
    the backend, its routers)."""
    reports = {}
    for cluster in options.clusters:
        if cluster not in CLUSTERS:
            raise RehearsalError(f"cluster {cluster!r}: one of {', '.join(CLUSTERS)}")
        one = replace(options, work_dir=options.work_dir / cluster)
        one.work_dir.mkdir(parents=True, exist_ok=True)
        progress(f"--- the {cluster} cluster")
        reports[cluster] = _rehearse_cluster(settings, one, cluster, progress)
    return reports


def _rehearse_cluster(
    settings: LocalSettings, options: RehearsalOptions, cluster: str, progress: Progress
) -> Report:
    routers = ROUTERS if CLUSTERS[cluster][0].routers_module and options.routers else 0
    with contextlib.ExitStack() as stack:
        # AWS's APIs and the metadata service on the instances' network: the routers'
        # installer reaches them from inside its instance
        services = routers + 1 if routers else 0  # the routers, then the Spark job
        net = stack.enter_context(HostNetwork(options.prefix, options.subnet, NODES, services=services))
        moto = stack.enter_context(MotoServer([IMAGE], host=net.gateway))
        imds = stack.enter_context(MetadataService(net.gateway, 0))
        secret = {k: secrets.token_urlsafe(18) for k in ("admin", "router", "kafka", "catalog")}
        kafka = None
        if routers:
            kafka = RehearsalKafka.create(settings, net.gateway, options.work_dir / "kafka", secret["kafka"])
            progress(f"starting the operator's own Kafka at {kafka.sasl_bootstrap} (SASL_SSL)")
            kafka.start()
            stack.callback(kafka.stop, 30)
        clouds = render(settings, options, cluster, secret, moto.url, kafka, progress)

        def run_services(report: Report) -> None:
            if kafka is None:
                return
            _wait_ready(kafka, progress)
            check_routers(
                net.hosts,
                net.services[:ROUTERS],
                clouds["routers"],
                kafka,
                moto_url=moto.url,
                imds_url=imds.url,
                admin_password=secret["admin"],
                router_password=secret["router"],
                work_dir=options.work_dir,
                report=report,
                progress=progress,
            )
            check_spark(
                net.gateway,
                net.services[ROUTERS],
                clouds["spark"],
                kafka,
                moto_url=moto.url,
                imds_url=imds.url,
                catalog_password=secret["catalog"],
                work_dir=options.work_dir,
                report=report,
                progress=progress,
            )

        return boot_and_check(
            settings,
            options,
            clouds["nodes"],
            secret["admin"],
            progress,
            net=net,
            imds=imds,
            services=run_services,
        )
    raise AssertionError("unreachable")


def _wait_ready(kafka: RehearsalKafka, progress: Progress, timeout: float = 120) -> None:
    def ready() -> bool:
        if kafka.ready():
            return True
        if kafka.exited() is not None:
            raise RehearsalError(f"the rehearsal's Kafka exited at start; see {kafka.logs_to_read()}")
        return False

    if not wait_until(ready, timeout, 1):
        raise RehearsalError(f"the rehearsal's Kafka is not ready after {timeout:.0f} s")
    progress("Kafka ready")


def render(
    settings: LocalSettings,
    options: RehearsalOptions,
    cluster: str,
    secret: dict[str, str],
    moto_url: str,
    kafka: RehearsalKafka | None,
    progress: Progress,
) -> dict[str, CloudConfig]:
    """The cluster's example planned against moto -- applied, with a release and `kafka` as
    the operator's own Kafka, when its routers are rehearsed: the cloud-init of its nodes
    (also kept as <work_dir>/user-data, what an instance would boot with) and its routers."""
    example, aws_region = CLUSTERS[cluster]
    toolchain = detect(
        terraform_bin=settings.terraform_bin,
        mirror=settings.tf_plugin_mirror,
        cache_dir=settings.cache_dir,
        require_mirror=True,
    )
    variables = {"admin_password": secret["admin"], "erlang_cookie": secrets.token_hex(20)}
    if example is BACKEND:
        variables |= {"analytics_bucket_name": "fedgate-rehearsal", "kafka_sasl_password": secret["kafka"]}
    if kafka is not None:
        wheel, jars = build_release(options.work_dir / "release")
        progress(f"release built: {wheel.name}, {jars.name}")
        variables |= {
            "fedgate_release_wheel": str(wheel),
            "fedgate_spark_jars": str(jars),
            "router_password": secret["router"],
            "catalog_password": secret["catalog"],
            "kafka_bootstrap": kafka.sasl_bootstrap,
        }
    verb = "applying" if kafka is not None else "planning"
    progress(f"{verb} infra/terraform/examples/{example.folder} against moto (Terraform {toolchain.version})")
    t0 = time.monotonic()
    user_data = example_user_data(
        toolchain, options.work_dir, moto_url, example, variables, aws_region, apply=kafka is not None
    )
    kept = options.work_dir / "user-data"
    kept.write_text(user_data["nodes"])
    kept.chmod(0o600)  # the admin password and the cookie
    clouds = {kind: CloudConfig.parse(text) for kind, text in user_data.items()}
    progress(
        f"rendered the instances' cloud-init in {time.monotonic() - t0:.0f} s: "
        + ", ".join(f"{kind} {len(cc.files)} files, {len(cc.runcmd)} commands" for kind, cc in clouds.items())
        + f" ({kept})"
    )
    return clouds


def boot_and_check(
    settings: LocalSettings,
    options: RehearsalOptions,
    cloud: CloudConfig,
    admin_password: str,
    progress: Progress,
    *,
    net: HostNetwork | None = None,
    imds: MetadataService | None = None,
    services: Callable[[Report], None] | None = None,
) -> Report:
    """Boot `cloud` on three instances and check what an operator would (module docstring);
    `services` runs once the cluster formed, before an instance is killed.  Without `net`
    and `imds`, the instances' network and metadata service of its own."""
    report = Report()
    runtime = broker_runtime("4.0", settings.cache_dir, settings.rabbitmq_bin_dir)
    runtime.check("cloud rehearsal")
    if runtime.root is None:
        raise RehearsalError(
            "the rehearsal boots Debian 13's RabbitMQ from make setup's root (Debian 12 hosts)"
        )
    with contextlib.ExitStack() as stack:
        if net is None:
            net = stack.enter_context(HostNetwork(options.prefix, options.subnet, NODES))
        if imds is None:
            imds = stack.enter_context(MetadataService(net.gateway, 0))
        names = [f"rabbit@{h.address}" for h in net.hosts]
        instances = [
            Instance(h, options.work_dir / "instances" / h.netns, runtime.root, cloud) for h in net.hosts
        ]
        try:
            _boot(instances, cloud, names, imds.url, report, progress)
            report.imds_requests = [list(r) for r in imds.requests]
            admins = {
                i.name: RabbitAdmin(f"http://{i.host.address}:15672", ADMIN_USER, admin_password)
                for i in instances
            }
            t0 = time.monotonic()
            _wait_formed(instances, admins, names, options.form_timeout_s, report, progress)
            report.formed_in_s = round(time.monotonic() - t0, 1)
            if services is not None:
                services(report)
            _check_quorum_queue(instances, admins, names, admin_password, report, progress)
        finally:
            progress("stopping the instances")
            for i in instances:
                i.stop()
    return report


def _boot(
    instances: list[Instance],
    cloud: CloudConfig,
    names: list[str],
    imds_url: str,
    report: Report,
    progress: Progress,
) -> None:
    conf = cloud.files["/etc/rabbitmq/rabbitmq.conf"].content
    rehearsed, report.peer_discovery = rehearsal_conf(conf, names)
    for i in instances:
        i.write_files(lambda _: rehearsed)
        i.run_commands(imds_url)
        # no name of its own: RabbitMQ's default, rabbit@<host name>, which no peer lists
        report.node_names[i.name] = i.node_name() or "(none: rabbit@<host name>)"
        progress(f"{i.name} ({i.host.address}): cloud-init done, node {report.node_names[i.name]} starting")


def _running(admin: RabbitAdmin) -> list[str]:
    return sorted(n["name"] for n in admin.get("nodes") if n.get("running"))


def _wait_formed(
    instances: list[Instance],
    admins: dict[str, RabbitAdmin],
    names: list[str],
    timeout: float,
    report: Report,
    progress: Progress,
) -> None:
    status = ""

    def formed() -> bool:
        nonlocal status
        for i in instances:
            if not i.alive():
                raise RehearsalError(
                    f"{i.name}: the node exited while forming the cluster; see {i.log} "
                    f"and {i.dir / 'var/log/rabbitmq'}"
                )
        seen: dict[str, list[str]] = {}
        for name, admin in admins.items():
            try:
                seen[name] = _running(admin)
            except AdminError:
                seen[name] = []
        report.cluster_seen_by = seen
        if all(s == sorted(names) for s in seen.values()):
            return True
        now = "; ".join(f"{k}: {len(v)} running" if v else f"{k}: not answering" for k, v in seen.items())
        if now != status:
            progress(f"forming: {now}")
        status = now
        return False

    if not wait_until(formed, timeout, 2):
        raise RehearsalError(f"no cluster of {len(names)} after {timeout:.0f} s: {status}")
    progress(f"one cluster of {len(names)}: {', '.join(sorted(names))}")


def _publish(url: str, count: int, start: int) -> int:
    """Publish `count` persistent messages with confirms; the number confirmed."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        confirmed = 0
        for n in range(start, start + count):
            ch.basic_publish(
                "", QUEUE, str(n).encode(), pika.BasicProperties(delivery_mode=2), mandatory=True
            )
            confirmed += 1  # basic_publish raises when the broker nacks or returns it
        return confirmed
    finally:
        conn.close()


def _consume_all(url: str, expect: int, timeout: float = 60) -> set[int]:
    got: set[int] = set()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            method, _, body = ch.basic_get(QUEUE, auto_ack=False)
            if method is None:
                time.sleep(0.2)
                continue
            got.add(int(body))
            ch.basic_ack(method.delivery_tag)
        return got
    finally:
        conn.close()


def _check_quorum_queue(
    instances: list[Instance],
    admins: dict[str, RabbitAdmin],
    names: list[str],
    password: str,
    report: Report,
    progress: Progress,
) -> None:
    first, second, last = instances
    url = {i.name: f"amqp://{ADMIN_USER}:{password}@{i.host.address}:5672/%2F" for i in instances}
    conn = pika.BlockingConnection(pika.URLParameters(url[first.name]))
    try:
        conn.channel().queue_declare(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        conn.close()
    info: dict[str, Any] = admins[first.name].get(f"queues/%2F/{QUEUE}")
    report.queue_members = sorted(info.get("members") or [])
    if report.queue_members != sorted(names):
        raise RehearsalError(f"quorum queue {QUEUE}: replicas on {report.queue_members}, not on every node")
    progress(f"quorum queue {QUEUE}: a replica on each node")
    report.confirmed_before_kill = _publish(url[first.name], 100, 0)
    report.killed = last.name
    last.kill()
    progress(f"{last.name} killed (SIGKILL); {report.confirmed_before_kill} messages were confirmed before")
    report.confirmed_after_kill = _publish(url[second.name], 100, 100)
    got = _consume_all(url[second.name], 200)
    report.consumed = len(got)
    for i in (first, second):
        report.running_after_kill[i.name] = _running(admins[i.name])
    if got != set(range(200)):
        raise RehearsalError(f"{QUEUE}: {len(got)} of 200 confirmed messages consumed after {last.name} died")
    progress(f"with {last.name} dead: 100 more confirmed through {second.name}, 200 of 200 consumed")
    if "mqtt" in cloud_plugins(instances[0]):
        # MQTT's client id tracking needs a majority of the nodes: two of three still have one
        for i in (first, second):
            report.mqtt_after_kill[i.name] = mqtt_connack(i.host.address, 1883, ADMIN_USER, password)
        progress(f"with {last.name} dead: MQTT answers on {first.name} and {second.name}")


def cloud_plugins(instance: Instance) -> str:
    """The instance's enabled_plugins file, as cloud-init wrote it."""
    return (instance.dir / "etc/rabbitmq/enabled_plugins").read_text()


def _mqtt_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("!H", len(data)) + data


def mqtt_connack(host: str, port: int, user: str, password: str, timeout: float = 15) -> int:
    """An MQTT 3.1.1 CONNECT to `host`; the CONNACK's return code (0: accepted, 4/5: refused
    credentials).  Any answer means the MQTT plugin serves; a closed socket or silence: not."""
    variable = _mqtt_string("MQTT") + bytes([4, 0xC2]) + struct.pack("!H", 30)
    payload = _mqtt_string("fedgate-rehearsal") + _mqtt_string(user) + _mqtt_string(password)
    body = variable + payload
    length = b""
    n = len(body)
    while True:  # MQTT's variable-length remaining length
        digit, n = n % 128, n // 128
        length += bytes([digit | (0x80 if n else 0)])
        if not n:
            break
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(b"\x10" + length + body)
        answer = b""
        while len(answer) < 4:
            chunk = s.recv(4 - len(answer))
            if not chunk:
                raise RehearsalError(f"MQTT at {host}:{port} closed the connection without a CONNACK")
            answer += chunk
    if answer[0] != 0x20:
        raise RehearsalError(f"MQTT at {host}:{port} answered {answer!r}, not a CONNACK")
    return answer[3]
