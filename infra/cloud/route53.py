"""Checking with boto3 that a region's latency record and health check are what devices need.

Terraform created them; this reads them back the way Route53 will use them:
one record per region under the fleet's MQTT hostname, told apart by its set
identifier, carrying the AWS region as its latency region and a health check
that probes the region's MQTT load balancer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.errors import FedgateError

MQTT_PORT = 1883


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
    return HealthCheck(
        id=health_check_id,
        type=cfg.get("Type", ""),
        fqdn=cfg.get("FullyQualifiedDomainName"),
        port=cfg.get("Port"),
        request_interval=cfg.get("RequestInterval"),
        failure_threshold=cfg.get("FailureThreshold"),
    )


def verify_region_record(
    client: Any,
    *,
    zone_id: str,
    hostname: str,
    set_identifier: str,
    aws_region: str,
    target: str,
    port: int = MQTT_PORT,
) -> tuple[LatencyRecord, HealthCheck]:
    """The region's record and health check, or Route53VerificationError with every problem found."""
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
    if hc.type not in ("TCP", "HTTP", "HTTPS"):
        problems.append(f"health check type {hc.type!r} does not probe the gateway")
    if hc.port != port:
        problems.append(f"health check probes port {hc.port}, expected {port}")
    if (hc.fqdn or "").rstrip(".").lower() != target.rstrip(".").lower():
        problems.append(f"health check probes {hc.fqdn}, expected {target}")
    if problems:
        raise Route53VerificationError(f"{hostname} [{set_identifier}]: " + "; ".join(problems))
    return rec, hc
