"""The backend module's routers, applied against moto: the router.toml the module renders and
the secret it keeps are what a router loads at start (router/settings.py), and the routers'
network path is the internal load balancer admitted by the nodes' security group only.
(~1 min; Kafka is "your own" here: moto applies no MSK cluster.)"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import yaml

from infra.cloud.toolchain import Toolchain
from infra.local.settings import PROJECT_ROOT
from router.settings import load_router_settings
from spark.settings import SparkSettings

from .conftest import TERRAFORM_DIR, moto_client, moto_override, run_tf

# the backend example applied, ~80 s of it the AWS provider's own waits on moto (RDS's
# instance 81 s, the load balancers' 60 s): 174 s beside the other lanes here
pytestmark = [pytest.mark.terraform, pytest.mark.slow, pytest.mark.timeout(600)]

REGION = "eu-central-1"
ROOT_MODULE = """# written by the test: the backend module with its routers, Kafka of our own
resource "aws_s3_bucket" "releases" {
  bucket = "fedgate-test-releases"
}

resource "aws_s3_object" "release" {
  bucket  = aws_s3_bucket.releases.bucket
  key     = "fedgate/fedgate-0.1.0-py3-none-any.whl"
  content = "a wheel"
}

resource "aws_s3_object" "jars" {
  bucket  = aws_s3_bucket.releases.bucket
  key     = "fedgate/fedgate-spark-jars-0.1.0.tar.gz"
  content = "jars"
}

module "backend" {
  source = "../modules/backend"

  analytics_bucket_name  = "fedgate-test-analytics"
  admin_cidr_blocks      = ["203.0.113.0/24"]
  gateway_cidr_blocks    = ["0.0.0.0/0"]
  admin_password         = "admin pw"
  erlang_cookie          = "cookie"
  rabbitmq_conf_template = file("${path.module}/rabbitmq.conf")
  enabled_plugins        = file("${path.module}/enabled_plugins")
  tls_conf_template      = file("${path.module}/tls.conf")
  ami_id                 = "ami-0de13a0d64000002"
  create_kafka           = false
  kafka_bootstrap        = "kafka-1.example:9096,kafka-2.example:9096"
  fedgate_release = {
    bucket   = aws_s3_object.release.bucket
    key      = aws_s3_object.release.key
    jars_key = aws_s3_object.jars.key
  }
  catalog_password            = "catalog pw"
  catalog_multi_az            = false
  catalog_deletion_protection = false
  router_password        = "router/pw@1"
  kafka_sasl_password    = "kafka pw"
  router_config_extra    = "kafka_partitions = 12"
}
"""


def _service_boot(ec2, template_name: str, moto_url: str) -> tuple[dict, dict, list[str]]:
    """A fedgate-service launch template's files, the environment its secret holds (from moto),
    and its installer's command line."""
    (template,) = ec2.describe_launch_templates(LaunchTemplateNames=[template_name])["LaunchTemplates"]
    data = ec2.describe_launch_template_versions(LaunchTemplateId=template["LaunchTemplateId"])[
        "LaunchTemplateVersions"
    ][0]["LaunchTemplateData"]
    cloud_config = yaml.safe_load(base64.b64decode(data["UserData"]).decode())
    files = {f["path"]: f["content"] for f in cloud_config["write_files"]}
    install = cloud_config["runcmd"][0]
    secret_arn = install[install.index("--secret-arn") + 1]
    secret = moto_client("secretsmanager", moto_url, REGION).get_secret_value(SecretId=secret_arn)
    return files, json.loads(secret["SecretString"]), install


