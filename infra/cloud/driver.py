"""The cloud driver: a region in AWS through Terraform (python-terraform) and boto3.

``add(region)``:

1. checks before touching anything: the name is a real AWS region,
   terraform and the AWS provider are there, AWS credentials are there, the
   cloud settings are set;
2. writes the region's root module (``<cloud_state_dir>/<region>/main.tf.json``,
   mode 600: it carries the region's passwords) around
   ``infra/terraform/modules/gateway-region``, with fedgate's node files beside
   it (root_module.py). One folder per region; its state there, or in S3
   (state_backend.py);
3. ``terraform init`` against the provider mirror, ``plan -out``, shows the
   plan and applies it after confirmation (or ``auto_approve``). A region that
   exists already plans no changes and applies nothing;
4. records the outputs (``outputs.json``);
5. registers the region with the backend (backend/wiring.py definitions,
   applied by backend/rabbitmq_admin.py) and checks with boto3 that the
   latency record and its health check are what devices need.

``remove(region)`` deregisters it from the backend, plans a destroy, applies
it after confirmation and deletes the region's folder.

The regions' records, backend registration, device users and the DNS check
are fleet.py's (CloudFleet, which CloudDriver extends).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3

from backend import contract as c
from backend.devices import device_users
from backend.rabbitmq_admin import definitions_file
from backend.wiring import AmqpEndpoint
from gateways.wiring import gateway_definitions
from infra.cloud import registration
from infra.cloud.errors import CloudError
from infra.cloud.fleet import KIND, CloudFleet, CloudRegion, Progress
from infra.cloud.regions import UnknownRegionError, validate_aws_region
from infra.cloud.root_module import (
    NODE_FILES,
    RABBITMQ_VERSION,
    gateway_node_files,
    gateway_root_module,
)
from infra.cloud.state_backend import BACKEND_FILE, S3StateBackend
from infra.cloud.terraform_run import TerraformRun, terraform_in
from infra.cloud.toolchain import Toolchain, ToolchainError, detect
from infra.device_registry import DeviceRegistry
from infra.local.settings import LocalSettings
from infra.secrets_file import write_private_json

__all__ = ["CloudDriver", "CloudError", "CloudRegion"]

Confirm = Callable[[str], bool]


class CloudDriver(CloudFleet):
    """The RegionDriver (infra/regions.py) of AWS regions: the Terraform side of a region;
    its records and what is done to it once it runs are CloudFleet's."""

    kind = KIND

    def __init__(
        self,
        settings: LocalSettings,
        progress: Progress | None = None,
        confirm: Confirm | None = None,
        state_backend: S3StateBackend | None = None,
    ):
        """`state_backend`: where the regions' state lives; None: the settings' cloud_state_*
        (no bucket there: each region's folder)."""
        super().__init__(settings, progress)
        self.confirm: Confirm = confirm or (lambda prompt: False)
        self.state_backend = state_backend or S3StateBackend.from_settings(settings, os.environ)

    # --- checks -----------------------------------------------------------------------------

    def check(self, region: str, *, for_add: bool = True) -> Toolchain:
        """Everything that can be checked before Terraform runs; CloudError names what is wrong."""
        try:
            c.validate_region(region)
            validate_aws_region(region)
        except (UnknownRegionError, c.InvalidRegionError) as e:
            raise CloudError(str(e)) from e
        try:
            toolchain = detect(
                terraform_bin=self.settings.terraform_bin,
                mirror=self.settings.tf_plugin_mirror,
                cache_dir=self.settings.cache_dir,
                require_mirror=False,
            )
        except ToolchainError as e:
            raise CloudError(str(e)) from e
        if boto3.session.Session(region_name=region).get_credentials() is None:
            raise CloudError(
                "no AWS credentials: set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(Terraform and the Route53 check use the same ones)"
            )
        if for_add:
            s = self.settings
            missing = [
                f"FEDGATE_{name.upper()}"
                for name in (
                    "cloud_domain",
                    "cloud_zone_id",
                    "cloud_admin_cidrs",
                    "cloud_backend_cidrs",
                    "cloud_backend_amqp_host",
                )
                if not getattr(s, name)
            ]
            if missing:
                raise CloudError(
                    f"cloud settings missing: {', '.join(missing)} (see `fedgate settings` and "
                    "docs/operations.md, 'Cloud regions')"
                )
        return toolchain

    # --- terraform ---------------------------------------------------------------------------

    def root_module(self, region: str) -> dict[str, Any]:
        """The region's root module (JSON syntax): the gateway-region module with the region's
        settings and passwords (root_module.py adds the provider, node files and outputs)."""
        s = self.settings
        sec = self.secrets(region)
        backend_ep = AmqpEndpoint(
            s.cloud_backend_amqp_host,
            s.cloud_backend_amqp_port,
            tls=s.tls,
            ca_file=f"{registration.NODE_TLS_DIR}/ca.pem" if s.tls else "",
            server_name=self.backend_server_name() if s.tls else "",
        )
        definitions = gateway_definitions(
            region,
            backend_ep,
            admin_password=sec["admin"],
            backend_link_password=sec["backend_link"],
            gateway_password=sec["gateways"][region],
            router_password=sec["router_gateways"],
        )
        # the fleet's devices (hashes only) are users of the new gateway from its first boot
        fleet = device_users(DeviceRegistry(s.device_registry_file).hashes())
        definitions.users += fleet.users
        definitions.permissions += fleet.permissions
        definitions.topic_permissions += fleet.topic_permissions
        module: dict[str, Any] = {
            "region": region,
            "node_count": s.cloud_node_count,
            "instance_type": s.cloud_instance_type,
            "admin_cidr_blocks": list(s.cloud_admin_cidrs),
            "backend_cidr_blocks": list(s.cloud_backend_cidrs),
            "admin_password": sec["admin"],
            "erlang_cookie": sec["erlang_cookies"][region],
            "rabbitmq_definitions": json.dumps(
                definitions_file(definitions, rabbit_version=RABBITMQ_VERSION),
                sort_keys=True,
                separators=(",", ":"),
            ),
            "zone_id": s.cloud_zone_id,
            "mqtt_hostname": f"mqtt.{s.cloud_domain}",
        }
        if s.cloud_ami_id:
            module["ami_id"] = s.cloud_ami_id
        if s.tls:
            module.update(self._node_tls(f"gw-{region}", self.gateway_server_name(region)))
        return gateway_root_module(region, module, endpoint_url=s.aws_endpoint_url, state=self.state_backend)

    def write_root_module(self, region: str) -> Path:
        """The region's folder with its root module, node files and state backend settings."""
        d = self.region_dir(region)
        d.mkdir(parents=True, exist_ok=True)
        write_private_json(d / "main.tf.json", self.root_module(region))
        (d / NODE_FILES).write_text(json.dumps(gateway_node_files(), indent=2))
        if self.state_backend is not None:
            (d / BACKEND_FILE).write_text(self.state_backend.tfbackend(region))
        else:
            (d / BACKEND_FILE).unlink(missing_ok=True)
        return d

    def _init(self, tf: TerraformRun) -> None:
        tf.init(backend_config=BACKEND_FILE if self.state_backend is not None else None)

    def _approved(self, action: str, auto_approve: bool) -> bool:
        if auto_approve:
            return True
        return self.confirm(f"{action}? Only 'yes' will be accepted: ")

    # --- add / remove ----------------------------------------------------------------------------

    def add(self, region: str, *, auto_approve: bool = False, plan_out: Progress = print) -> CloudRegion:
        toolchain = self.check(region)
        d = self.write_root_module(region)
        with terraform_in(d, toolchain) as tf:
            state = (
                f"state s3://{self.state_backend.bucket}/{self.state_backend.key(region)}"
                if self.state_backend is not None
                else "local state"
            )
            self.progress(f"{region}: terraform init ({toolchain.mirror or 'registry'}, {state})")
            self._init(tf)
            self.progress(f"{region}: terraform plan")
            changed, plan_text = tf.plan()
            if changed:
                plan_out(plan_text)
                if not self._approved(f"apply this plan to {region}", auto_approve):
                    raise CloudError(f"{region}: plan not applied (not confirmed; --auto-approve applies it)")
                t0 = time.monotonic()
                self.progress(f"{region}: terraform apply")
                try:
                    tf.apply_plan()
                except CloudError:
                    self._write_record(CloudRegion(region, "failed", {}, False, time.time()))
                    raise
                self.progress(f"{region}: applied in {time.monotonic() - t0:.0f}s")
            else:
                self.progress(f"{region}: no changes; the infrastructure matches the configuration")
            outputs = tf.output()
        if outputs is None:
            raise CloudError(f"{region}: terraform output failed")
        values = {k: v["value"] for k, v in outputs.items() if not v.get("sensitive")}
        rec = CloudRegion(region, "applied", values, False, time.time())
        self._write_record(rec)
        rec.registered = self.register_with_backend()
        self._write_record(rec)
        self.verify_dns(rec)
        return rec

    def remove(self, region: str, *, auto_approve: bool = False, plan_out: Progress = print) -> None:
        try:
            c.validate_region(region)
        except c.InvalidRegionError as e:
            raise CloudError(str(e)) from e
        d = self.region_dir(region)
        if not (d / "main.tf.json").exists():
            self.progress(f"region {region} is not part of the federation")
            return
        toolchain = self.check(region, for_add=False)
        with terraform_in(d, toolchain) as tf:
            self._init(tf)
            changed, plan_text = tf.plan(destroy=True)
            if changed:
                plan_out(plan_text)
                if not self._approved(f"destroy {region}", auto_approve):
                    raise CloudError(f"{region}: not destroyed (not confirmed; --auto-approve destroys it)")
            # Stop the backend's links to the region before its gateways go away.
            self.deregister_from_backend(region)
            if changed:
                self.progress(f"{region}: terraform destroy")
                tf.apply_plan()
        shutil.rmtree(d)
        self._forget_secrets(region)
        self.progress(f"region {region} removed")

    # --- TLS ------------------------------------------------------------------------------------

    def _node_tls(self, node: str, server_name: str) -> dict[str, Any]:
        """The node_tls and node_tls_key_pem inputs of the gateway-region and backend modules."""
        cert = self.ca.node_cert(node, server_name)
        return {
            "node_tls": {
                "ca_pem": cert.ca.read_text(),
                "cert_pem": cert.cert.read_text(),
                "server_name": server_name,
            },
            "node_tls_key_pem": cert.key.read_text(),
        }

    def write_backend_tls(self) -> Path:
        """The backend module's TLS inputs as a tfvars file (mode 600) for the backend root module."""
        if not self.settings.cloud_domain:
            raise CloudError(
                "set FEDGATE_CLOUD_DOMAIN first: the backend's certificate is for backend.<domain>"
            )
        path = self.state_dir / "backend-tls.auto.tfvars.json"
        write_private_json(path, self._node_tls("backend", self.backend_server_name()))
        return path

    def write_backend_secrets(self) -> Path:
        """The backend module's passwords fedgate generates, as a tfvars file (mode 600): the
        routers' backend user (which `gateway add` creates with it), the Kafka SCRAM user and
        the tables' catalog database."""
        sec = self.secrets()
        path = self.state_dir / "backend-secrets.auto.tfvars.json"
        write_private_json(
            path,
            {
                "router_password": sec["router"],
                "kafka_sasl_password": sec["kafka_client"],
                "catalog_password": sec["catalog"],
            },
        )
        return path
