"""Checking with boto3 that a region's latency record and health check are what devices need.

Terraform created them; this reads them back the way Route53 will use them:
one record per region under the fleet's MQTT hostname, told apart by its set
identifier, carrying the AWS region as its latency region and a health check
that fails when no gateway node of the region's MQTT load balancer answers.
That is a CLOUDWATCH_METRIC check on an alarm over the MQTT target group's
HealthyHostCount, the target group checking its nodes with more than a TCP
connect: a TCP (or HTTP) check of the load balancer's own address passes while
every node hangs, since each hung node's kernel still completes the handshake.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.errors import FedgateError

MQTT_PORT = 1883
HEALTH_CHECK_TYPE = "CLOUDWATCH_METRIC"
#: The alarm's metric: the load balancer's count of nodes passing their check.
ALARM_METRIC = ("AWS/NetworkELB", "HealthyHostCount")
#: Alarm conditions that hold exactly when no node is healthy.
NO_HEALTHY_NODE = {("LessThanThreshold", 1.0), ("LessThanOrEqualToThreshold", 0.0)}


class Route53VerificationError(FedgateError):
    """The record or its health check is missing or wrong; the message lists every problem."""


@dataclass(frozen=True)
class LatencyRecord:
    name: str
    set_identifier: str
    region: str
    targets: tuple[str, ...]
    health_check_id: str | None
    ttl: int | None


@dataclass(frozen=True)
class HealthCheck:
    id: str
    type: str
    fqdn: str | None
    port: int | None
    request_interval: int | None
    failure_threshold: int | None
    #: a CLOUDWATCH_METRIC check's alarm, and how it counts while the alarm has no data
    alarm_name: str | None = None
    alarm_region: str | None = None
    insufficient_data_status: str | None = None


@dataclass(frozen=True)
class HealthAlarm:
    """The CloudWatch alarm a CLOUDWATCH_METRIC health check follows."""

    name: str
    namespace: str
    metric: str
    comparison: str
    threshold: float
    dimensions: dict[str, str] = field(default_factory=dict)


def _fqdn(name: str) -> str:
    return name if name.endswith(".") else name + "."


def latency_records(client: Any, zone_id: str, hostname: str) -> list[LatencyRecord]:
    """Every latency record under `hostname` (one per region)."""
    want = _fqdn(hostname).lower()
    out = []
    for page in client.get_paginator("list_resource_record_sets").paginate(
        HostedZoneId=zone_id, StartRecordName=want
    ):
        for rs in page["ResourceRecordSets"]:
            if rs["Name"].lower() != want:
                continue
            if "Region" not in rs:
                continue
            out.append(
                LatencyRecord(
                    name=rs["Name"],
                    set_identifier=rs.get("SetIdentifier", ""),
                    region=rs["Region"],
                    targets=tuple(r["Value"] for r in rs.get("ResourceRecords", [])),
                    health_check_id=rs.get("HealthCheckId"),
                    ttl=rs.get("TTL"),
                )
            )
    return out


def health_check(client: Any, health_check_id: str) -> HealthCheck:
    cfg = client.get_health_check(HealthCheckId=health_check_id)["HealthCheck"]["HealthCheckConfig"]
    alarm = cfg.get("AlarmIdentifier") or {}
    return HealthCheck(
        id=health_check_id,
        type=cfg.get("Type", ""),
        fqdn=cfg.get("FullyQualifiedDomainName"),
        port=cfg.get("Port"),
        request_interval=cfg.get("RequestInterval"),
        failure_threshold=cfg.get("FailureThreshold"),
        alarm_name=alarm.get("Name"),
        alarm_region=alarm.get("Region"),
        insufficient_data_status=cfg.get("InsufficientDataHealthStatus"),
    )


def health_alarm(cloudwatch: Any, name: str) -> HealthAlarm | None:
    alarms = cloudwatch.describe_alarms(AlarmNames=[name], AlarmTypes=["MetricAlarm"])["MetricAlarms"]
    if not alarms:
        return None
    a = alarms[0]
    return HealthAlarm(
        name=name,
        namespace=a.get("Namespace", ""),
        metric=a.get("MetricName", ""),
        comparison=a.get("ComparisonOperator", ""),
        threshold=float(a.get("Threshold", -1)),
        dimensions={d["Name"]: d["Value"] for d in a.get("Dimensions", [])},
    )


def _dimension(arn: str) -> str:
    """What CloudWatch names a load balancer (net/<name>/<id>) or a target group
    (targetgroup/<name>/<id>) by: the end of its ARN."""
    resource = arn.split(":", 5)[-1]
    return resource.removeprefix("loadbalancer/")


def _alarm_problems(alarm: HealthAlarm, elbv2: Any, target: str, port: int) -> list[str]:
    """Why `alarm` would not fail the region when no node behind the load balancer `target`
    answers MQTT (empty: it would)."""
    name, dims = alarm.name, alarm.dimensions
    problems = []
    if (alarm.namespace, alarm.metric) != ALARM_METRIC:
        problems.append(f"alarm {name} watches {alarm.namespace} {alarm.metric}, expected {ALARM_METRIC}")
    if (alarm.comparison, alarm.threshold) not in NO_HEALTHY_NODE:
        problems.append(f"alarm {name} fires on {alarm.comparison} {alarm.threshold:g}, not on no node")
    lbs = [
        lb
        for page in elbv2.get_paginator("describe_load_balancers").paginate()
        for lb in page["LoadBalancers"]
        if lb["DNSName"].rstrip(".").lower() == target.rstrip(".").lower()
    ]
    if not lbs:
        return [*problems, f"no load balancer {target} in this region"]
    lb_arn = lbs[0]["LoadBalancerArn"]
    if dims.get("LoadBalancer") != _dimension(lb_arn):
        problems.append(f"alarm {name} counts load balancer {dims.get('LoadBalancer')}, not {target}")
    groups = elbv2.describe_target_groups(LoadBalancerArn=lb_arn)["TargetGroups"]
    group = next((g for g in groups if _dimension(g["TargetGroupArn"]) == dims.get("TargetGroup")), None)
    if group is None:
        problems.append(f"alarm {name} counts target group {dims.get('TargetGroup')}, none of {target}")
        return problems
    if group.get("Port") != port:
        problems.append(f"alarm {name} counts the nodes of port {group.get('Port')}, expected {port}")
    if group.get("HealthCheckProtocol") == "TCP":
        problems.append(
            f"target group {group.get('TargetGroupName')} checks its nodes with a TCP connect, "
            "which a hung node's kernel completes"
        )
    return problems


def verify_region_record(
    client: Any,
    *,
    zone_id: str,
    hostname: str,
    set_identifier: str,
    aws_region: str,
    target: str,
    regional: Callable[[str], Any],
    port: int = MQTT_PORT,
) -> tuple[LatencyRecord, HealthCheck]:
    """The region's record and health check, or Route53VerificationError with every problem found.
    `regional(service)` is a boto3 client of `aws_region` (CloudWatch, the load balancers)."""
    records = [r for r in latency_records(client, zone_id, hostname) if r.set_identifier == set_identifier]
    if not records:
        raise Route53VerificationError(
            f"no latency record {hostname} with set identifier {set_identifier!r} in zone {zone_id}"
        )
    rec = records[0]
    problems = []
    if rec.region != aws_region:
        problems.append(f"latency region is {rec.region!r}, expected {aws_region!r}")
    if target.rstrip(".").lower() not in {t.rstrip(".").lower() for t in rec.targets}:
        problems.append(f"record points at {list(rec.targets)}, expected {target}")
    if not rec.health_check_id:
        raise Route53VerificationError(
            f"{hostname} [{set_identifier}]: no health check (Route53 would answer with a dead region)"
        )
    try:
        hc = health_check(client, rec.health_check_id)
    except client.exceptions.NoSuchHealthCheck as e:
        raise Route53VerificationError(
            f"{hostname} [{set_identifier}]: health check {rec.health_check_id} does not exist"
        ) from e
    if hc.type != HEALTH_CHECK_TYPE:
        problems.append(
            f"health check type {hc.type!r} passes while the region's gateway nodes hang (their "
            f"kernels complete its handshake); expected {HEALTH_CHECK_TYPE} over the MQTT target "
            "group's healthy nodes"
        )
    elif not hc.alarm_name:
        problems.append("health check follows no CloudWatch alarm")
    else:
        if hc.alarm_region != aws_region:
            problems.append(f"health check's alarm is in {hc.alarm_region!r}, expected {aws_region!r}")
        if hc.insufficient_data_status == "Healthy":
            problems.append(
                "health check counts an alarm without data as healthy (a region whose nodes never reported)"
            )
        alarm = health_alarm(regional("cloudwatch"), hc.alarm_name)
        if alarm is None:
            problems.append(f"health check's alarm {hc.alarm_name} does not exist in {aws_region}")
        else:
            problems += _alarm_problems(alarm, regional("elbv2"), target, port)
    if problems:
        raise Route53VerificationError(f"{hostname} [{set_identifier}]: " + "; ".join(problems))
    return rec, hc
