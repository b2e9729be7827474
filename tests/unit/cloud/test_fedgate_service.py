"""The fedgate-service module: routers and the Spark job as systemd units on an autoscaling
group.  The module, copied alone, planned against moto (the cloud-init its instances boot
with, what their role may read, the instance counts it accepts), and its installer run
against moto's S3 and Secrets Manager (the release into a virtualenv, the secrets into the
unit's environment file)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.cloud.rehearsal.imds import MetadataService
from infra.cloud.toolchain import Toolchain

from .conftest import TERRAFORM_DIR, init_root, module_errors, moto_client, run_tf

MODULE = TERRAFORM_DIR / "modules" / "fedgate-service"
INSTALLER = MODULE / "files" / "fedgate-install.py"
SECRET_ARN = "arn:aws:secretsmanager:eu-central-1:123456789012:secret:fedgate-router-AbCdEf"
CONFIG = 'kafka_bootstrap = "b-1.msk:9096"\n'
REGION = "eu-central-1"

#: The module once for each (service, instance count) the tests plan; the accepted ones in
#: one root, the refused in another: one plan each answers all their cases.
SERVICE_MODULE = """
module "{service}_{count}" {{
  source = "../fedgate-service"

  name               = "svc-{service}-{count}"
  service            = "{service}"
  instance_count     = {count}
  subnet_ids         = ["subnet-0123456789abcdef0"]
  security_group_ids = ["sg-0123456789abcdef0"]
  release_bucket     = "fedgate-releases"
  release_key        = "fedgate/fedgate-0.1.0-py3-none-any.whl"
  config_toml        = "kafka_bootstrap = \\"b-1.msk:9096\\"\\n"
  secret_arn         = "{secret_arn}"
  s3_bucket_arns     = {buckets}
  jars_key           = {jars_key}
}}
"""
ACCEPTED = [("router", 2), ("spark", 1), ("router", 3)]
REFUSED = [("router", 1), ("spark", 2)]


def root_module(cases: list[tuple[str, int]]) -> str:
    blocks = ["# written by the test: the fedgate-service module, copied alone, once per case"]
    for service, count in cases:
        spark = service == "spark"
        blocks.append(
            SERVICE_MODULE.format(
                service=service,
                count=count,
                secret_arn=SECRET_ARN,
                buckets='["arn:aws:s3:::fedgate-analytics"]' if spark else "[]",
                jars_key='"fedgate/fedgate-spark-jars-0.1.0.tar.gz"' if spark else "null",
            )
        )
    return "\n".join(blocks)


@pytest.fixture(scope="module")
def module_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("service")
    shutil.copytree(MODULE, base / "fedgate-service", ignore=shutil.ignore_patterns(".terraform*"))
    return base


@pytest.fixture(scope="module")
def planned(toolchain: Toolchain, module_copy: Path, moto_url: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Each accepted case's planned resources by type: {"router_2": {"aws_launch_template": ...}}."""
    root = init_root(toolchain, module_copy / "accepted", root_module(ACCEPTED), moto_url, REGION)
    plan = run_tf(toolchain, root, "plan", "-input=false", "-no-color", "-out=tfplan")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    shown = json.loads(run_tf(toolchain, root, "show", "-json", "-no-color", "tfplan").stdout)
    return {
        module["address"].removeprefix("module."): {
            r["type"]: r["values"] for r in module["resources"] if r["mode"] == "managed"
        }
        for module in shown["planned_values"]["root_module"]["child_modules"]
    }


@pytest.fixture(scope="module")
def refused(toolchain: Toolchain, module_copy: Path, moto_url: str) -> subprocess.CompletedProcess[str]:
    root = init_root(toolchain, module_copy / "refused", root_module(REFUSED), moto_url, REGION)
    return run_tf(toolchain, root, "plan", "-input=false", "-no-color")


