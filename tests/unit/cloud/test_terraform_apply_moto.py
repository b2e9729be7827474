"""The gateway-region example applied against a moto server: the resources a region needs exist,
the latency record has its health check, and a second plan shows no changes (~1 min)."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from infra.cloud import route53
from infra.cloud.driver import AWS_SERVICES
from infra.cloud.toolchain import Toolchain
from infra.local.tls import LocalCA

from .conftest import run_tf

pytestmark = [pytest.mark.terraform, pytest.mark.slow]

REGION = "eu-west-1"
DOMAIN = "fleet.example.com"
ADMIN_CIDR = "203.0.113.0/24"
BACKEND_CIDR = "198.51.100.10/32"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    moto_server = Path(sys.executable).with_name("moto_server")
    # moto[server] is a dev dependency `make setup` installs: missing, the install is broken
    assert moto_server.exists(), f"{moto_server} missing: run `make setup` (moto[server], pyproject.toml)"
    port = _free_port()
    proc = subprocess.Popen(
        [str(moto_server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start on {url}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(service: str, url: str) -> object:
    return boto3.client(
        service,
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def _override(url: str) -> str:
    endpoints = "\n".join(f'    {s} = "{url}"' for s in AWS_SERVICES)
    return f"""# written by the test: every AWS API goes to moto
