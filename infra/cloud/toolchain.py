"""Finding Terraform and the AWS provider without the network.

fedgate never lets Terraform reach registry.terraform.io on its own: it
writes a CLI config (``.cache/terraform/terraformrc``) whose
``provider_installation`` names a filesystem mirror of the AWS provider, and
points ``TF_CLI_CONFIG_FILE`` at it.  The mirror is ``FEDGATE_TF_PLUGIN_MIRROR``
or the ``tf_plugin_mirror`` setting (default ``/opt/tf-plugins``).  Without a
mirror the config falls back to direct installation from the registry (for
machines that have the network).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from backend.errors import FedgateError

#: The provider fedgate's modules are written against (versions.tf allows >= 5.40, < 6.0).
AWS_PROVIDER = "registry.terraform.io/hashicorp/aws"
AWS_PROVIDER_MAJOR = 5
PLATFORM = "linux_amd64"

#: The modules' required_version: templatestring and validations that read other variables.
MIN_TERRAFORM = (1, 9)

#: Each terraform plan starts the AWS provider three times (validate twice), and each start
#: builds the schemas of its ~1,500 resources: at Go's default GOGC=100 a third of a plan's
#: CPU is the collector.  GOGC=400 took a plan of the rabbitmq-nodes module from 11.0 to 7.8
#: CPU s (validate 6.4 -> 4.9) for ~130 MB more peak memory (315 -> 445 MB) on 2026-11-30.
GO_GC_PERCENT = "400"

INSTALL_HINT = (
    "install Terraform >= 1.9 (the release zip from releases.hashicorp.com) or set "
    "FEDGATE_TERRAFORM_BIN; see docs/operations.md, 'Terraform without the network'"
)


class ToolchainError(FedgateError):
    """Terraform or the AWS provider is missing; the message says what to install."""


@dataclass(frozen=True)
class Toolchain:
    terraform: Path
    version: str
    #: filesystem mirror holding the AWS provider, or None (install from the registry)
    mirror: Path | None
    cli_config: Path

    def env(self) -> dict[str, str]:
        """Environment for every terraform call: our CLI config, no prompts, no checkpoint calls,
        and the Go collector's pace for the AWS provider (GO_GC_PERCENT; an operator's GOGC wins)."""
        return {
            "TF_CLI_CONFIG_FILE": str(self.cli_config),
            "TF_IN_AUTOMATION": "1",
            "TF_INPUT": "0",
            "CHECKPOINT_DISABLE": "1",
            "GOGC": os.environ.get("GOGC") or GO_GC_PERCENT,
        }


def find_terraform(configured: str = "terraform") -> tuple[Path, str]:
    path = shutil.which(os.environ.get("FEDGATE_TERRAFORM_BIN") or configured)
    if path is None:
        raise ToolchainError(f"terraform not installed (not on PATH as {configured!r}): {INSTALL_HINT}")
    try:
        out = subprocess.run(
            [path, "version"], capture_output=True, text=True, timeout=30, env=_quiet_env()
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"terraform at {path} does not run: {e}") from e
    m = re.search(r"Terraform v(\d+\.\d+\.\d+)", out)
    if not m:
        raise ToolchainError(f"terraform at {path} does not report a version: {out[:200]!r}")
    major, minor = (int(x) for x in m.group(1).split(".")[:2])
    if (major, minor) < MIN_TERRAFORM:
        raise ToolchainError(f"terraform {m.group(1)} at {path} is too old: {INSTALL_HINT}")
    return Path(path), m.group(1)


def _quiet_env() -> dict[str, str]:
    # `terraform version` warns about a TF_CLI_CONFIG_FILE that does not exist.
    env = dict(os.environ)
    env.pop("TF_CLI_CONFIG_FILE", None)
    env["CHECKPOINT_DISABLE"] = "1"
    return env


def mirror_providers(mirror: Path) -> list[str]:
    """AWS provider versions of major 5 the mirror holds for this platform (unpacked layout)."""
    base = mirror / AWS_PROVIDER
    if not base.is_dir():
        return []
    return sorted(
        v.name
        for v in base.iterdir()
        if v.name.split(".")[0] == str(AWS_PROVIDER_MAJOR) and (v / PLATFORM).is_dir()
    )


def find_mirror(configured: Path | None) -> Path | None:
    raw = os.environ.get("FEDGATE_TF_PLUGIN_MIRROR")
    path = Path(raw) if raw else configured
    if path is not None and mirror_providers(path):
        return path
    return None


def write_cli_config(path: Path, mirror: Path | None) -> Path:
    if mirror is not None:
        body = (
            "# written by fedgate: providers come from this mirror only, never the network\n"
            "provider_installation {\n"
            "  filesystem_mirror {\n"
            f'    path    = "{mirror}"\n'
            '    include = ["registry.terraform.io/hashicorp/*"]\n'
            "  }\n"
            "}\n"
        )
    else:
        body = "# written by fedgate: no provider mirror found, providers come from the registry\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != body:
        path.write_text(body)
    return path


def detect(
    *, terraform_bin: str = "terraform", mirror: Path | None, cache_dir: Path, require_mirror: bool
) -> Toolchain:
    """The toolchain on this machine; ToolchainError says what is missing."""
    tf, version = find_terraform(terraform_bin)
    found = find_mirror(mirror)
    if found is None and require_mirror:
        where = os.environ.get("FEDGATE_TF_PLUGIN_MIRROR") or mirror
        raise ToolchainError(
            f"no AWS provider {AWS_PROVIDER_MAJOR}.x for {PLATFORM} in the plugin mirror {where} "
            "(set FEDGATE_TF_PLUGIN_MIRROR to a filesystem mirror, e.g. one made by "
            "`terraform providers mirror`)"
        )
    cfg = write_cli_config(cache_dir / "terraform" / "terraformrc", found)
    return Toolchain(tf, version, found, cfg)
