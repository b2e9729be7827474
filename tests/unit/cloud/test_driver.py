"""The cloud driver's flow, with terraform faked at the process boundary, AWS by moto and the
backend's management API by a local HTTP stand-in."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import boto3
import pytest
from moto import mock_aws

from infra.cloud.driver import CloudDriver, CloudError
from infra.cloud.toolchain import Toolchain
from infra.local.settings import load_settings

from .fakes import fake_management_api, region_dns, terraform_calls, write_fake_terraform

REGION = "eu-west-1"
#: the load balancer fakes.region_dns creates, named as moto names it
LB = "fedgate-eu-west-1-gw-1.eu-west-1.elb.amazonaws.com"
HOSTNAME = "mqtt.fleet.example.com"
GW_NAME = f"gw-{REGION}.fleet.example.com"


def _dns(zone_name: str = "fleet.example.com", *, region: str = REGION) -> str:
    """What the gateway-region module would have created: a latency record with a health check
    that follows the load balancer's healthy nodes (LB, as moto names it)."""
    zone, lb = region_dns(zone_name, region=REGION, record_region=region, hostname=HOSTNAME)
    assert lb == LB
    return zone


def _outputs() -> str:
    values = {
        "region": REGION,
        "aws_region": REGION,
        "lb_dns_name": LB,
        "mqtt_hostname": HOSTNAME,
        "autoscaling_group_name": "fedgate-eu-west-1-gateway",
        # with node_tls, as fedgate applies the module
        "amqp_endpoint": {"host": LB, "port": 5671, "tls": True, "server_name": GW_NAME},
        "mqtt_endpoint": {"host": LB, "port": 1883, "tls_port": None},
        "management_url": f"https://{LB}:15671",  # the module's, with node TLS
    }
    return json.dumps({k: {"sensitive": False, "type": "string", "value": v} for k, v in values.items()})


def _driver(
    tmp_path: Path, zone_id: str, backend_url: str = "", confirm: bool = False, **kw: object
) -> CloudDriver:
    values: dict[str, object] = {"terraform_bin": str(write_fake_terraform(tmp_path / "terraform")), **kw}
    settings = load_settings(
        env={},
        cloud_state_dir=tmp_path / "tf-state",
        cache_dir=tmp_path / "cache",
        cloud_domain="fleet.example.com",
        cloud_zone_id=zone_id,
        cloud_admin_cidrs="203.0.113.0/24",
        cloud_backend_cidrs="198.51.100.10/32",
        cloud_backend_amqp_host="backend.fleet.example.com",
        cloud_backend_management_url=backend_url,
        # the settings' default (2) is below what the gateway-region module accepts
        cloud_node_count=3,
        **values,
    )
    return CloudDriver(settings, progress=lambda m: None, confirm=lambda prompt: confirm)


@pytest.fixture
def fake_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TF_OUTPUTS", _outputs())


def _verbs(calls: list[list[str]]) -> list[str]:
    return [c[0] for c in calls]