@pytest.mark.terraform
@pytest.mark.slow
@pytest.mark.parametrize(("service", "count", "entry"), [("router", 2, "router"), ("spark", 1, "spark.job")])
def test_the_instances_install_the_release_and_run_the_service_as_a_unit(
    planned: dict[str, dict[str, dict[str, Any]]], service: str, count: int, entry: str
) -> None:
    resources = planned[f"{service}_{count}"]
    template = resources["aws_launch_template"]
    assert template["metadata_options"][0]["http_tokens"] == "required"
    cloud_config = yaml.safe_load(base64.b64decode(template["user_data"]).decode())
    files = {f["path"]: f for f in cloud_config["write_files"]}

    # the config as given, no secret in it; the installer is the module's own file
    assert files[f"/etc/fedgate/{service}.toml"]["content"] == CONFIG
    assert files["/usr/local/sbin/fedgate-install"]["content"] == INSTALLER.read_text()
    unit = files[f"/etc/systemd/system/fedgate-{service}.service"]["content"]
    assert f"ExecStart=/opt/fedgate/venv/bin/python -m {entry} --config /etc/fedgate/{service}.toml" in unit
    assert f"EnvironmentFile=/etc/fedgate/{service}.env" in unit
    assert "KillSignal=SIGTERM" in unit and "Restart=always" in unit and "DynamicUser=yes" in unit
    # the stop signal to the service's own process, which stops its children (the Spark JVM)
    assert "KillMode=mixed" in unit
    assert ("default-jre-headless" in cloud_config["packages"]) is (service == "spark")

    # installed (release + secrets) before the unit starts, once
    install, reload, start = cloud_config["runcmd"]
    assert install[0] == "/usr/local/sbin/fedgate-install"
    args = dict(zip(install[1::2], install[2::2], strict=True))
    assert args == {
        "--region": "eu-central-1",
        "--bucket": "fedgate-releases",
        "--key": "fedgate/fedgate-0.1.0-py3-none-any.whl",
        "--secret-arn": SECRET_ARN,
        "--env-file": f"/etc/fedgate/{service}.env",
        # a router's id names its own queues: each instance its own, from the metadata service
        **(
            {"--service": "router", "--id-variable": "FEDGATE_ROUTER_ROUTER_ID"}
            if service == "router"
            # the Spark job's jars, unpacked beside the venv
            else {"--jars-key": "fedgate/fedgate-spark-jars-0.1.0.tar.gz"}
        ),
    }
    assert reload == ["systemctl", "daemon-reload"]
    assert start == ["systemctl", "enable", "--now", f"fedgate-{service}.service"]

    # the role reads the release object and the secret, and only the Spark job a bucket
    statements = {s["Sid"]: s for s in json.loads(resources["aws_iam_role_policy"]["policy"])["Statement"]}
    assert statements["Release"]["Resource"] == [
        "arn:aws:s3:::fedgate-releases/fedgate/fedgate-0.1.0-py3-none-any.whl",
        *(
            ["arn:aws:s3:::fedgate-releases/fedgate/fedgate-spark-jars-0.1.0.tar.gz"]
            if service == "spark"
            else []
        ),
    ]
    assert statements["Secret"]["Resource"] == [SECRET_ARN]
    assert ("Objects" in statements) is (service == "spark")
    group = resources["aws_autoscaling_group"]
    assert group["min_size"] == group["max_size"] == group["desired_capacity"] == count


@pytest.mark.terraform
@pytest.mark.slow
@pytest.mark.parametrize(
    ("service", "count", "accepted"),
    [("router", 1, False), ("router", 3, True), ("spark", 2, False), ("spark", 1, True)],
)
def test_routers_come_in_twos_and_the_job_alone(
    planned: dict[str, dict[str, dict[str, Any]]],
    refused: subprocess.CompletedProcess[str],
    service: str,
    count: int,
    accepted: bool,
) -> None:
    name = f"{service}_{count}"
    if accepted:
        assert planned[name]["aws_autoscaling_group"]["desired_capacity"] == count
        return
    assert refused.returncode != 0, "a plan of refused instance counts was accepted"
    mine = module_errors(refused.stderr, name)
    assert len(mine) == 1, refused.stderr
    assert "instance_count: 1 for the Spark job (one writer of the tables), at least 2 for routers" in mine[0]


# --- the installer ------------------------------------------------------------------------------


def _wheel(folder: Path) -> Path:
    """A minimal wheel (one module, no dependencies) standing in for fedgate's."""
    name = "fedgate_standin-0.1.0"
    files = {
        "fedgate_standin/__init__.py": "VERSION = '0.1.0'\n",
        f"{name}.dist-info/METADATA": "Metadata-Version: 2.1\nName: fedgate-standin\nVersion: 0.1.0\n",
        f"{name}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{name}.dist-info/RECORD,,")
    wheel = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{name}.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


def _install(moto_url: str, tmp_path: Path, secret_arn: str, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, str(INSTALLER), "--region", REGION, "--endpoint-url", moto_url,
            "--bucket", "fedgate-releases", "--key", "fedgate/fedgate_standin-0.1.0-py3-none-any.whl",
            "--secret-arn", secret_arn, "--env-file", str(tmp_path / "etc" / "router.env"),
            "--prefix", str(tmp_path / "opt"), "--pip-arg=--no-index", *more,
        ],
        capture_output=True, text=True, timeout=300,
        env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@pytest.mark.slow
