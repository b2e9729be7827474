"""The regions' Terraform state in S3: the settings, the root module and init's arguments
(with the stand-in terraform), then the driver itself with the real terraform against moto's
S3, DynamoDB and the rest of AWS (~3 min): the state is an object in the bucket, locked
through the table, read back by the next run, and emptied by remove. Last, the examples'
commented backend block, uncommented and completed by s3.tfbackend.example, keeps its state
in the bucket."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from moto import mock_aws

from infra.cloud.driver import CloudDriver, CloudError
from infra.cloud.state_backend import BACKEND_FILE, S3StateBackend
from infra.cloud.toolchain import Toolchain
from infra.local.settings import LocalSettings, load_settings

from .conftest import moto_client, run_tf
from .fakes import terraform_calls, write_fake_terraform
from .test_driver import _dns, _outputs

REGION = "eu-west-1"
BUCKET = "fleet-terraform-state"
TABLE = "fleet-terraform-locks"


def test_settings_from_the_environment(tmp_path: Path) -> None:
    def backend(env: dict[str, str]) -> S3StateBackend | None:
        return S3StateBackend.from_settings(load_settings(env=env, state_dir=tmp_path), env)

    assert backend({}) is None
    state = backend(
        {
            "FEDGATE_CLOUD_STATE_BUCKET": BUCKET,
            "FEDGATE_CLOUD_STATE_KEY_PREFIX": "fleet/prod",
            "AWS_DEFAULT_REGION": "eu-central-1",
            "FEDGATE_CLOUD_STATE_LOCK_TABLE": TABLE,
        }
    )
    assert state == S3StateBackend(BUCKET, "eu-central-1", "fleet/prod", TABLE)
    assert state.key(REGION) == "fleet/prod/eu-west-1/terraform.tfstate"
    with pytest.raises(CloudError, match="FEDGATE_CLOUD_STATE_REGION is required"):
        backend({"FEDGATE_CLOUD_STATE_BUCKET": BUCKET})
    with pytest.raises(CloudError, match="no leading or trailing '/'"):
        S3StateBackend(BUCKET, "eu-central-1", key_prefix="fleet/")


def test_the_backend_file_locks_with_the_table_or_a_lock_object() -> None:
    with_table = S3StateBackend(BUCKET, "eu-central-1", lock_table=TABLE).tfbackend(REGION)
    assert 'bucket = "fleet-terraform-state"' in with_table
    assert 'key = "fedgate/eu-west-1/terraform.tfstate"' in with_table
    assert 'dynamodb_table = "fleet-terraform-locks"' in with_table and "use_lockfile" not in with_table
    assert "encrypt = true" in with_table and "endpoints" not in with_table
    without = S3StateBackend(BUCKET, "eu-central-1", endpoint_url="http://127.0.0.1:5000").tfbackend(REGION)
    assert "use_lockfile = true" in without and "dynamodb_table" not in without
    assert 'endpoints = { s3 = "http://127.0.0.1:5000", dynamodb = "http://127.0.0.1:5000" }' in without


def _settings(tmp_path: Path, **kw: object) -> LocalSettings:
    values: dict[str, object] = {
        "cloud_state_dir": tmp_path / "tf-state",
        "cache_dir": tmp_path / "cache",
        "state_dir": tmp_path / "state",
        "cloud_domain": "fleet.example.com",
        "cloud_admin_cidrs": "203.0.113.0/24",
        "cloud_backend_cidrs": "198.51.100.10/32",
        "cloud_backend_amqp_host": "backend.fleet.example.com",
        "cloud_node_count": 3,
        **kw,
    }
    return load_settings(env={}, **values)


@mock_aws
def test_with_a_bucket_the_root_module_has_an_s3_backend_that_init_completes(
    tmp_path: Path, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_TF_OUTPUTS", _outputs())
    fake = str(write_fake_terraform(tmp_path / "terraform"))
    settings = _settings(tmp_path, terraform_bin=fake, cloud_zone_id=_dns())
    state = S3StateBackend(BUCKET, REGION, lock_table=TABLE)
    driver = CloudDriver(settings, state_backend=state)
    driver.add(REGION, auto_approve=True, plan_out=lambda s: None)
    d = tmp_path / "tf-state" / REGION
    root = json.loads((d / "main.tf.json").read_text())
    assert root["terraform"]["backend"] == {"s3": {}}
    assert 'key = "fedgate/eu-west-1/terraform.tfstate"' in (d / BACKEND_FILE).read_text()
    init = terraform_calls(d)[0]
    assert init[0] == "init" and f"-backend-config={BACKEND_FILE}" in init

    # without a bucket: local state, and init gets no backend file
    local = CloudDriver(settings)
    assert local.state_backend is None
    local.write_root_module(REGION)
    assert json.loads((d / "main.tf.json").read_text())["terraform"]["backend"] == {
        "local": {"path": "terraform.tfstate"}
    }
    assert not (d / BACKEND_FILE).exists()


#: the core log's lines on the lock: its steps, the DynamoDB calls and their status, retries
LOCK_CALL = re.compile(
    r"backend-s3: (Attempting|Locked|Unlocked|HTTP (Request Sent|Response Received): aws\.dynamodb)"
    r"|http\.status_code=|[Rr]etr(y|ies|ying)|[Ee]rror"
)


@contextlib.contextmanager
def _lock_calls_shown_on_failure(tf_log: Path) -> Iterator[None]:
    """A CloudError over the state's lock gets the log's lines on the lock table's calls."""
    try:
        yield
    except CloudError as e:
        if "state lock" not in str(e) or not tf_log.exists():
            raise
        lines = tf_log.read_text(errors="replace").splitlines()
        calls = [ln[:320] for ln in lines if LOCK_CALL.search(ln)]
        raise CloudError(f"{e}\n--- {tf_log}, its lock calls:\n" + "\n".join(calls[-80:])) from e


