"""The gateway-region example applied against a moto server: the resources a region needs exist,
the nodes boot Debian 13's RabbitMQ with the gateway's plugins, the latency record has its health
check, and a second plan shows no changes (~1 min)."""

from __future__ import annotations

import base64
import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

from infra.cloud import route53
from infra.cloud.toolchain import Toolchain
from infra.local.settings import PROJECT_ROOT
from infra.local.tls import LocalCA

from .conftest import TRIXIE_AMD64, moto_client, moto_override, run_tf

# an apply and two plans, the AWS provider's waits on moto among them: 195 s beside the
# other lanes of `make test` here, 65% of the default 300
pytestmark = [pytest.mark.terraform, pytest.mark.slow, pytest.mark.timeout(600)]

REGION = "eu-west-1"
DOMAIN = "fleet.example.com"
ADMIN_CIDR = "203.0.113.0/24"
BACKEND_CIDR = "198.51.100.10/32"


def test_gateway_region_example_applies_against_moto_and_replans_clean(
    toolchain: Toolchain, terraform_tree: Path, moto_url: str
) -> None:
    # a sibling of the example inside the copied tree, so that ../../modules resolves
    examples = terraform_tree / "infra" / "terraform" / "examples"
    example = examples / "gateway-region-moto"
    shutil.copytree(examples / "gateway-region", example, ignore=shutil.ignore_patterns(".terraform*"))
    (example / "moto_override.tf").write_text(moto_override(moto_url, REGION))
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

    ec2 = moto_client("ec2", moto_url, REGION)
    # no ami_id: the module looks up Debian 13 itself
    tf_vars = [
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
    # with node TLS the management API is reached over HTTPS (15671) only; the plain listener
    # is open to no one outside the node
    assert [ip["CidrIp"] for ip in by_port[(15671, 15671)]["IpRanges"]] == [ADMIN_CIDR]
    assert (15672, 15672) not in by_port
    assert [ip["CidrIp"] for ip in by_port[(5671, 5672)]["IpRanges"]] == [BACKEND_CIDR]
    lb_group_id = groups[f"fedgate-{REGION}-lb"]["GroupId"]
    # the load balancer's health checks reach RabbitMQ's Prometheus endpoint, nobody else does
    assert [g["GroupId"] for g in by_port[(15692, 15692)]["UserIdGroupPairs"]] == [lb_group_id]
    assert by_port[(15692, 15692)]["IpRanges"] == []
    amqp_egress = [r for r in gw["IpPermissionsEgress"] if r.get("FromPort") == 5671]
    assert [ip["CidrIp"] for r in amqp_egress for ip in r["IpRanges"]] == [BACKEND_CIDR]
    lb_sg = groups[f"fedgate-{REGION}-lb"]
    lb_ports = {(r["FromPort"], r["ToPort"]) for r in lb_sg["IpPermissions"]}
    assert {(1883, 1883), (8883, 8883), (5671, 5672), (15671, 15671)} == lb_ports
    # the management API through the load balancer: the backend (its routers) and operators only
    mgmt = next(r for r in lb_sg["IpPermissions"] if r["FromPort"] == 15671)
    assert sorted(ip["CidrIp"] for ip in mgmt["IpRanges"]) == sorted([BACKEND_CIDR, ADMIN_CIDR])
    assert outputs["management_url"] == f"https://{outputs['lb_dns_name']}:15671"

    # the gateway nodes: an autoscaling group of three (a majority survives the loss of one)
    asg = moto_client("autoscaling", moto_url, REGION).describe_auto_scaling_groups(  # type: ignore[attr-defined]
        AutoScalingGroupNames=[outputs["autoscaling_group_name"]]
    )["AutoScalingGroups"][0]
    # MQTT, AMQP, the management API, and passed-through AMQPS and MQTT over TLS
    assert asg["DesiredCapacity"] == 3 and len(asg["TargetGroupARNs"]) == 5

    # the nodes boot with the TLS listeners and the certificate files (cloud-init)
    template = ec2.describe_launch_template_versions(  # type: ignore[attr-defined]
        LaunchTemplateName=f"fedgate-{REGION}-gateway", Versions=["$Latest"]
    )["LaunchTemplateVersions"][0]
    # Debian 13 from Debian's account, the newest amd64 build (t3.small), not a look-alike
    assert template["LaunchTemplateData"]["ImageId"] == TRIXIE_AMD64
    user_data = base64.b64decode(template["LaunchTemplateData"]["UserData"]).decode()
    cloud_config = yaml.safe_load(user_data)
    assert user_data.startswith("#cloud-config\n") and cloud_config["packages"] == [
        "ca-certificates",
        "curl",
        "rabbitmq-server",
    ]
    # the node reads its private address with an IMDSv2 token (the node name's address)
    metadata = template["LaunchTemplateData"]["MetadataOptions"]
    assert metadata["HttpTokens"] == "required" and metadata["HttpEndpoint"] == "enabled"
    files = {f["path"]: f["content"] for f in cloud_config["write_files"]}
    # the plugins of a local gateway node, plus peer discovery
    local_plugins = (PROJECT_ROOT / "gateways" / "templates" / "enabled_plugins").read_text().strip()
    assert files["/etc/rabbitmq/enabled_plugins"] == local_plugins.replace(
        "].", ",rabbitmq_peer_discovery_aws].\n"
    )
    assert "cluster_formation.peer_discovery_backend = aws" in files["/etc/rabbitmq/rabbitmq.conf"]
    # the same emulator flags and statistics setting as a local gateway node
    local_erl_args = (PROJECT_ROOT / "gateways" / "templates" / "erl_args").read_text().strip()
    env = [line for line in files["/etc/rabbitmq/rabbitmq-env.conf"].splitlines() if not line.startswith("#")]
    assert env[0] == f'SERVER_ADDITIONAL_ERL_ARGS="{local_erl_args}"'
    # the gateway's authentication backend: its source on the node, compiled there before
    # the broker starts, into a folder first in the plugins path (gateways/node.py plugin_sources)
    plugin = PROJECT_ROOT / "gateways" / "mqtt_auth_plugin"
    assert env[1].startswith('PLUGINS_DIR="/usr/local/lib/fedgate/rabbitmq-plugins:')
    # the node's name comes at boot (test_rabbitmq_nodes_boot.py), not from Terraform
    assert len(env) == 2
    assert (
        files["/usr/local/src/fedgate/fedgate_mqtt_auth/fedgate_mqtt_auth.erl"]
        == (plugin / "src" / "fedgate_mqtt_auth.erl").read_text()
    )
    app = "/usr/local/lib/fedgate/rabbitmq-plugins/fedgate_mqtt_auth-1.0.0/ebin/fedgate_mqtt_auth.app"
    assert files[app] == (plugin / "fedgate_mqtt_auth.app").read_text()
    compile_at = next(i for i, cmd in enumerate(cloud_config["runcmd"]) if "erlc" in " ".join(cmd))
    assert compile_at < len(cloud_config["runcmd"]) - 1, "compiled before the broker starts"
    assert "auth_backends.1.authn = fedgate_mqtt_auth" in files["/etc/rabbitmq/rabbitmq.conf"]
    assert (
        "deprecated_features.permit.management_metrics_collection = false"
        in files["/etc/rabbitmq/rabbitmq.conf"]
    )
    # the broker starts only as the 4.0 release, after the cluster's cookie and config are in place
    start = cloud_config["runcmd"][-1]
    assert start[:2] == ["sh", "-c"] and "4.0.*) systemctl start rabbitmq-server" in start[2]
    assert "listeners.ssl.1 = 0.0.0.0:5671" in user_data
    assert "mqtt.listeners.ssl.1 = 0.0.0.0:8883" in user_data
    assert "ssl_options.keyfile = /etc/rabbitmq/tls/key.pem" in user_data
    assert "management.ssl.port = 15671" in user_data
    assert "management.ssl.certfile = /etc/rabbitmq/tls/cert.pem" in user_data
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
    elb = moto_client("elbv2", moto_url, REGION)
    lb = elb.describe_load_balancers()["LoadBalancers"]  # type: ignore[attr-defined]
    lb = next(x for x in lb if x["DNSName"] == outputs["lb_dns_name"])
    assert lb["Type"] == "network"
    listeners = elb.describe_listeners(LoadBalancerArn=lb["LoadBalancerArn"])["Listeners"]  # type: ignore[attr-defined]
    assert {(x["Port"], x["Protocol"]) for x in listeners} == {
        (1883, "TCP"),
        (5672, "TCP"),
        (5671, "TCP"),
        (8883, "TCP"),
        (15671, "TCP"),
    }

    # MQTT's nodes checked over HTTP on /metrics, which a hung node's VM does not answer
    groups_of_lb = elb.describe_target_groups(LoadBalancerArn=lb["LoadBalancerArn"])["TargetGroups"]  # type: ignore[attr-defined]
    checks = {
        g["Port"]: (g["HealthCheckProtocol"], g["HealthCheckPort"], g.get("HealthCheckPath"))
        for g in groups_of_lb
    }
    assert checks[1883] == checks[8883] == ("HTTP", "15692", "/metrics")

    # the latency record and its health check, read back the way the driver verifies them: a
    # CLOUDWATCH_METRIC check on the alarm over the MQTT target group's healthy nodes
    rec, hc = route53.verify_region_record(
        moto_client("route53", moto_url, REGION),
        zone_id=outputs["zone_id"],
        hostname=outputs["mqtt_hostname"],
        set_identifier=REGION,
        aws_region=REGION,
        target=outputs["lb_dns_name"],
        regional=lambda service: moto_client(service, moto_url, REGION),
    )
    assert hc.id == outputs["route53_health_check_id"]
    assert (hc.type, hc.insufficient_data_status) == ("CLOUDWATCH_METRIC", "Unhealthy")

    # idempotent: a second plan shows no changes (exit code 0 of -detailed-exitcode)
    plan = run_tf(toolchain, example, "plan", "-detailed-exitcode", "-input=false", "-no-color", *tf_vars)
    assert plan.returncode == 0, plan.stdout[-4000:] + plan.stderr


def test_backend_example_plans_against_moto_with_debian_13_nodes_and_the_backend_plugins(
    toolchain: Toolchain, terraform_tree: Path, moto_url: str
) -> None:
    examples = terraform_tree / "infra" / "terraform" / "examples"
    example = examples / "backend-moto"
    shutil.copytree(examples / "backend", example, ignore=shutil.ignore_patterns(".terraform*"))
    (example / "moto_override.tf").write_text(moto_override(moto_url, "eu-central-1"))
    init = run_tf(toolchain, example, "init", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    tf_vars = [
        "-var=analytics_bucket_name=fedgate-test",
        "-var=admin_password=pw",
        "-var=erlang_cookie=c",
        "-var=kafka_sasl_password=k",
    ]
    plan = run_tf(toolchain, example, "plan", "-input=false", "-no-color", "-out=tfplan", *tf_vars)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    shown = run_tf(toolchain, example, "show", "-json", "-no-color", "tfplan")
    nodes = next(
        m
        for m in json.loads(shown.stdout)["planned_values"]["root_module"]["child_modules"][0][
            "child_modules"
        ]
        if m["address"] == "module.backend.module.nodes"
    )
    template = next(r for r in nodes["resources"] if r["type"] == "aws_launch_template")["values"]
    assert template["image_id"] == TRIXIE_AMD64  # m6i.large
    cloud_config = yaml.safe_load(base64.b64decode(template["user_data"]).decode())
    files = {f["path"]: f["content"] for f in cloud_config["write_files"]}
    local_plugins = (PROJECT_ROOT / "backend" / "templates" / "enabled_plugins").read_text().strip()
    assert files["/etc/rabbitmq/enabled_plugins"] == local_plugins.replace(
        "].", ",rabbitmq_peer_discovery_aws].\n"
    )
    assert "cluster_name = fedgate-backend" in files["/etc/rabbitmq/rabbitmq.conf"]
    # no emulator flags or plugins of its own: only the node name, added at boot
    env = files["/etc/rabbitmq/rabbitmq-env.conf"]
    assert [line for line in env.splitlines() if not line.startswith("#")] == []
    conf = files["/etc/rabbitmq/rabbitmq.conf"]
    assert "quorum_queue.continuous_membership_reconciliation.target_group_size = 3" in conf

    # Kafka: every partition on 3 brokers, 2 of them in sync for a write to count
    kafka_config = next(
        r
        for r in json.loads(shown.stdout)["planned_values"]["root_module"]["child_modules"][0]["resources"]
        if r["address"] == "module.backend.aws_msk_configuration.this[0]"
    )["values"]
    properties = dict(
        (k.strip(), v.strip())
        for k, v in (
            line.split("=", 1) for line in kafka_config["server_properties"].splitlines() if "=" in line
        )
    )
    assert properties["default.replication.factor"] == "3"
    assert properties["min.insync.replicas"] == "2"
    assert properties["auto.create.topics.enable"] == "false"
    assert kafka_config["kafka_versions"] == ["3.6.0"]

    # clients log in: SASL/SCRAM over TLS only, the user fedgate from an AmazonMSK_ secret
    backend_resources = {
        r["address"]: r.get("values", {})
        for r in json.loads(shown.stdout)["planned_values"]["root_module"]["child_modules"][0]["resources"]
    }
    cluster = backend_resources["module.backend.aws_msk_cluster.this[0]"]
    assert cluster["client_authentication"][0]["sasl"][0]["scram"] is True
    assert cluster["client_authentication"][0]["unauthenticated"] is False
    assert cluster["encryption_info"][0]["encryption_in_transit"][0]["client_broker"] == "TLS"
    secret = backend_resources["module.backend.aws_secretsmanager_secret.kafka_user[0]"]
    assert secret["name"].startswith("AmazonMSK_")
    assert json.loads(backend_resources["module.backend.aws_secretsmanager_secret_version.kafka_user[0]"][
        "secret_string"
    ]) == {"username": "fedgate", "password": "k"}  # fmt: skip
    assert "module.backend.aws_msk_scram_secret_association.this[0]" in backend_resources