provider "aws" {{
  region                      = "{REGION}"
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_requesting_account_id  = true
  skip_metadata_api_check     = true

  endpoints {{
{endpoints}
  }}
}}
"""


def test_gateway_region_example_applies_against_moto_and_replans_clean(
    toolchain: Toolchain, terraform_tree: Path, moto_url: str
) -> None:
    # a sibling of the example inside the copied tree, so that ../../modules resolves
    examples = terraform_tree / "infra" / "terraform" / "examples"
    example = examples / "gateway-region-moto"
    shutil.copytree(examples / "gateway-region", example, ignore=shutil.ignore_patterns(".terraform*"))
    (example / "moto_override.tf").write_text(_override(moto_url))
    # TLS on the nodes as `fedgate gateway add` sets it: a certificate from fedgate's CA
    cert = LocalCA(example / "tls").node_cert(f"gw-{REGION}", f"gw-{REGION}.{DOMAIN}")
    tls_vars = {
        "node_tls": {
            "ca_pem": cert.ca.read_text(),
            "cert_pem": cert.cert.read_text(),
            "server_name": f"gw-{REGION}.{DOMAIN}",
        },
        "node_tls_key_pem": cert.key.read_text(),
    }
    (example / "tls.auto.tfvars.json").write_text(json.dumps(tls_vars))

    ec2 = _client("ec2", moto_url)
    ami = ec2.describe_images()["Images"][0]["ImageId"]  # type: ignore[attr-defined]
    tf_vars = [
        f"-var=ami_id={ami}",
        f"-var=domain={DOMAIN}",
        f'-var=admin_cidr_blocks=["{ADMIN_CIDR}"]',
        f'-var=backend_cidr_blocks=["{BACKEND_CIDR}"]',
        "-var=admin_password=test-admin-pw",
        "-var=erlang_cookie=test-cookie",
    ]
    init = run_tf(toolchain, example, "init", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    t0 = time.monotonic()
    apply = run_tf(
        toolchain, example, "apply", "-auto-approve", "-input=false", "-no-color", *tf_vars, timeout=600
    )
    assert apply.returncode == 0, apply.stdout[-3000:] + apply.stderr
    print(f"apply against moto took {time.monotonic() - t0:.0f}s")

    out = run_tf(toolchain, example, "output", "-json", "-no-color")
    outputs = {k: v["value"] for k, v in json.loads(out.stdout).items()}

    # the VPC, spread over availability zones
    vpc = ec2.describe_vpcs(VpcIds=[outputs["vpc_id"]])["Vpcs"][0]  # type: ignore[attr-defined]
    assert vpc["CidrBlock"] == "10.40.0.0/16"
    subnets = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc["VpcId"]]}])["Subnets"]  # type: ignore[attr-defined]
    assert len({s["AvailabilityZone"] for s in subnets}) == 2

    # security groups: management only from the admin CIDR, AMQP only from/to the backend
    groups = {
        g["GroupName"]: g
        for g in ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc["VpcId"]]}])[  # type: ignore[attr-defined]
            "SecurityGroups"
        ]
    }
    gw = groups[f"fedgate-{REGION}-gateway"]
    by_port = {(r["FromPort"], r["ToPort"]): r for r in gw["IpPermissions"] if r["IpProtocol"] == "tcp"}
    assert [ip["CidrIp"] for ip in by_port[(15672, 15672)]["IpRanges"]] == [ADMIN_CIDR]
    assert [ip["CidrIp"] for ip in by_port[(5671, 5672)]["IpRanges"]] == [BACKEND_CIDR]
    amqp_egress = [r for r in gw["IpPermissionsEgress"] if r.get("FromPort") == 5671]
    assert [ip["CidrIp"] for r in amqp_egress for ip in r["IpRanges"]] == [BACKEND_CIDR]
    lb_sg = groups[f"fedgate-{REGION}-lb"]
    lb_ports = {(r["FromPort"], r["ToPort"]) for r in lb_sg["IpPermissions"]}
    assert {(1883, 1883), (8883, 8883), (5671, 5672)} == lb_ports

    # the gateway nodes: an autoscaling group of two
    asg = _client("autoscaling", moto_url).describe_auto_scaling_groups(  # type: ignore[attr-defined]
        AutoScalingGroupNames=[outputs["autoscaling_group_name"]]
    )["AutoScalingGroups"][0]
    # MQTT, AMQP, and passed-through AMQPS and MQTT over TLS
    assert asg["DesiredCapacity"] == 2 and len(asg["TargetGroupARNs"]) == 4

    # the nodes boot with the TLS listeners and the certificate files (cloud-init)
    template = ec2.describe_launch_template_versions(  # type: ignore[attr-defined]
        LaunchTemplateName=f"fedgate-{REGION}-gateway", Versions=["$Latest"]
    )["LaunchTemplateVersions"][0]
    user_data = base64.b64decode(template["LaunchTemplateData"]["UserData"]).decode()
    assert "listeners.ssl.1 = 0.0.0.0:5671" in user_data
    assert "mqtt.listeners.ssl.1 = 0.0.0.0:8883" in user_data
    assert "ssl_options.keyfile = /etc/rabbitmq/tls/key.pem" in user_data
    assert (
        "path: /etc/rabbitmq/tls/key.pem" in user_data or '"path": "/etc/rabbitmq/tls/key.pem"' in user_data
    )
    assert outputs["amqp_endpoint"] == {
        "host": outputs["lb_dns_name"],
        "port": 5671,
        "tls": True,
        "server_name": f"gw-{REGION}.{DOMAIN}",
    }

    # the network load balancer with an MQTT listener
    elb = _client("elbv2", moto_url)
    lb = elb.describe_load_balancers()["LoadBalancers"]  # type: ignore[attr-defined]
    lb = next(x for x in lb if x["DNSName"] == outputs["lb_dns_name"])
    assert lb["Type"] == "network"
    listeners = elb.describe_listeners(LoadBalancerArn=lb["LoadBalancerArn"])["Listeners"]  # type: ignore[attr-defined]
    assert {(x["Port"], x["Protocol"]) for x in listeners} == {
        (1883, "TCP"),
        (5672, "TCP"),
        (5671, "TCP"),
        (8883, "TCP"),
    }

    # the latency record and its health check, read back the way the driver verifies them
    rec, hc = route53.verify_region_record(
        _client("route53", moto_url),
        zone_id=outputs["zone_id"],
        hostname=outputs["mqtt_hostname"],
        set_identifier=REGION,
        aws_region=REGION,
        target=outputs["lb_dns_name"],
    )
    assert hc.id == outputs["route53_health_check_id"]

    # idempotent: a second plan shows no changes (exit code 0 of -detailed-exitcode)
    plan = run_tf(toolchain, example, "plan", "-detailed-exitcode", "-input=false", "-no-color", *tf_vars)
    assert plan.returncode == 0, plan.stdout[-4000:] + plan.stderr
