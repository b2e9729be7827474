"""The instances' cloud-init, as Terraform renders it for EC2.

An example (infra/terraform/examples/backend, gateway-region) is planned -- or, when its
routers are rehearsed too, applied -- against moto, as an operator would against AWS, and
the user data of its launch templates is read from the plan or the state: the very bytes
an instance of each autoscaling group would boot with.  (The routers' config names the
internal load balancer and the secret, which exist only once applied.)
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from backend.errors import FedgateError
from infra.cloud.rehearsal.moto import provider_override
from infra.cloud.toolchain import Toolchain
from infra.local.settings import PROJECT_ROOT

TERRAFORM_DIR = PROJECT_ROOT / "infra" / "terraform"
#: what the examples read from the repository beside the modules
EXAMPLE_READS = ("backend/templates", "gateways/templates", "gateways/mqtt_auth_plugin")


@dataclass(frozen=True)
class Example:
    """A root module of infra/terraform/examples and where its RabbitMQ nodes are in it."""

    folder: str
    nodes_module: str
    #: the routers' and the Spark job's fedgate-service modules, when the example deploys them
    routers_module: str = ""
    spark_module: str = ""


BACKEND = Example(
    "backend",
    "module.backend.module.nodes",
    "module.backend.module.routers[0]",
    "module.backend.module.spark[0]",
)
GATEWAY = Example("gateway-region", "module.gateway_region.module.nodes")


class RenderError(FedgateError):
    """Terraform could not plan the example; the message carries its words."""


@dataclass(frozen=True)
class CloudFile:
    path: str
    content: str
    permissions: str


@dataclass(frozen=True)
class CloudConfig:
    """A node's #cloud-config: the files it writes, the packages it installs, the commands
    it runs, in order."""

    files: dict[str, CloudFile]
    packages: tuple[str, ...]
    runcmd: tuple[tuple[str, ...], ...]

    @classmethod
    def parse(cls, user_data: str) -> CloudConfig:
        doc = yaml.safe_load(user_data)
        if not isinstance(doc, dict) or not user_data.startswith("#cloud-config"):
            raise RenderError("the launch template's user data is not a #cloud-config document")
        files = {
            f["path"]: CloudFile(f["path"], f.get("content", ""), str(f.get("permissions", "0644")))
            for f in doc.get("write_files", [])
        }
        runcmd = tuple(tuple(str(a) for a in cmd) for cmd in doc.get("runcmd", []))
        return cls(files, tuple(doc.get("packages", [])), runcmd)


def _run(toolchain: Toolchain, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    import os

    done = subprocess.run(
        [str(toolchain.terraform), *args, "-no-color"],
        cwd=cwd,
        env={**os.environ, **toolchain.env()},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RenderError(f"terraform {args[0]} of {cwd.name}: {(done.stderr or done.stdout)[-3000:]}")
    return done


def example_user_data(
    toolchain: Toolchain,
    work: Path,
    moto_url: str,
    example: Example,
    variables: dict[str, str],
    aws_region: str,
    *,
    apply: bool = False,
) -> dict[str, str]:
    """Plan (or apply) `example` (a copy in `work`) against moto with `variables`; the user
    data (#cloud-config documents) of its launch templates: "nodes", and "routers" and
    "spark" when applied with them."""
    tree = work / "repo"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(TERRAFORM_DIR, tree / "infra" / "terraform", ignore=shutil.ignore_patterns(".terraform*"))
    for part in EXAMPLE_READS:
        shutil.copytree(PROJECT_ROOT / part, tree / part)
    root = tree / "infra" / "terraform" / "examples" / example.folder
    (root / "moto_override.tf").write_text(provider_override(moto_url, aws_region))
    _run(toolchain, root, "init", "-input=false")
    tf_vars = [f"-var={k}={v}" for k, v in variables.items()] + [f"-var=aws_region={aws_region}"]
    if apply:
        _run(toolchain, root, "apply", "-input=false", "-auto-approve", *tf_vars)
        shown: dict[str, Any] = json.loads(_run(toolchain, root, "show", "-json").stdout)
        module = shown["values"]["root_module"]
    else:
        _run(toolchain, root, "plan", "-input=false", "-out=tfplan", *tf_vars)
        module = json.loads(_run(toolchain, root, "show", "-json", "tfplan").stdout)["planned_values"][
            "root_module"
        ]
    out = {"nodes": _launch_template_user_data(module, example.nodes_module)}
    for kind, address in (("routers", example.routers_module), ("spark", example.spark_module)):
        # (not deployed: no release for the routers, no jars for the Spark job)
        if apply and address:
            with contextlib.suppress(LookupError):
                out[kind] = _launch_template_user_data(module, address)
    return out


def _launch_template_user_data(module: dict[str, Any], address: str) -> str:
    """The nodes module's launch template's user data, decoded, anywhere under `module`."""
    for child in module.get("child_modules", []):
        if child["address"] == address:
            template = next(r for r in child["resources"] if r["type"] == "aws_launch_template")
            return base64.b64decode(template["values"]["user_data"]).decode()
        try:
            return _launch_template_user_data(child, address)
        except LookupError:
            continue
    raise LookupError(f"{address} not in the plan")
