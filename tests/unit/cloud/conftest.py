"""Terraform tests: they run where terraform and an AWS provider mirror exist, else skip with the reason."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from infra.cloud.toolchain import Toolchain, ToolchainError, detect
from infra.local.settings import PROJECT_ROOT, load_settings

TERRAFORM_DIR = PROJECT_ROOT / "infra" / "terraform"
MODULES = sorted(p for p in (TERRAFORM_DIR / "modules").iterdir() if p.is_dir())
EXAMPLES = sorted(p for p in (TERRAFORM_DIR / "examples").iterdir() if p.is_dir())


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
    """A copy of the repository parts the modules read (their templates), so init leaves the tree clean."""
    root = tmp_path_factory.mktemp("tf")
    shutil.copytree(TERRAFORM_DIR, root / "infra" / "terraform", ignore=shutil.ignore_patterns(".terraform*"))
    for part in ("gateways/templates", "backend/templates"):
        shutil.copytree(PROJECT_ROOT / part, root / part)
    return root


def run_tf(
    toolchain: Toolchain, cwd: Path, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, **toolchain.env()}
    return subprocess.run(
        [str(toolchain.terraform), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
