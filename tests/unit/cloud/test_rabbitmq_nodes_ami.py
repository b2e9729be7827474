"""Which image the rabbitmq-nodes module boots: Debian 13 from Debian's account, for the instance
type's architecture, unless ami_id (or the name filter) says otherwise. Planned against a moto
server that offers Debian 12 and 13 images and a look-alike (conftest.MOTO_AMIS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.cloud.toolchain import Toolchain

from .conftest import BOOKWORM_AMD64, TRIXIE_AMD64, TRIXIE_ARM64, moto_override, run_tf

pytestmark = [pytest.mark.terraform, pytest.mark.slow]

REGION = "eu-west-1"

ROOT_MODULE = """# written by the test: the module alone, its network made up (a plan does not look it up)
variable "instance_type" {
  type = string
}

variable "ami_id" {
  type    = string
  default = null
}

variable "ami_name_filter" {
  type    = string
  default = null
}

module "nodes" {
  source = "../../modules/rabbitmq-nodes"

  name               = "ami-lookup"
  rabbitmq_conf      = "cluster_name = ami-lookup\\n"
  enabled_plugins    = "[rabbitmq_management]."
  erlang_cookie      = "cookie"
  ami_id             = var.ami_id
  ami_name_filter    = var.ami_name_filter
  instance_type      = var.instance_type
  node_count         = 3
  subnet_ids         = ["subnet-0123456789abcdef0"]
  security_group_ids = ["sg-0123456789abcdef0"]
}
"""


@pytest.fixture(scope="module")
def root(toolchain: Toolchain, terraform_tree: Path, moto_url: str) -> Path:
    # beside the examples in the copied tree, so that ../../modules resolves
    path = terraform_tree / "infra" / "terraform" / "examples" / "ami-lookup"
    path.mkdir()
    (path / "main.tf").write_text(ROOT_MODULE)
    (path / "moto_override.tf").write_text(moto_override(moto_url, REGION))
    init = run_tf(toolchain, path, "init", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    return path


def _planned_image(toolchain: Toolchain, root: Path, *tf_vars: str) -> str:
    plan = run_tf(toolchain, root, "plan", "-input=false", "-no-color", "-out=tfplan", *tf_vars)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    shown = run_tf(toolchain, root, "show", "-json", "-no-color", "tfplan")
    assert shown.returncode == 0, shown.stderr
    module = next(
        m
        for m in json.loads(shown.stdout)["planned_values"]["root_module"]["child_modules"]
        if m["address"] == "module.nodes"
    )
    template = next(r for r in module["resources"] if r["address"] == "module.nodes.aws_launch_template.this")
    return str(template["values"]["image_id"])


@pytest.mark.parametrize(
    ("tf_vars", "image"),
    [
        # x86_64: the newest debian-13-amd64 build of Debian's account, not the newer
        # Debian 12 image nor the newer look-alike of another account
        (["-var=instance_type=t3.small"], TRIXIE_AMD64),
        # Graviton: the arm64 build
        (["-var=instance_type=t4g.small"], TRIXIE_ARM64),
        # the lookup's name is a variable ...
        (["-var=instance_type=t3.small", "-var=ami_name_filter=debian-12-amd64-*"], BOOKWORM_AMD64),
        # ... and ami_id skips the lookup
        (["-var=instance_type=t3.small", "-var=ami_id=ami-0c0ffee0c0ffee000"], "ami-0c0ffee0c0ffee000"),
    ],
    ids=["amd64", "arm64", "name-filter", "ami-id"],
)
def test_the_nodes_boot_the_image_the_lookup_picks(
    toolchain: Toolchain, root: Path, tf_vars: list[str], image: str
) -> None:
    assert _planned_image(toolchain, root, *tf_vars) == image