def test_the_installer_puts_the_release_in_a_venv_and_the_secret_in_the_units_environment(
    moto_url: str, tmp_path: Path
) -> None:
    s3 = moto_client("s3", moto_url, REGION)
    s3.create_bucket(Bucket="fedgate-releases", CreateBucketConfiguration={"LocationConstraint": REGION})
    s3.upload_file(
        str(_wheel(tmp_path)), "fedgate-releases", "fedgate/fedgate_standin-0.1.0-py3-none-any.whl"
    )
    secrets = moto_client("secretsmanager", moto_url, REGION)
    env = {"FEDGATE_ROUTER_AMQP_URL": 'amqp://router:p@ss w"rd@backend:5672/%2F', "FEDGATE_X": "1"}
    arn = secrets.create_secret(Name="fedgate-router", SecretString=json.dumps(env))["ARN"]
    bad = secrets.create_secret(Name="fedgate-bad", SecretString=json.dumps({"A": "two\nlines"}))["ARN"]

    with MetadataService("127.0.0.1", 0) as imds:
        done = _install(
            moto_url, tmp_path, arn, "--service", "router", "--id-variable", "FEDGATE_ROUTER_ROUTER_ID",
            "--imds-url", imds.url,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    env_file = tmp_path / "etc" / "router.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert env_file.read_text() == (
        'FEDGATE_ROUTER_AMQP_URL="amqp://router:p@ss w\\"rd@backend:5672/%2F"\nFEDGATE_X="1"\n'
        # the instance's own router id, asked with a token (127.0.0.1's id in the stand-in)
        'FEDGATE_ROUTER_ROUTER_ID="router-i-7f000001"\n'
    )
    # (quoted as systemd.exec(5) reads EnvironmentFile: double quotes, \\ and \" escaped)
    python = tmp_path / "opt" / "venv" / "bin" / "python"
    got = subprocess.run([str(python), "-c", "import fedgate_standin; print(fedgate_standin.VERSION)"],
                         capture_output=True, text=True)  # fmt: skip
    assert got.stdout.strip() == "0.1.0", got.stderr

    refused = _install(moto_url, tmp_path / "bad", bad)
    assert refused.returncode != 0 and "NAME=single-line string only" in refused.stderr
    assert not (tmp_path / "bad" / "etc" / "router.env").exists()


@pytest.mark.slow
def test_the_installer_unpacks_the_spark_jars_and_refuses_an_archive_that_is_not_jars(
    moto_url: str, tmp_path: Path
) -> None:
    """Tried: the release's jars archive; then one whose member climbs out of the folder."""
    import io
    import tarfile

    s3 = moto_client("s3", moto_url, REGION)
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):  # the other installer test's
        s3.create_bucket(Bucket="fedgate-releases", CreateBucketConfiguration={"LocationConstraint": REGION})
    s3.upload_file(
        str(_wheel(tmp_path)), "fedgate-releases", "fedgate/fedgate_standin-0.1.0-py3-none-any.whl"
    )

    def archive(members: dict[str, bytes]) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w:gz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return out.getvalue()

    s3.put_object(Bucket="fedgate-releases", Key="fedgate/jars.tar.gz",
                  Body=archive({"iceberg.jar": b"PK one", "postgresql.jar": b"PK two"}))  # fmt: skip
    s3.put_object(Bucket="fedgate-releases", Key="fedgate/bad.tar.gz",
                  Body=archive({"ok.jar": b"PK", "../../etc/cron.d/x.jar": b"evil"}))  # fmt: skip
    arn = moto_client("secretsmanager", moto_url, REGION).create_secret(
        Name="fedgate-spark", SecretString=json.dumps({"FEDGATE_SPARK_CATALOG_PASSWORD": "pw"})
    )["ARN"]

    done = _install(moto_url, tmp_path / "good", arn, "--jars-key", "fedgate/jars.tar.gz")
    assert done.returncode == 0, done.stderr
    jars = tmp_path / "good" / "opt" / "jars"
    assert {p.name: p.read_bytes() for p in jars.iterdir()} == {
        "iceberg.jar": b"PK one",
        "postgresql.jar": b"PK two",
    }

    refused = _install(moto_url, tmp_path / "bad", arn, "--jars-key", "fedgate/bad.tar.gz")
    assert refused.returncode != 0 and "not jars" in refused.stderr
    assert not list((tmp_path / "bad").rglob("x.jar")) and not (tmp_path / "etc" / "cron.d").exists()
