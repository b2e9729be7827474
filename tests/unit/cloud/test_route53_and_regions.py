from __future__ import annotations

import boto3
import pytest
from moto import mock_aws

from infra.cloud import route53
from infra.cloud.regions import UnknownRegionError, aws_regions, is_local, validate_aws_region

LB = "gw.elb.eu-west-1.amazonaws.com"


def _zone_with_record(*, health_check: bool = True, port: int = 1883) -> tuple[object, str]:
    r53 = boto3.client("route53", region_name="us-east-1")
    zone = r53.create_hosted_zone(Name="fleet.example.com", CallerReference="z")["HostedZone"]["Id"]
    rs: dict[str, object] = {
        "Name": "mqtt.fleet.example.com",
        "Type": "CNAME",
        "TTL": 60,
        "SetIdentifier": "eu-west-1",
        "Region": "eu-west-1",
        "ResourceRecords": [{"Value": LB}],
    }
    if health_check:
        rs["HealthCheckId"] = r53.create_health_check(
            CallerReference="hc",
            HealthCheckConfig={"Type": "TCP", "FullyQualifiedDomainName": LB, "Port": port},
        )["HealthCheck"]["Id"]
    r53.change_resource_record_sets(
        HostedZoneId=zone, ChangeBatch={"Changes": [{"Action": "CREATE", "ResourceRecordSet": rs}]}
    )
    return r53, zone


def _verify(r53: object, zone: str, **kw: str) -> tuple[route53.LatencyRecord, route53.HealthCheck]:
    args = dict(
        zone_id=zone,
        hostname="mqtt.fleet.example.com",
        set_identifier="eu-west-1",
        aws_region="eu-west-1",
        target=LB,
    )
    args.update(kw)
    return route53.verify_region_record(r53, **args)  # type: ignore[arg-type]


@mock_aws
def test_a_correct_latency_record_and_health_check_pass() -> None:
    r53, zone = _zone_with_record()
    rec, hc = _verify(r53, zone)
    assert rec.region == "eu-west-1" and rec.targets == (LB,)
    assert (hc.type, hc.fqdn, hc.port) == ("TCP", LB, 1883)


@mock_aws
def test_a_record_without_a_health_check_is_refused() -> None:
    r53, zone = _zone_with_record(health_check=False)
    with pytest.raises(route53.Route53VerificationError, match="no health check"):
        _verify(r53, zone)


@mock_aws
def test_a_health_check_on_the_wrong_port_is_refused() -> None:
    r53, zone = _zone_with_record(port=15672)
    with pytest.raises(route53.Route53VerificationError, match="probes port 15672, expected 1883"):
        _verify(r53, zone)


@mock_aws
def test_a_missing_region_record_is_named() -> None:
    r53, zone = _zone_with_record()
    with pytest.raises(route53.Route53VerificationError, match="set identifier 'us-east-1'"):
        _verify(r53, zone, set_identifier="us-east-1", aws_region="us-east-1")


def test_aws_regions_come_from_botocore_and_names_are_checked() -> None:
    assert {"eu-west-1", "us-east-1", "ap-southeast-2"} <= aws_regions()
    assert validate_aws_region("eu-central-1") == "eu-central-1"
    with pytest.raises(UnknownRegionError, match="did you mean"):
        validate_aws_region("eu-centrl-1")
    with pytest.raises(UnknownRegionError):
        validate_aws_region("mars-north-1")
    assert is_local("local-ap") and not is_local("eu-west-1")