@mock_aws
def test_add_applies_once_records_outputs_registers_the_region_and_a_rerun_changes_nothing(
    tmp_path: Path, aws_env: None, fake_outputs: None
) -> None:
    zone = _dns()
    with fake_management_api() as api:
        driver = _driver(tmp_path, zone, api.url)
        printed: list[str] = []
        rec = driver.add(REGION, auto_approve=True, plan_out=printed.append)
        region_dir = tmp_path / "tf-state" / REGION
        assert _verbs(terraform_calls(region_dir)) == ["init", "plan", "apply", "output"]
        assert "23 to add" in printed[0]
        assert rec.registered and rec.state == "applied"
        recorded = json.loads((region_dir / "outputs.json").read_text())
        assert recorded["outputs"]["lb_dns_name"] == LB

        # the backend now pulls from the region's load balancer and holds its downlink exchange
        upstream = api.body("PUT", f"/api/parameters/federation-upstream/%2F/gw-{REGION}")
        # over AMQPS: the backend node checks the gateway's certificate and its name
        assert upstream["value"]["uri"].startswith("amqps://fedgate-backend:")
        assert upstream["value"]["uri"].endswith(
            f"@{LB}:5671?cacertfile=/etc/rabbitmq/tls/ca.pem&verify=verify_peer&server_name_indication={GW_NAME}"
        )
        assert f"/api/exchanges/%2F/{quote('fedgate.downlink.' + REGION)}" in api.paths("PUT")
        assert api.body("PUT", "/api/parameters/federation-upstream-set/%2F/fedgate-uplink")["value"] == [
            {"upstream": f"gw-{REGION}", "exchange": "amq.topic"}
        ]
        # the routers' user, with the password the backend module gives the deployed routers
        assert api.body("PUT", "/api/users/fedgate-router")["password"] == driver.secrets()["router"]
        # and the region where the running routers read it: its gateways' management API, through
        # their monitoring user (never the gateways' administrator), which the region's
        # definitions hold from its first boot
        assert api.body("PUT", f"/api/global-parameters/fedgate-region.{REGION}")["value"] == {
            "management_url": [f"https://{LB}:15671"],
            "user": "fedgate-router",
            "password": driver.secrets()["router_gateways"],
            # over HTTPS: the routers check the gateway's certificate against the nodes' CA
            "ca_pem": driver.ca.ca_cert.read_text(),
            "server_name": GW_NAME,
        }
        assert driver.secrets()["router_gateways"] != driver.secrets()["admin"]
        definitions = json.loads(driver.root_module(REGION)["module"]["gateway"]["rabbitmq_definitions"])
        router_user = next(u for u in definitions["users"] if u["name"] == "fedgate-router")
        assert router_user["tags"] == "monitoring"

        # idempotent: the second run plans no changes and applies nothing
        printed.clear()
        driver.add(REGION, auto_approve=False, plan_out=printed.append)
        assert _verbs(terraform_calls(region_dir)).count("apply") == 1
        assert printed == []

    # the root module carries the region's passwords: only its owner may read it
    assert stat.S_IMODE((region_dir / "main.tf.json").stat().st_mode) == 0o600


@mock_aws
def test_a_plan_that_is_not_confirmed_is_not_applied(
    tmp_path: Path, aws_env: None, fake_outputs: None
) -> None:
    driver = _driver(tmp_path, _dns(), confirm=False)
    with pytest.raises(CloudError, match="plan not applied"):
        driver.add(REGION)
    assert "apply" not in _verbs(terraform_calls(tmp_path / "tf-state" / REGION))


@mock_aws
def test_a_confirmed_plan_is_applied(tmp_path: Path, aws_env: None, fake_outputs: None) -> None:
    driver = _driver(tmp_path, _dns(), confirm=True)
    rec = driver.add(REGION, plan_out=lambda s: None)
    assert rec.state == "applied" and not rec.registered  # no backend configured
    assert [r.region for r in driver.regions()] == [REGION]


@mock_aws
def test_a_latency_record_in_the_wrong_region_fails_the_add(
    tmp_path: Path, aws_env: None, fake_outputs: None
) -> None:
    driver = _driver(tmp_path, _dns(region="us-east-1"))
    with pytest.raises(CloudError, match="latency region is 'us-east-1', expected 'eu-west-1'"):
        driver.add(REGION, auto_approve=True, plan_out=lambda s: None)


