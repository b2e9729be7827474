from __future__ import annotations

import boto3
import pytest
from moto import mock_aws

from infra.cloud import route53
from infra.cloud.regions import UnknownRegionError, aws_regions, is_local, validate_aws_region

from .fakes import region_dns


def _verify(zone: str, lb: str, **kw: str) -> tuple[route53.LatencyRecord, route53.HealthCheck]:
    args = dict(
        zone_id=zone,
        hostname="mqtt.fleet.example.com",
        set_identifier="eu-west-1",
        aws_region="eu-west-1",
        target=lb,
    )
    args.update(kw)
    return route53.verify_region_record(
        boto3.client("route53", region_name="us-east-1"),
        regional=lambda service: boto3.client(service, region_name="eu-west-1"),
        **args,  # type: ignore[arg-type]
    )


@mock_aws
def test_a_record_whose_health_follows_the_load_balancers_healthy_nodes_passes() -> None:
    zone, lb = region_dns()
    rec, hc = _verify(zone, lb)
    assert rec.region == "eu-west-1" and rec.targets == (lb,)
    assert (hc.type, hc.alarm_name, hc.alarm_region) == (
        "CLOUDWATCH_METRIC",
        "fedgate-eu-west-1-mqtt-healthy-nodes",
        "eu-west-1",
    )


@mock_aws
def test_a_record_without_a_health_check_is_refused() -> None:
    zone, lb = region_dns()
    r53 = boto3.client("route53", region_name="us-east-1")
    (rs,) = [
        r for r in r53.list_resource_record_sets(HostedZoneId=zone)["ResourceRecordSets"] if "Region" in r
    ]
    del rs["HealthCheckId"]
    r53.change_resource_record_sets(
        HostedZoneId=zone, ChangeBatch={"Changes": [{"Action": "UPSERT", "ResourceRecordSet": rs}]}
    )
    with pytest.raises(route53.Route53VerificationError, match="no health check"):
        _verify(zone, lb)


@mock_aws
def test_a_tcp_health_check_of_the_load_balancer_is_refused_a_hung_node_passes_it() -> None:
    zone, lb = region_dns(check="TCP")
    with pytest.raises(
        route53.Route53VerificationError, match="type 'TCP' passes while the region's gateway"
    ):
        _verify(zone, lb)


@mock_aws
def test_an_alarm_over_the_nodes_of_the_wrong_port_is_refused() -> None:
    zone, lb = region_dns(alarm_port=15671)
    with pytest.raises(
        route53.Route53VerificationError, match="counts the nodes of port 15671, expected 1883"
    ):
        _verify(zone, lb)


@mock_aws
def test_a_target_group_that_checks_its_nodes_with_a_tcp_connect_is_refused() -> None:
    zone, lb = region_dns(target_check="TCP")
    with pytest.raises(route53.Route53VerificationError, match="TCP connect, which a hung node's kernel"):
        _verify(zone, lb)


@mock_aws
def test_a_health_check_that_counts_no_data_as_healthy_is_refused() -> None:
    zone, lb = region_dns(no_data="Healthy")
    with pytest.raises(route53.Route53VerificationError, match="without data as healthy"):
        _verify(zone, lb)


@mock_aws
def test_a_health_check_whose_alarm_is_gone_is_refused() -> None:
    zone, lb = region_dns()
    boto3.client("cloudwatch", region_name="eu-west-1").delete_alarms(
        AlarmNames=["fedgate-eu-west-1-mqtt-healthy-nodes"]
    )
    with pytest.raises(route53.Route53VerificationError, match="does not exist in eu-west-1"):
        _verify(zone, lb)


@mock_aws
def test_a_missing_region_record_is_named() -> None:
    zone, lb = region_dns()
    with pytest.raises(route53.Route53VerificationError, match="set identifier 'us-east-1'"):
        _verify(zone, lb, set_identifier="us-east-1", aws_region="us-east-1")


def test_aws_regions_come_from_botocore_and_names_are_checked() -> None:
    assert {"eu-west-1", "us-east-1", "ap-southeast-2"} <= aws_regions()
    assert validate_aws_region("eu-central-1") == "eu-central-1"
    with pytest.raises(UnknownRegionError, match="did you mean"):
        validate_aws_region("eu-centrl-1")
    with pytest.raises(UnknownRegionError):
        validate_aws_region("mars-north-1")
    assert is_local("local-ap") and not is_local("eu-west-1")