@pytest.mark.terraform
@pytest.mark.slow
# three applies and plans, ~100 s of them the AWS provider's own waits (a load balancer's
# 60 s): 150-270 s alone, over 300 beside the other lanes of `make test`
@pytest.mark.timeout(600)
def test_the_driver_keeps_a_regions_state_in_s3_locked_by_dynamodb(
    toolchain: Toolchain, moto_url: str, tmp_path: Path, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once in ~20 suite runs an apply here found the state locked by an apply lock no earlier
    # run had left (each run's unlock is checked below): Terraform's core log, kept, says
    # which DynamoDB calls that run made and retried
    tf_log = tmp_path / "terraform-core.log"
    monkeypatch.setenv("TF_LOG_CORE", "DEBUG")
    monkeypatch.setenv("TF_LOG_PATH", str(tf_log))
    s3 = moto_client("s3", moto_url, REGION)
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    dynamodb = moto_client("dynamodb", moto_url, REGION)
    dynamodb.create_table(
        TableName=TABLE,
        KeySchema=[{"AttributeName": "LockID", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "LockID", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    zone = (
        moto_client("route53", moto_url, REGION)
        .create_hosted_zone(Name="fleet.example.com", CallerReference="state-s3")["HostedZone"]["Id"]
        .split("/")[-1]
    )
    settings = _settings(
        tmp_path,
        terraform_bin=str(toolchain.terraform),
        tf_plugin_mirror=toolchain.mirror,
        aws_endpoint_url=moto_url,
        cloud_zone_id=zone,
    )
    state = S3StateBackend(BUCKET, REGION, key_prefix="fleet", lock_table=TABLE, endpoint_url=moto_url)
    driver = CloudDriver(settings, state_backend=state)
    key = "fleet/eu-west-1/terraform.tfstate"

    with _lock_calls_shown_on_failure(tf_log):
        rec = driver.add(REGION, auto_approve=True, plan_out=lambda s: None)
    assert rec.state == "applied"
    region_dir = tmp_path / "tf-state" / REGION
    # the state is the bucket's object, not a file of the region's folder
    assert not (region_dir / "terraform.tfstate").exists()
    tfstate = json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    groups = [r for r in tfstate["resources"] if r["type"] == "aws_autoscaling_group"]
    assert [g["instances"][0]["attributes"]["desired_capacity"] for g in groups] == [3]
    # the table locked it: Terraform keeps the state's checksum beside the lock
    items = dynamodb.scan(TableName=TABLE)["Items"]
    assert {i["LockID"]["S"] for i in items} == {f"{BUCKET}/{key}-md5"}

    # another run reads the state back from the bucket: nothing to change
    printed: list[str] = []
    with _lock_calls_shown_on_failure(tf_log):
        driver.add(REGION, auto_approve=True, plan_out=printed.append)
    assert printed == []

    with _lock_calls_shown_on_failure(tf_log):
        driver.remove(REGION, auto_approve=True, plan_out=lambda s: None)
    tfstate = json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert [r for r in tfstate["resources"] if r["mode"] == "managed"] == []
    assert not region_dir.exists()


@pytest.mark.terraform
@pytest.mark.slow
@pytest.mark.parametrize("example", ["backend", "gateway-region", "rabbitmq-nodes"])
def test_an_examples_commented_s3_backend_inits_against_the_bucket(
    toolchain: Toolchain, terraform_tree: Path, moto_url: str, aws_env: None, example: str
) -> None:
    examples = terraform_tree / "infra" / "terraform" / "examples"
    copy = examples / f"{example}-s3"
    shutil.copytree(examples / example, copy, ignore=shutil.ignore_patterns(".terraform*"))
    versions = copy / "versions.tf"
    assert '  # backend "s3" {}\n' in versions.read_text()
    versions.write_text(versions.read_text().replace('  # backend "s3" {}\n', '  backend "s3" {}\n'))
    bucket = f"example-state-{example}"
    moto_client("s3", moto_url, REGION).create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION}
    )
    moto_client("dynamodb", moto_url, REGION).create_table(
        TableName=bucket,
        KeySchema=[{"AttributeName": "LockID", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "LockID", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    # the example file as an operator fills it in, then moto's endpoints on top
    filled = (examples / "s3.tfbackend.example").read_text()
    filled = filled.replace("example-fedgate-terraform-state", bucket).replace("eu-central-1", REGION)
    (copy / "s3.tfbackend").write_text(filled.replace("example-fedgate-terraform-locks", bucket))
    # moto's endpoints, as the driver points the backend at a stand-in
    (copy / "moto.tfbackend").write_text(
        f'endpoints = {{ s3 = "{moto_url}", dynamodb = "{moto_url}" }}\n'
        "use_path_style = true\n"
        "skip_credentials_validation = true\n"
        "skip_requesting_account_id = true\n"
        "skip_metadata_api_check = true\n"
    )
    key = f"fedgate/{example}/terraform.tfstate"
    init = run_tf(
        toolchain, copy, "init", "-input=false", "-no-color", "-backend-config=s3.tfbackend",
        f"-backend-config=key={key}", "-backend-config=moto.tfbackend",
    )  # fmt: skip
    assert init.returncode == 0, init.stdout[-2000:] + init.stderr
    assert 'Successfully configured the backend "s3"' in init.stdout
    # a workspace is a state object in the bucket, written under the table's lock
    new = run_tf(toolchain, copy, "workspace", "new", "-no-color", "probe")
    assert new.returncode == 0, new.stderr
    objects = moto_client("s3", moto_url, REGION).list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in objects] == [f"env:/probe/{key}"]