@mock_aws
def test_remove_deregisters_destroys_and_forgets_the_region(
    tmp_path: Path, aws_env: None, fake_outputs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("infra.cloud.fleet.ROUTERS_POLL_MARGIN_S", 0.0)
    zone = _dns()
    with fake_management_api() as api:
        driver = _driver(tmp_path, zone, api.url)
        driver.add(REGION, auto_approve=True, plan_out=lambda s: None)
        calls_before = len(terraform_calls(tmp_path / "tf-state" / REGION))
        api.requests.clear()
        destroy_calls: list[list[str]] = []

        def keep_calls(msg: str) -> None:
            destroy_calls.extend(terraform_calls(tmp_path / "tf-state" / REGION)[calls_before:])

        driver.remove(REGION, auto_approve=True, plan_out=keep_calls)
        deleted = api.paths("DELETE")
        # the routers forget the region before its downlink exchange goes
        registry = deleted.index(f"/api/global-parameters/fedgate-region.{REGION}")
        assert registry < deleted.index(f"/api/exchanges/%2F/{quote('fedgate.downlink.' + REGION)}")
        assert f"/api/parameters/federation-upstream/%2F/gw-{REGION}" in api.paths("DELETE")
        assert f"/api/users/gw-{REGION}" in api.paths("DELETE")
        # it was the last cloud region: the upstream sets go too
        assert "/api/parameters/federation-upstream-set/%2F/fedgate-uplink" in api.paths("DELETE")
    assert any(c[0] == "plan" and "-destroy" in c for c in destroy_calls)
    assert not (tmp_path / "tf-state" / REGION).exists()
    assert driver.regions() == []
    assert REGION not in driver.secrets().get("gateways", {})


def test_an_unknown_aws_region_is_refused_with_the_closest_names(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "Z1")
    with pytest.raises(CloudError, match=r"'eu-west-9' is not an AWS region; did you mean eu-west-\d"):
        driver.add("eu-west-9")
    assert not (tmp_path / "tf-state" / "eu-west-9").exists()


def test_missing_terraform_is_named(tmp_path: Path, aws_env: None) -> None:
    driver = _driver(tmp_path, "Z1", terraform_bin=str(tmp_path / "no-such-terraform"))
    with pytest.raises(CloudError, match="terraform not installed"):
        driver.add(REGION)


def test_terraform_runs_with_a_lazier_go_collector_unless_the_operator_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toolchain = Toolchain(Path("/usr/bin/terraform"), "1.11.4", None, tmp_path / "terraformrc")
    monkeypatch.delenv("GOGC", raising=False)
    assert toolchain.env()["GOGC"] == "400", "the AWS provider's schemas are rebuilt at each start"
    monkeypatch.setenv("GOGC", "150")
    assert toolchain.env()["GOGC"] == "150"


def test_missing_credentials_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(CloudError, match="no AWS credentials"):
        _driver(tmp_path, "Z1").add(REGION)


def test_missing_cloud_settings_are_named(tmp_path: Path, aws_env: None) -> None:
    driver = _driver(tmp_path, "")
    with pytest.raises(CloudError, match="FEDGATE_CLOUD_ZONE_ID"):
        driver.add(REGION)


def test_the_root_module_points_every_aws_api_at_the_override_and_loads_the_gateway_definitions(
    tmp_path: Path,
) -> None:
    driver = _driver(tmp_path, "Z1", aws_endpoint_url="http://127.0.0.1:5999")
    root = driver.root_module(REGION)
    provider = root["provider"]["aws"]
    assert set(provider["endpoints"].values()) == {"http://127.0.0.1:5999"}
    assert {"ec2", "elbv2", "autoscaling", "iam", "route53"} <= set(provider["endpoints"])
    assert provider["skip_requesting_account_id"] is True
    module = root["module"]["gateway"]
    assert module["mqtt_hostname"] == HOSTNAME
    definitions = json.loads(module["rabbitmq_definitions"])
    upstream = next(p for p in definitions["parameters"] if p["component"] == "federation-upstream")
    # the gateway's downlink link pulls only its own region's exchange from the backend
    assert upstream["value"]["exchange"] == f"fedgate.downlink.{REGION}"
    # over AMQPS, checking the backend's certificate for backend.<domain>
    assert upstream["value"]["uri"].endswith(
        "@backend.fleet.example.com:5671?cacertfile=/etc/rabbitmq/tls/ca.pem&verify=verify_peer"
        "&server_name_indication=backend.fleet.example.com"
    )
    assert definitions["global_parameters"] == [{"name": "cluster_name", "value": REGION}]
    # the nodes run Debian 13's RabbitMQ, the release of the local nodes; no AMI pinned by default
    assert definitions["rabbit_version"] == "4.0.5"
    assert "ami_id" not in module
    assert set(root["output"]) >= {"lb_dns_name", "amqp_endpoint", "route53_health_check_id"}
    # the nodes' certificate for gw-<region>.<domain>, from the CA kept beside the cloud state
    tls = module["node_tls"]
    assert tls["server_name"] == GW_NAME
    assert tls["ca_pem"] == (tmp_path / "tf-state" / "tls" / "ca.pem").read_text()
    assert module["node_tls_key_pem"].startswith("-----BEGIN PRIVATE KEY-----")
    (tmp_path / "node.pem").write_text(tls["cert_pem"])
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "tf-state" / "tls" / "ca.pem"),
         "-verify_hostname", GW_NAME, str(tmp_path / "node.pem")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stderr
    assert driver.root_module(REGION)["module"]["gateway"]["node_tls"] == tls, "issued once, then reused"


def test_the_backend_tls_file_holds_a_certificate_for_backend_dot_domain(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "Z1")
    path = driver.write_backend_tls()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    tfvars = json.loads(path.read_text())
    assert tfvars["node_tls"]["server_name"] == "backend.fleet.example.com"
    assert tfvars["node_tls_key_pem"].startswith("-----BEGIN PRIVATE KEY-----")
    # the passwords the backend module deploys the routers with, generated once
    secrets = driver.write_backend_secrets()
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    values = json.loads(secrets.read_text())
    assert values == {
        "router_password": driver.secrets()["router"],
        "kafka_sasl_password": driver.secrets()["kafka_client"],
        "catalog_password": driver.secrets()["catalog"],
    }
    assert len(values["router_password"]) >= 20 and values == json.loads(
        driver.write_backend_secrets().read_text()
    )


