"""Which image the rabbitmq-nodes module boots: Debian 13 from Debian's account, for the instance
type's architecture, unless ami_id (or the name filter) says otherwise. Planned against a moto
server that offers Debian 12 and 13 images and a look-alike (conftest.MOTO_AMIS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.cloud.toolchain import Toolchain

from .conftest import BOOKWORM_AMD64, TRIXIE_AMD64, TRIXIE_ARM64, init_root, run_tf

pytestmark = [pytest.mark.terraform, pytest.mark.slow]

REGION = "eu-west-1"

#: Each case: the module's inputs that choose the image, and the image it must boot.
CASES = {
    # x86_64: the newest debian-13-amd64 build of Debian's account, not the newer
    # Debian 12 image nor the newer look-alike of another account
    "amd64": ({"instance_type": "t3.small"}, TRIXIE_AMD64),
    # Graviton: the arm64 build
    "arm64": ({"instance_type": "t4g.small"}, TRIXIE_ARM64),
    # the lookup's name is a variable ...
    "name-filter": ({"instance_type": "t3.small", "ami_name_filter": "debian-12-amd64-*"}, BOOKWORM_AMD64),
    # ... and ami_id skips the lookup
    "ami-id": ({"instance_type": "t3.small", "ami_id": "ami-0c0ffee0c0ffee000"}, "ami-0c0ffee0c0ffee000"),
}

MODULE = """
module "{name}" {{
  source = "../../modules/rabbitmq-nodes"

  name               = "ami-lookup"
  rabbitmq_conf      = "cluster_name = ami-lookup\\n"
  enabled_plugins    = "[rabbitmq_management]."
  erlang_cookie      = "cookie"
  node_count         = 3
  subnet_ids         = ["subnet-0123456789abcdef0"]
  security_group_ids = ["sg-0123456789abcdef0"]
{inputs}
}}
"""


def root_module() -> str:
    """The module once per case (written by the test, its network made up: a plan does not
    look it up): one plan and one show answer every case, each of which starts Terraform's
    AWS provider afresh (~1.5 CPU s a start)."""
    blocks = ["# written by the test: the rabbitmq-nodes module once per case"]
    for case, (inputs, _) in CASES.items():
        lines = "\n".join(f'  {key} = "{value}"' for key, value in inputs.items())
        blocks.append(MODULE.format(name=_module_name(case), inputs=lines))
    return "\n".join(blocks)


def _module_name(case: str) -> str:
    return "nodes_" + case.replace("-", "_")


@pytest.fixture(scope="module")
def planned_images(toolchain: Toolchain, terraform_tree: Path, moto_url: str) -> dict[str, str]:
    """The image each case's launch template boots, from one plan against moto."""
    # beside the examples in the copied tree, so that ../../modules resolves
    root = init_root(
        toolchain,
        terraform_tree / "infra" / "terraform" / "examples" / "ami-lookup",
        root_module(),
        moto_url,
        REGION,
    )
    plan = run_tf(toolchain, root, "plan", "-input=false", "-no-color", "-out=tfplan")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    shown = run_tf(toolchain, root, "show", "-json", "-no-color", "tfplan")
    assert shown.returncode == 0, shown.stderr
    images = {}
    for module in json.loads(shown.stdout)["planned_values"]["root_module"]["child_modules"]:
        template = next(r for r in module["resources"] if r["type"] == "aws_launch_template")
        images[module["address"]] = str(template["values"]["image_id"])
    return images


@pytest.mark.parametrize("case", list(CASES))
def test_the_nodes_boot_the_image_the_lookup_picks(planned_images: dict[str, str], case: str) -> None:
    assert planned_images[f"module.{_module_name(case)}"] == CASES[case][1]