def test_the_routers_and_the_spark_job_load_the_config_and_secret_the_module_gives_them(
    toolchain: Toolchain, tmp_path: Path, moto_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules = tmp_path / "modules"
    shutil.copytree(TERRAFORM_DIR / "modules", modules, ignore=shutil.ignore_patterns(".terraform*"))
    root = tmp_path / "root"
    root.mkdir()
    (root / "main.tf").write_text(ROOT_MODULE)
    (root / "moto_override.tf").write_text(moto_override(moto_url, REGION))
    for name, src in (
        ("rabbitmq.conf", "backend/templates/rabbitmq.conf"),
        ("enabled_plugins", "backend/templates/enabled_plugins"),
        ("tls.conf", "gateways/templates/tls.conf"),
    ):
        shutil.copyfile(PROJECT_ROOT / src, root / name)
    init = run_tf(toolchain, root, "init", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    apply = run_tf(toolchain, root, "apply", "-auto-approve", "-input=false", "-no-color", timeout=600)
    assert apply.returncode == 0, apply.stdout[-4000:] + apply.stderr

    # the routers' launch template: their router.toml, and the secret they read at boot
    ec2 = moto_client("ec2", moto_url, REGION)
    files, env, _ = _service_boot(ec2, "fedgate-backend-router", moto_url)
    toml = tmp_path / "router.toml"
    toml.write_text(files["/etc/fedgate/router.toml"])
    assert "pw" not in files["/etc/fedgate/router.toml"]  # no password in the launch template

    elbv2 = moto_client("elbv2", moto_url, REGION)
    (lb,) = elbv2.describe_load_balancers(Names=["fedgate-backend-int"])["LoadBalancers"]
    settings = load_router_settings(toml, env={**env, "FEDGATE_ROUTER_ROUTER_ID": "router-i-0abc"})
    # the router's user, its password URL-quoted, through the internal load balancer
    assert settings.amqp_url == f"amqp://fedgate-router:router%2Fpw%401@{lb['DNSName']}:5672/%2F"
    assert settings.kafka_bootstrap == "kafka-1.example:9096,kafka-2.example:9096"
    assert settings.kafka_security.librdkafka() == {
        "security.protocol": "sasl_ssl",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "fedgate",
        "sasl.password": "kafka pw",
    }
    assert settings.kafka_replication == 3 and settings.kafka_partitions == 12
    assert settings.backend_management is not None
    assert settings.backend_management.management_urls == (f"http://{lb['DNSName']}:15672",)
    assert settings.backend_management.password == "admin pw"
    assert settings.router_id == "router-i-0abc" and settings.metrics_port == 9100
    # the gateways' monitoring user cannot say whether an id is registered: a never-seen
    # device's command waits for it, never broadcast and dropped
    assert settings.unknown_device == "park"
    # numbered by nothing: they share the shards by rendezvous hashing of their ids
    assert settings.shard_owner == "rendezvous"

    # the nodes admit AMQP and the management API from the routers' group, through the
    # internal load balancer's target groups
    groups = {g["GroupName"]: g for g in ec2.describe_security_groups()["SecurityGroups"]}
    routers = groups["fedgate-backend-routers"]["GroupId"]
    from_routers = {
        p["FromPort"]
        for p in groups["fedgate-backend-nodes"]["IpPermissions"]
        if any(pair["GroupId"] == routers for pair in p.get("UserIdGroupPairs", []))
    }
    assert from_routers == {5672, 15672}
    asg = moto_client("autoscaling", moto_url, REGION)
    (group,) = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["fedgate-backend-router"])[
        "AutoScalingGroups"
    ]
    assert group["DesiredCapacity"] == 2

    # the Spark job: one instance, its tables in the analytics bucket, their names in the
    # catalog database (RDS PostgreSQL), Kafka as the routers reach it, the jars installed
    files, env, install = _service_boot(ec2, "fedgate-backend-spark", moto_url)
    assert install[install.index("--jars-key") + 1] == "fedgate/fedgate-spark-jars-0.1.0.tar.gz"
    assert "pw" not in files["/etc/fedgate/spark.toml"]
    spark_toml = tmp_path / "spark.toml"
    spark_toml.write_text(files["/etc/fedgate/spark.toml"])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = SparkSettings.load(spark_toml)
    (db,) = moto_client("rds", moto_url, REGION).describe_db_instances(
        DBInstanceIdentifier="fedgate-backend-catalog"
    )["DBInstances"]
    assert db["Engine"] == "postgres" and db["StorageEncrypted"] and not db["PubliclyAccessible"]
    assert (
        job.catalog_jdbc_uri
        == f"jdbc:postgresql://{db['Endpoint']['Address']}:{db['Endpoint']['Port']}/fedgate"
    )
    assert (job.catalog_user, job.catalog_password) == ("fedgate", "catalog pw")
    assert job.warehouse == "s3a://fedgate-test-analytics/warehouse" and job.s3_region == REGION
    assert job.kafka_bootstrap == "kafka-1.example:9096,kafka-2.example:9096"
    assert (job.kafka_security_protocol, job.kafka_sasl_username, job.kafka_sasl_password) == (
        "SASL_SSL",
        "fedgate",
        "kafka pw",
    )
    assert job.jars_dir == "/opt/fedgate/jars"
    # what the routers write, by the default mapping rules
    assert sorted(job.require_topics()) == settings.kafka_topics()
    # the catalog database admits the Spark job's group
    groups = {g["GroupName"]: g for g in ec2.describe_security_groups()["SecurityGroups"]}
    spark = groups["fedgate-backend-spark"]["GroupId"]
    assert any(
        p["FromPort"] == 5432 and any(pair["GroupId"] == spark for pair in p.get("UserIdGroupPairs", []))
        for p in groups["fedgate-backend-catalog"]["IpPermissions"]
    )
    (group,) = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["fedgate-backend-spark"])[
        "AutoScalingGroups"
    ]
    assert group["DesiredCapacity"] == 1