def test_without_tls_the_root_module_has_no_node_tls_and_links_are_plain(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "Z1", tls=False, cloud_backend_amqp_port=5672)
    module = driver.root_module(REGION)["module"]["gateway"]
    assert "node_tls" not in module
    definitions = json.loads(module["rabbitmq_definitions"])
    upstream = next(p for p in definitions["parameters"] if p["component"] == "federation-upstream")
    assert upstream["value"]["uri"].startswith("amqp://") and upstream["value"]["uri"].endswith(":5672")


@mock_aws
def test_device_changes_reach_every_applied_region_and_an_unreachable_one_is_named(
    tmp_path: Path, aws_env: None, fake_outputs: None
) -> None:
    from backend.devices import device_users, password_hash
    from backend.rabbitmq_admin import RabbitAdmin

    driver = _driver(tmp_path, _dns(), confirm=True)
    driver.add(REGION, plan_out=lambda s: None)
    with fake_management_api() as api:
        driver.gateway_admin = lambda rec: RabbitAdmin(api.url, "fedgate-admin", "pw")  # type: ignore[method-assign]
        assert driver.push_devices(device_users({"pump-1": password_hash("s")}), ["pump-0"]).failed == {}
        imported = api.body("POST", "/api/definitions")
        assert [u["name"] for u in imported["users"]] == ["pump-1"]
        assert "/api/users/pump-0" in api.paths("DELETE")

        # sync: the registry's devices in, a device user the registry no longer has out
        api.requests.clear()
        assert driver.sync_devices({"pump-1": password_hash("s")}).failed == {}
        assert [u["name"] for u in api.body("POST", "/api/definitions")["users"]] == ["pump-1"]

    def unreachable(rec: object) -> RabbitAdmin:
        return RabbitAdmin("http://127.0.0.1:9", "fedgate-admin", "pw", timeout=1)

    driver.gateway_admin = unreachable  # type: ignore[method-assign]
    failed = driver.push_devices(None, ["pump-1"]).failed
    assert list(failed) == [REGION] and "Connection refused" in failed[REGION]


@mock_aws
def test_the_gateway_admin_is_a_node_of_the_regions_autoscaling_group(tmp_path: Path, aws_env: None) -> None:
    from infra.cloud.driver import CloudRegion

    ec2 = boto3.client("ec2", region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.40.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.40.0.0/24")["Subnet"]["SubnetId"]
    ami = ec2.describe_images()["Images"][0]["ImageId"]
    ec2.create_launch_template(LaunchTemplateName="gw-template", LaunchTemplateData={"ImageId": ami})
    boto3.client("autoscaling", region_name=REGION).create_auto_scaling_group(
        AutoScalingGroupName="fedgate-eu-west-1-gateway",
        LaunchTemplate={"LaunchTemplateName": "gw-template"},
        MinSize=2,
        MaxSize=2,
        VPCZoneIdentifier=subnet,
    )
    rec = CloudRegion(
        REGION,
        "applied",
        {"aws_region": REGION, "autoscaling_group_name": "fedgate-eu-west-1-gateway"},
        True,
        0,
    )
    admin = _driver(tmp_path, "Z1").gateway_admin(rec)
    host = admin.base_url.removeprefix("http://").rsplit(":", 1)
    assert host[1] == "15672"
    instances = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    assert host[0] in {i.get("PublicIpAddress") or i["PrivateIpAddress"] for i in instances}


def test_cli_names_an_unknown_region_and_missing_terraform(tmp_path: Path) -> None:
    import os
    import subprocess

    from infra.local.settings import PROJECT_ROOT

    env = {
        **os.environ,
        "FEDGATE_CLOUD_STATE_DIR": str(tmp_path),
        "FEDGATE_TERRAFORM_BIN": str(tmp_path / "missing"),
        "PYTHONPATH": str(PROJECT_ROOT),
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fedgate.cli", *args],
            cwd=PROJECT_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = cli("gateway", "add", "us-east-7")
    assert out.returncode == 1 and "'us-east-7' is not an AWS region" in out.stderr
    out = cli("gateway", "add", "eu-west-1", "--auto-approve")
    assert out.returncode == 1 and "terraform not installed" in out.stderr
