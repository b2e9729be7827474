"""Stand-ins at the process and HTTP boundaries: a fake terraform binary and a fake management API;
and, in moto, the latency record and health check the gateway-region module creates."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3

# A terraform that keeps its "infrastructure" in fake.state next to the root
# module: plan shows changes until an apply happened, apply of a destroy plan
# removes it, output -json prints what FAKE_TF_OUTPUTS holds.  Every call but `version` is
# logged to calls.log, one JSON argv per line.
FAKE_TERRAFORM = r"""#!PYTHON
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
cwd = Path.cwd()
# `version` runs wherever the driver checks the toolchain (the repository), not in a region folder
if args[:1] != ["version"]:
    with open(cwd / "calls.log", "a") as f:
        f.write(json.dumps(args) + "\n")
state = cwd / "fake.state"
if args[:1] == ["version"]:
    print("Terraform v1.11.4\non linux_amd64")
elif args[:1] == ["init"]:
    print("Terraform has been successfully initialized!")
elif args[:1] == ["plan"]:
    destroy = "-destroy" in args
    exists = state.exists()
    if destroy == exists:
        (cwd / "tfplan").write_text("destroy" if destroy else "create")
        print(("Plan: 0 to add, 0 to change, 23 to destroy." if destroy else
               "Plan: 23 to add, 0 to change, 0 to destroy."))
        sys.exit(2)
    print("No changes. Your infrastructure matches the configuration.")
elif args[:1] == ["apply"]:
    if (cwd / "tfplan").read_text() == "destroy":
        state.unlink()
    else:
        state.write_text("applied")
    print("Apply complete!")
elif args[:1] == ["output"]:
    print(os.environ["FAKE_TF_OUTPUTS"])
else:
    sys.exit(f"fake terraform: unexpected {args}")
"""


def write_fake_terraform(path: Path) -> Path:
    path.write_text(FAKE_TERRAFORM.replace("#!PYTHON", "#!" + sys.executable))
    path.chmod(0o755)
    return path


def terraform_calls(region_dir: Path) -> list[list[str]]:
    log = region_dir / "calls.log"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


class FakeManagementApi:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.url = ""

    def paths(self, method: str) -> list[str]:
        return [p for m, p, _ in self.requests if m == method]

    def body(self, method: str, path: str) -> Any:
        return next(b for m, p, b in self.requests if m == method and p == path)


@contextmanager
def fake_management_api() -> Iterator[FakeManagementApi]:
    api = FakeManagementApi()

    class Handler(BaseHTTPRequestHandler):
        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            api.requests.append((self.command, self.path, json.loads(raw) if raw else None))
            if self.command == "GET":
                body = b"[]"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(204)
                self.end_headers()

        do_GET = do_PUT = do_POST = do_DELETE = _handle

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()


def region_dns(
    zone_name: str = "fleet.example.com",
    *,
    region: str = "eu-west-1",
    record_region: str | None = None,
    hostname: str = "mqtt.fleet.example.com",
    check: str = "CLOUDWATCH_METRIC",
    alarm_port: int = 1883,
    target_check: str = "HTTP",
    no_data: str = "Unhealthy",
) -> tuple[str, str]:
    """(zone id, load balancer DNS name): what the gateway-region module creates, in moto (inside
    mock_aws) -- a network load balancer with the MQTT target group (its nodes checked over
    `target_check`) and a management one, an alarm over the target group on `alarm_port`'s
    healthy nodes, a health check of type `check` (CLOUDWATCH_METRIC on the alarm; else an
    endpoint check of the load balancer's 1883) and the region's latency record."""
    ec2, elbv2 = boto3.client("ec2", region_name=region), boto3.client("elbv2", region_name=region)
    vpc = ec2.create_vpc(CidrBlock="10.40.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.40.0.0/24")["Subnet"]["SubnetId"]
    lb = elbv2.create_load_balancer(Name=f"fedgate-{region}-gw", Subnets=[subnet], Type="network")
    lb_arn, lb_dns = lb["LoadBalancers"][0]["LoadBalancerArn"], lb["LoadBalancers"][0]["DNSName"]
    groups = {}
    for name, port, protocol in (("mqtt", 1883, target_check), ("mgmt", 15671, "TCP")):
        tg = elbv2.create_target_group(
            Name=f"fedgate-{region}-{name}",
            Protocol="TCP",
            Port=port,
            VpcId=vpc,
            HealthCheckProtocol=protocol,
            HealthCheckPort="15692" if protocol != "TCP" else str(port),
            **({"HealthCheckPath": "/metrics"} if protocol != "TCP" else {}),
        )["TargetGroups"][0]["TargetGroupArn"]
        elbv2.create_listener(
            LoadBalancerArn=lb_arn,
            Protocol="TCP",
            Port=port,
            DefaultActions=[{"Type": "forward", "TargetGroupArn": tg}],
        )
        groups[port] = tg
    alarm = f"fedgate-{region}-mqtt-healthy-nodes"
    boto3.client("cloudwatch", region_name=region).put_metric_alarm(
        AlarmName=alarm,
        Namespace="AWS/NetworkELB",
        MetricName="HealthyHostCount",
        Dimensions=[
            {"Name": "LoadBalancer", "Value": lb_arn.split(":loadbalancer/")[1]},
            {"Name": "TargetGroup", "Value": groups[alarm_port].split(":", 5)[5]},
        ],
        Statistic="Maximum",
        Period=60,
        EvaluationPeriods=1,
        Threshold=1,
        ComparisonOperator="LessThanThreshold",
        TreatMissingData="missing",
    )
    r53 = boto3.client("route53", region_name="us-east-1")
    zone = r53.create_hosted_zone(Name=zone_name, CallerReference="z")["HostedZone"]["Id"].split("/")[-1]
    config: dict[str, Any] = (
        {
            "Type": check,
            "AlarmIdentifier": {"Region": region, "Name": alarm},
            "InsufficientDataHealthStatus": no_data,
        }
        if check == "CLOUDWATCH_METRIC"
        else {"Type": check, "FullyQualifiedDomainName": lb_dns, "Port": 1883, "RequestInterval": 30}
    )
    hc = r53.create_health_check(CallerReference="hc", HealthCheckConfig=config)["HealthCheck"]["Id"]
    record = {
        "Name": hostname,
        "Type": "CNAME",
        "TTL": 60,
        "SetIdentifier": region,
        "Region": record_region or region,
        "HealthCheckId": hc,
        "ResourceRecords": [{"Value": lb_dns}],
    }
    r53.change_resource_record_sets(
        HostedZoneId=zone, ChangeBatch={"Changes": [{"Action": "CREATE", "ResourceRecordSet": record}]}
    )
    return zone, lb_dns
