"""A cloud region's Terraform root module around infra/terraform/modules/gateway-region.

The modules read nothing outside their own folders (so they work from a registry
or a git subfolder): what a gateway node runs that is fedgate's -- the
rabbitmq.conf and TLS templates, enabled_plugins, the emulator flags, the
fedgate_mqtt_auth plugin's sources -- is read here from the project, the same
files a local gateway node runs, and handed to the module.

They travel as variables of the root module, set by ``node-files.auto.tfvars.json``
beside it (Terraform reads that file by itself): in Terraform's JSON syntax every
string of a module block is a template, and these files are full of ``${...}``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gateways.node import MQTT_AUTH_PLUGIN, TEMPLATES
from infra.cloud.errors import CloudError
from infra.cloud.state_backend import S3StateBackend
from infra.local.settings import PROJECT_ROOT

MODULE_DIR = PROJECT_ROOT / "infra" / "terraform" / "modules" / "gateway-region"

#: The region folder's file with the node files (not secret: the project's own files).
NODE_FILES = "node-files.auto.tfvars.json"

#: RabbitMQ on the cloud nodes: Debian 13's rabbitmq-server, the release the local nodes run
#: (the rabbitmq-nodes module boots Debian 13 and starts no other release).
RABBITMQ_VERSION = "4.0.5"

#: AWS APIs the gateway-region module calls; all go to aws_endpoint_url when it is set.
AWS_SERVICES = ("ec2", "elbv2", "autoscaling", "iam", "route53", "cloudwatch", "sts")

#: The root module's variables that carry the node files, with their Terraform types.
NODE_FILE_TYPES = {
    "rabbitmq_conf_template": "string",
    "tls_conf_template": "string",
    "enabled_plugins": "string",
    "erl_args": "string",
    "erlang_plugins": "map(object({vsn = string, app = string, sources = map(string)}))",
}


def module_outputs() -> list[str]:
    """Output names of the gateway-region module (its outputs.tf), re-exported by the root module."""
    return re.findall(r'^output "([^"]+)"', (MODULE_DIR / "outputs.tf").read_text(), re.M)


def erlang_plugin(folder: Path) -> tuple[str, dict[str, Any]]:
    """(app name, the rabbitmq-nodes module's description of it) of a plugin folder of fedgate's:
    <app>.app and src/*.erl, as infra/local/broker.py builds it for local nodes."""
    apps = sorted(folder.glob("*.app"))
    if len(apps) != 1:
        raise CloudError(f"{folder}: expected one .app file, found {len(apps)}")
    app = apps[0].read_text()
    vsn = re.search(r'\{vsn,\s*"([^"]+)"\}', app)
    if vsn is None:
        raise CloudError(f"{apps[0]}: no {{vsn, ...}}")
    sources = {p.name: p.read_text() for p in sorted((folder / "src").glob("*.erl"))}
    if not sources:
        raise CloudError(f"{folder}/src: no .erl sources")
    return apps[0].stem, {"vsn": vsn.group(1), "app": app, "sources": sources}


def gateway_node_files() -> dict[str, Any]:
    """The gateway-region module's inputs that are fedgate's files (NODE_FILE_TYPES' names)."""
    name, plugin = erlang_plugin(MQTT_AUTH_PLUGIN)
    return {
        "rabbitmq_conf_template": (TEMPLATES / "rabbitmq.conf").read_text(),
        "tls_conf_template": (TEMPLATES / "tls.conf").read_text(),
        "enabled_plugins": (TEMPLATES / "enabled_plugins").read_text(),
        "erl_args": (TEMPLATES / "erl_args").read_text().strip(),
        "erlang_plugins": {name: plugin},
    }


def gateway_root_module(
    region: str,
    inputs: dict[str, Any],
    *,
    endpoint_url: str = "",
    state: S3StateBackend | None = None,
) -> dict[str, Any]:
    """The region's root module (JSON syntax): the provider, the gateway-region module with
    `inputs` and the node files (variables), its outputs, and where its state lives."""
    provider: dict[str, Any] = {"region": region}
    if endpoint_url:
        # moto (or another stand-in) answers every API: no account lookups, no metadata service.
        provider.update(
            endpoints=dict.fromkeys(AWS_SERVICES, endpoint_url),
            skip_credentials_validation=True,
            skip_requesting_account_id=True,
            skip_metadata_api_check=True,
        )
    # The modules folder as one package, gateway-region in it (go-getter's "//"), as a registry
    # or a git subfolder would bring it: a plain absolute path would be a package of its own,
    # which its "../rabbitmq-nodes" may not leave.
    module = {"source": f"{MODULE_DIR.parent}//{MODULE_DIR.name}", **inputs}
    module.update({name: f"${{var.{name}}}" for name in NODE_FILE_TYPES})
    # An empty s3 block: the region folder's state.s3.tfbackend completes it at init.
    backend = {"s3": {}} if state is not None else {"local": {"path": "terraform.tfstate"}}
    return {
        "terraform": {
            "required_providers": {"aws": {"source": "hashicorp/aws", "version": ">= 5.40, < 6.0"}},
            "backend": backend,
        },
        "variable": {
            name: {"type": type_, "description": f"fedgate's node file, from {NODE_FILES}"}
            for name, type_ in NODE_FILE_TYPES.items()
        },
        "provider": {"aws": provider},
        "module": {"gateway": module},
        "output": {name: {"value": f"${{module.gateway.{name}}}"} for name in module_outputs()},
    }
