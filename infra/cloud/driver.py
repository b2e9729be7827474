"""The cloud driver: a region in AWS through Terraform (python-terraform) and boto3.

``add(region)``:

1. checks before touching anything: the name is a real AWS region,
   terraform and the AWS provider are there, AWS credentials are there, the
   cloud settings are set;
2. writes the region's root module (``<cloud_state_dir>/<region>/main.tf.json``,
   mode 600: it carries the region's passwords) around
   ``infra/terraform/modules/gateway-region``. One folder, one local state per
   region;
3. ``terraform init`` against the provider mirror, ``plan -out``, shows the
   plan and applies it after confirmation (or ``auto_approve``). A region that
   exists already plans no changes and applies nothing;
4. records the outputs (``outputs.json``);
5. registers the region with the backend (backend/wiring.py definitions,
   applied by backend/rabbitmq_admin.py) and checks with boto3 that the
   latency record and its health check are what devices need.

``remove(region)`` deregisters it from the backend, plans a destroy, applies
it after confirmation and deletes the region's folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
from python_terraform import IsFlagged, Terraform

from backend import contract as c
from backend.definitions import NodeDefinitions
from backend.devices import device_users
from backend.errors import FedgateError
from backend.rabbitmq_admin import AdminError, RabbitAdmin, definitions_file
from backend.wiring import AmqpEndpoint
from gateways.wiring import gateway_definitions
from infra.cloud import registration, route53
from infra.cloud.regions import UnknownRegionError, validate_aws_region
from infra.cloud.toolchain import Toolchain, ToolchainError, detect
from infra.device_registry import DeviceRegistry, DeviceUpdate, apply_to_gateway, sync_gateway
from infra.local.settings import PROJECT_ROOT, LocalSettings
from infra.local.tls import LocalCA
from infra.regions import RegionRow
from infra.secrets_file import SecretsFile, write_private_json

MODULE_DIR = PROJECT_ROOT / "infra" / "terraform" / "modules" / "gateway-region"
PLAN_FILE = "tfplan"

#: RabbitMQ on the cloud nodes: Debian 13's rabbitmq-server, the release the local nodes run
#: (the rabbitmq-nodes module boots Debian 13 and starts no other release).
RABBITMQ_VERSION = "4.0.5"

#: AWS APIs the gateway-region module calls; all go to aws_endpoint_url when it is set.
AWS_SERVICES = ("ec2", "elbv2", "autoscaling", "iam", "route53", "sts")

Progress = Callable[[str], None]
Confirm = Callable[[str], bool]


class CloudError(FedgateError):
    """A cloud region could not be added, removed or read; the message says what to do."""


def module_outputs() -> list[str]:
    """Output names of the gateway-region module (its outputs.tf), re-exported by the root module."""
    return re.findall(r'^output "([^"]+)"', (MODULE_DIR / "outputs.tf").read_text(), re.M)


@dataclass
class CloudRegion:
    region: str
    state: str  # applied | planned | failed
    outputs: dict[str, Any]
    registered: bool
    updated_at: float

    @property
    def mqtt(self) -> str:
        host = self.outputs.get("mqtt_hostname") or (self.outputs.get("mqtt_endpoint") or {}).get("host")
        return f"{host}:{route53.MQTT_PORT}" if host else "-"

    def summary(self) -> str:
        """What `fedgate gateway add` prints."""
        return (
            f"{self.region}: {self.state}, MQTT {self.mqtt}, registered with the backend: "
            f"{'yes' if self.registered else 'no'}"
        )

    def row(self) -> RegionRow:
        """Its line of `fedgate regions`, as last recorded by Terraform."""
        return RegionRow(
            region=self.region,
            kind=CloudDriver.kind,
            gateway=self.outputs.get("autoscaling_group_name", "-"),
            state=self.state + ("" if self.registered else " (not registered)"),
            mqtt=self.mqtt,
            connections=None,
        )


class CloudDriver:
    """The RegionDriver (infra/regions.py) of AWS regions."""

    kind = "cloud"

    def __init__(
        self, settings: LocalSettings, progress: Progress | None = None, confirm: Confirm | None = None
    ):
        self.settings = settings
        self.progress: Progress = progress or (lambda msg: None)
        self.confirm: Confirm = confirm or (lambda prompt: False)

    # --- files ------------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.settings.cloud_state_dir

    def region_dir(self, region: str) -> Path:
        return self.state_dir / c.validate_region(region)

    @property
    def secrets_file(self) -> Path:
        return self.state_dir / "secrets.json"

    def secrets(self, region: str | None = None) -> dict[str, Any]:
        """Generated once per cloud state folder; a region gets its link password and cookie on first use."""
        store = SecretsFile(self.secrets_file)
        if region is not None:
            store.ensure(per_region={"gateways": [region], "erlang_cookies": [region]}, nbytes=24)
        return store.ensure(("admin", "backend_link"))

    def _forget_secrets(self, region: str) -> None:
        SecretsFile(self.secrets_file).forget(region, ("gateways", "erlang_cookies"))

    def record(self, region: str) -> CloudRegion | None:
        try:
            data = json.loads((self.region_dir(region) / "outputs.json").read_text())
        except FileNotFoundError:
            return None
        return CloudRegion(
            data["region"], data["state"], data["outputs"], data["registered"], data["updated_at"]
        )

    def _write_record(self, rec: CloudRegion) -> None:
        path = self.region_dir(rec.region) / "outputs.json"
        path.write_text(json.dumps(rec.__dict__, indent=2))

    def regions(self) -> list[RegionRow]:
        """`fedgate regions`' lines: every cloud region with a folder here, as last recorded."""
        return [rec.row() for rec in self.records()]

    def records(self) -> list[CloudRegion]:
        """Every cloud region with a folder here, as last recorded."""
        if not self.state_dir.is_dir():
            return []
        out = []
        for d in sorted(self.state_dir.iterdir()):
            if (d / "main.tf.json").exists():
                rec = self.record(d.name)
                out.append(rec or CloudRegion(d.name, "planned", {}, False, d.stat().st_mtime))
        return out

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
        """The region's root module (JSON syntax): the provider, the gateway-region module, its outputs."""
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
        )
        # the fleet's devices (hashes only) are users of the new gateway from its first boot
        fleet = device_users(DeviceRegistry(s.device_registry_file).hashes())
        definitions.users += fleet.users
        definitions.permissions += fleet.permissions
        definitions.topic_permissions += fleet.topic_permissions
        provider: dict[str, Any] = {"region": region}
        if s.aws_endpoint_url:
            # moto (or another stand-in) answers every API: no account lookups, no metadata service.
            provider.update(
                endpoints=dict.fromkeys(AWS_SERVICES, s.aws_endpoint_url),
                skip_credentials_validation=True,
                skip_requesting_account_id=True,
                skip_metadata_api_check=True,
            )
        module: dict[str, Any] = {
            "source": str(MODULE_DIR),
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
        return {
            "terraform": {
                "required_providers": {"aws": {"source": "hashicorp/aws", "version": ">= 5.40, < 6.0"}},
                "backend": {"local": {"path": "terraform.tfstate"}},
            },
            "provider": {"aws": provider},
            "module": {"gateway": module},
            "output": {name: {"value": f"${{module.gateway.{name}}}"} for name in module_outputs()},
        }

    @contextlib.contextmanager
    def _terraform(self, region: str, toolchain: Toolchain) -> Iterator[Terraform]:
        """python-terraform in the region's folder, with our CLI config in its environment."""
        env = toolchain.env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            tf = Terraform(
                working_dir=str(self.region_dir(region)), terraform_bin_path=str(toolchain.terraform)
            )
            tf.variables = None  # the root module holds its inputs; no -var-file
            yield tf
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    @staticmethod
    def _run(
        what: str, result: tuple[int, str | None, str | None], ok: tuple[int, ...] = (0,)
    ) -> tuple[int, str]:
        code, out, err = result
        if code not in ok:
            detail = (err or out or "").strip()
            raise CloudError(f"terraform {what} failed (exit {code}):\n{detail}")
        return code, out or ""

    def _init(self, tf: Terraform) -> None:
        self._run("init", tf.cmd("init", input=False, no_color=IsFlagged, upgrade=IsFlagged))

    def _plan(self, tf: Terraform, *, destroy: bool = False) -> tuple[bool, str]:
        """(has changes, plan text). Exit code 2 of -detailed-exitcode means changes."""
        code, out = self._run(
            "plan",
            tf.plan(
                out=PLAN_FILE,
                destroy=IsFlagged if destroy else None,
                input=False,
                no_color=IsFlagged,
                lock_timeout="60s",
            ),
            ok=(0, 2),
        )
        return code == 2, out

    def _apply_plan(self, tf: Terraform) -> None:
        self._run("apply", tf.apply(PLAN_FILE, skip_plan=True, input=False, no_color=IsFlagged))

    def _approved(self, action: str, auto_approve: bool) -> bool:
        if auto_approve:
            return True
        return self.confirm(f"{action}? Only 'yes' will be accepted: ")

    # --- add / remove ----------------------------------------------------------------------------

    def add(self, region: str, *, auto_approve: bool = False, plan_out: Progress = print) -> CloudRegion:
        toolchain = self.check(region)
        d = self.region_dir(region)
        d.mkdir(parents=True, exist_ok=True)
        write_private_json(d / "main.tf.json", self.root_module(region))
        with self._terraform(region, toolchain) as tf:
            self.progress(f"{region}: terraform init ({toolchain.mirror or 'registry'})")
            self._init(tf)
            self.progress(f"{region}: terraform plan")
            changed, plan_text = self._plan(tf)
            if changed:
                plan_out(plan_text)
                if not self._approved(f"apply this plan to {region}", auto_approve):
                    raise CloudError(f"{region}: plan not applied (not confirmed; --auto-approve applies it)")
                t0 = time.monotonic()
                self.progress(f"{region}: terraform apply")
                try:
                    self._apply_plan(tf)
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
        with self._terraform(region, toolchain) as tf:
            self._init(tf)
            changed, plan_text = self._plan(tf, destroy=True)
            if changed:
                plan_out(plan_text)
                if not self._approved(f"destroy {region}", auto_approve):
                    raise CloudError(f"{region}: not destroyed (not confirmed; --auto-approve destroys it)")
            # Stop the backend's links to the region before its gateways go away.
            self.deregister_from_backend(region)
            if changed:
                self.progress(f"{region}: terraform destroy")
                self._apply_plan(tf)
        shutil.rmtree(d)
        self._forget_secrets(region)
        self.progress(f"region {region} removed")

    # --- TLS ------------------------------------------------------------------------------------

    @property
    def ca(self) -> LocalCA:
        """The cloud nodes' CA: the same openssl CA as the local federation's, kept beside the state."""
        return LocalCA(self.state_dir / "tls")

    def gateway_server_name(self, region: str) -> str:
        """The name a region's node certificate carries and the backend's links check."""
        return f"gw-{c.validate_region(region)}.{self.settings.cloud_domain}"

    def backend_server_name(self) -> str:
        return f"backend.{self.settings.cloud_domain}"

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

    # --- backend registration -------------------------------------------------------------------

    def backend_admin(self) -> RabbitAdmin | None:
        s = self.settings
        if not s.cloud_backend_management_url:
            return None
        password = s.cloud_backend_password or self.secrets()["admin"]
        return RabbitAdmin(s.cloud_backend_management_url, s.cloud_backend_user, password)

    def register_with_backend(self) -> bool:
        """Apply the backend's side for every applied region (the upstream sets list them all)."""
        admin = self.backend_admin()
        if admin is None:
            self.progress("backend registration skipped: FEDGATE_CLOUD_BACKEND_MANAGEMENT_URL is not set")
            return False
        sec = self.secrets()
        links = [
            registration.link_for(r.region, r.outputs["amqp_endpoint"], sec["gateways"][r.region])
            for r in self.records()
            if r.state == "applied" and "amqp_endpoint" in r.outputs
        ]
        try:
            registration.register_regions(
                admin,
                links,
                admin_password=self.settings.cloud_backend_password or sec["admin"],
                backend_link_password=sec["backend_link"],
                uplink_shards=self.settings.uplink_shards,
            )
        except AdminError as e:
            raise CloudError(f"registering with the backend at {admin.base_url}: {e}") from e
        self.progress(f"backend {admin.base_url} holds {', '.join(lk.region for lk in links)}")
        return True

    def deregister_from_backend(self, region: str) -> None:
        """Remove the region's objects from the backend; the upstream sets then list the others."""
        rec = self.record(region)
        if rec is not None:
            rec.state = "destroying"  # no longer one of the regions register_with_backend lists
            self._write_record(rec)
        admin = self.backend_admin()
        if admin is None:
            return
        rest = [r for r in self.records() if r.state == "applied"]
        try:
            registration.deregister_region(admin, region)
            if not rest:
                registration.drop_upstream_sets(admin)
        except AdminError as e:
            raise CloudError(f"deregistering {region} from the backend at {admin.base_url}: {e}") from e
        if rest:
            self.register_with_backend()

    # --- devices on running gateways ---------------------------------------------------------------

    def gateway_admin(self, rec: CloudRegion) -> RabbitAdmin:
        """The management API of one running node of the region's gateway cluster.

        The API is not behind the load balancer: it listens on the nodes, open
        to admin_cidr_blocks only.  Users are cluster-wide, so one node will do.
        """
        aws = {
            "region_name": rec.outputs["aws_region"],
            "endpoint_url": self.settings.aws_endpoint_url or None,
        }
        groups = boto3.client("autoscaling", **aws).describe_auto_scaling_groups(
            AutoScalingGroupNames=[rec.outputs["autoscaling_group_name"]]
        )["AutoScalingGroups"]
        ids = [i["InstanceId"] for g in groups for i in g["Instances"] if i["LifecycleState"] == "InService"]
        if not ids:
            raise CloudError(f"{rec.region}: no gateway node in service")
        reservations = boto3.client("ec2", **aws).describe_instances(InstanceIds=ids)["Reservations"]
        hosts = [
            i.get("PublicIpAddress") or i["PrivateIpAddress"] for r in reservations for i in r["Instances"]
        ]
        return RabbitAdmin(f"http://{hosts[0]}:15672", c.ADMIN_USER, self.secrets()["admin"])

    def push_devices(self, added: NodeDefinitions | None, revoked: list[str]) -> DeviceUpdate:
        """Apply new device users and revocations to every applied cloud region's running gateways.

        `failed` names the regions that could not be updated, with why: the
        registry stays the truth, and `fedgate devices sync` pushes it again.
        A region added later gets the whole registry in its boot definitions.
        """
        return DeviceUpdate(
            failed=self._on_every_region(lambda admin: apply_to_gateway(admin, added, revoked))
        )

    def sync_devices(self, hashes: Mapping[str, str]) -> DeviceUpdate:
        """Make every cloud region's device users exactly the registry's (see sync_gateway)."""
        return DeviceUpdate(failed=self._on_every_region(lambda admin: sync_gateway(admin, hashes)))

    def _on_every_region(self, action: Callable[[RabbitAdmin], object]) -> dict[str, str]:
        failed: dict[str, str] = {}
        for rec in self.records():
            if rec.state != "applied":
                continue
            try:
                action(self.gateway_admin(rec))
            except (CloudError, AdminError, KeyError, botocore.exceptions.BotoCoreError,
                    botocore.exceptions.ClientError) as e:  # fmt: skip
                failed[rec.region] = str(e)
                continue
            self.progress(f"{rec.region}: devices updated on its gateways")
        return failed

    # --- DNS ---------------------------------------------------------------------------------------

    def route53_client(self) -> Any:
        return boto3.client("route53", endpoint_url=self.settings.aws_endpoint_url or None)

    def verify_dns(self, rec: CloudRegion) -> tuple[route53.LatencyRecord, route53.HealthCheck]:
        o = rec.outputs
        try:
            found = route53.verify_region_record(
                self.route53_client(),
                zone_id=self.settings.cloud_zone_id,
                hostname=o["mqtt_hostname"],
                set_identifier=rec.region,
                aws_region=o["aws_region"],
                target=o["lb_dns_name"],
            )
        except route53.Route53VerificationError as e:
            raise CloudError(f"{rec.region}: {e}") from e
        r, hc = found
        self.progress(
            f"{rec.region}: latency record {r.name} [{r.set_identifier}] -> {r.targets[0]}, "
            f"health check {hc.id} ({hc.type} {hc.fqdn}:{hc.port})"
        )
        return found
