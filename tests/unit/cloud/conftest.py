"""Terraform tests: they run where terraform and an AWS provider mirror exist, else skip with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from infra.cloud.rehearsal.moto import (
    MotoError,
    MotoServer,
    debian_image,
    keep_route53_alarm_health_checks,
    provider_override,
)
from infra.cloud.toolchain import Toolchain, ToolchainError, detect
from infra.local.settings import PROJECT_ROOT, load_settings

TERRAFORM_DIR = PROJECT_ROOT / "infra" / "terraform"
MODULES = sorted(p for p in (TERRAFORM_DIR / "modules").iterdir() if p.is_dir())
EXAMPLES = sorted(p for p in (TERRAFORM_DIR / "examples").iterdir() if p.is_dir())

#: The images moto offers (MOTO_AMIS_PATH): Debian 13 for both architectures, with the older
#: build, a newer Debian 12 and a newer look-alike from another account the lookup must pass over.
TRIXIE_AMD64 = "ami-0de13a0d64000002"
TRIXIE_ARM64 = "ami-0de13a4a64000002"
BOOKWORM_AMD64 = "ami-0de12a0d64000003"
MOTO_AMIS = [
    debian_image(
        "ami-0de13a0d64000001", "debian-13-amd64-20250814-2204", "x86_64", "2025-08-14T22:04:00.000Z"
    ),
    debian_image(TRIXIE_AMD64, "debian-13-amd64-20251006-2257", "x86_64", "2025-10-06T22:57:00.000Z"),
    debian_image(TRIXIE_ARM64, "debian-13-arm64-20251006-2257", "arm64", "2025-10-06T22:57:00.000Z"),
    debian_image(BOOKWORM_AMD64, "debian-12-amd64-20251101-2300", "x86_64", "2025-11-01T23:00:00.000Z"),
    debian_image(
        "ami-0de13a0d64000666",
        "debian-13-amd64-20251201-0000",
        "x86_64",
        "2025-12-01T00:00:00.000Z",
        owner="123456789012",
    ),
]


@pytest.fixture(scope="session", autouse=True)
def moto_keeps_alarm_health_checks() -> None:
    """moto in this process (mock_aws) keeps a CLOUDWATCH_METRIC health check's alarm, as
    MotoServer's does (infra/cloud/rehearsal/moto.py)."""
    keep_route53_alarm_health_checks()


@pytest.fixture(scope="session")
def toolchain() -> Toolchain:
    try:
        settings = load_settings(env={})  # FEDGATE_TF_PLUGIN_MIRROR still wins, inside detect()
        return detect(
            terraform_bin=settings.terraform_bin,
            mirror=settings.tf_plugin_mirror,
            cache_dir=settings.cache_dir,
            require_mirror=True,
        )
    except ToolchainError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def terraform_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the modules read (templates, the gateway plugin), so init leaves the tree clean."""
    root = tmp_path_factory.mktemp("tf")
    shutil.copytree(TERRAFORM_DIR, root / "infra" / "terraform", ignore=shutil.ignore_patterns(".terraform*"))
    for part in ("gateways/templates", "gateways/mqtt_auth_plugin", "backend/templates"):
        shutil.copytree(PROJECT_ROOT / part, root / part)
    return root


def run_tf(
    toolchain: Toolchain, cwd: Path, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:

    env = {**os.environ, **toolchain.env()}
    return subprocess.run(
        [str(toolchain.terraform), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def init_root(toolchain: Toolchain, root: Path, main_tf: str, moto_url: str, region: str) -> Path:
    """`root` made a Terraform root module of `main_tf`, every AWS API to moto, initialised."""
    root.mkdir()
    (root / "main.tf").write_text(main_tf)
    (root / "moto_override.tf").write_text(provider_override(moto_url, region))
    init = run_tf(toolchain, root, "init", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    return root


def module_errors(stderr: str, module: str) -> list[str]:
    """The errors of a failed plan that name module `module`, each on one line (terraform
    wraps a message's lines): a plan of several refused modules says each one's."""
    errors = [" ".join(block.split()) for block in stderr.split("Error:")[1:]]
    return [e for e in errors if f'in module "{module}"' in e]


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """A moto server on 127.0.0.1 whose EC2 offers MOTO_AMIS (and no other image)."""
    try:
        with MotoServer(MOTO_AMIS) as moto:
            yield moto.url
    except MotoError as e:
        # moto[server] is a dev dependency `make setup` installs: missing, the install is broken
        pytest.fail(str(e))


def moto_client(service: str, url: str, region: str) -> Any:
    return boto3.client(
        service,
        endpoint_url=url,
        region_name=region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


#: the provider block every test's root module gets: every AWS API to moto
moto_override = provider_override


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake AWS credentials for moto, in eu-west-1; no profile of the machine's."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
