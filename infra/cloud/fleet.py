"""The cloud regions as recorded, and what is done to regions that run.

A region's folder (``<cloud_state_dir>/<region>``) holds its root module and
``outputs.json``, the outputs of its last apply.  From those, the backend is told
about every applied region (registration.py), device users reach the running
gateways, and the latency record each region needs is checked.  The Terraform
side -- writing the root module, plan, apply, destroy -- is driver.py's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions

from backend import contract as c
from backend import region_registry
from backend.definitions import NodeDefinitions
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from infra.cloud import registration, route53
from infra.cloud.errors import CloudError
from infra.device_registry import DeviceUpdate, apply_to_gateway, sync_gateway
from infra.local.settings import LocalSettings
from infra.local.tls import LocalCA
from infra.regions import RegionRow
from infra.secrets_file import SecretsFile

KIND = "cloud"
#: How long a removed region's objects stay after it left the registry: the deployed routers
#: read it every 5 s (router regions_poll_s), so by then none routes to the region.
ROUTERS_POLL_MARGIN_S = 10.0

Progress = Callable[[str], None]


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
            kind=KIND,
            gateway=self.outputs.get("autoscaling_group_name", "-"),
            state=self.state + ("" if self.registered else " (not registered)"),
            mqtt=self.mqtt,
            connections=None,
        )


class CloudFleet:
    """The cloud regions with a folder here: their records, secrets, backend registration,
    device users and DNS check."""

    def __init__(self, settings: LocalSettings, progress: Progress | None = None):
        self.settings = settings
        self.progress: Progress = progress or (lambda msg: None)

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
        # router: the routers' backend user; router_gateways: their monitoring user on every
        # gateway (gateways/wiring.py); kafka_client: the Kafka SCRAM user of the routers and
        # the Spark job; catalog: the tables' catalog database (RDS); the backend module takes
        # them from backend-secrets.auto.tfvars.json
        return store.ensure(("admin", "backend_link", "router", "router_gateways", "kafka_client", "catalog"))

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

    # --- TLS ------------------------------------------------------------------------------------

    @property
    def ca(self) -> LocalCA:
        """The cloud nodes' CA: the same openssl CA as the local federation's, kept beside the state."""
        return LocalCA(self.state_dir / "tls")

    def gateway_server_name(self, region: str) -> str:
        """The name a region's node certificate carries: the backend's links and the routers'
        management clients check it."""
        return f"gw-{c.validate_region(region)}.{self.settings.cloud_domain}"

    def backend_server_name(self) -> str:
        return f"backend.{self.settings.cloud_domain}"

    # --- backend registration -------------------------------------------------------------------

    def backend_admin(self) -> RabbitAdmin | None:
        """The backend's management API as `make gateway` reaches it: over HTTPS with node TLS,
        its certificate checked against the nodes' CA for backend.<domain>."""
        s = self.settings
        if not s.cloud_backend_management_url:
            return None
        password = s.cloud_backend_password or self.secrets()["admin"]
        https = s.cloud_backend_management_url.startswith("https:")
        return RabbitAdmin(
            s.cloud_backend_management_url,
            s.cloud_backend_user,
            password,
            ca_file=str(self.ca.ca_cert) if https else "",
            server_name=self.backend_server_name() if https else "",
        )

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
                router_password=sec["router"],
                uplink_shards=self.settings.uplink_shards,
            )
        except AdminError as e:
            raise CloudError(f"registering with the backend at {admin.base_url}: {e}") from e
        # the region registry the deployed routers poll (backend/region_registry.py): a region
        # reaches running routers without a restart
        gateways = {
            r.region: {
                "management_url": [r.outputs["management_url"]],
                # the gateways' monitoring user, never their administrator
                "user": c.ROUTER_USER,
                "password": sec["router_gateways"],
                # over HTTPS with node TLS: the routers check the gateways' certificate
                **(
                    {"ca_pem": self.ca.ca_cert.read_text(), "server_name": self.gateway_server_name(r.region)}
                    if r.outputs["management_url"].startswith("https:")
                    else {}
                ),
            }
            for r in self.records()
            if r.state == "applied" and r.outputs.get("management_url")
        }
        try:
            region_registry.sync(admin, gateways)
        except AdminError as e:
            raise CloudError(f"registering the regions for the routers at {admin.base_url}: {e}") from e
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
            # the routers first: they stop routing to the region within a poll of the registry,
            # before its downlink exchange goes (a command sent to it then would be refused)
            if region_registry.deregister(admin, region):
                time.sleep(ROUTERS_POLL_MARGIN_S)
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
                regional=lambda service: boto3.client(
                    service, region_name=o["aws_region"], endpoint_url=self.settings.aws_endpoint_url or None
                ),
            )
        except route53.Route53VerificationError as e:
            raise CloudError(f"{rec.region}: {e}") from e
        r, hc = found
        self.progress(
            f"{rec.region}: latency record {r.name} [{r.set_identifier}] -> {r.targets[0]}, "
            f"health check {hc.id} ({hc.type}: alarm {hc.alarm_name} on the load balancer's healthy nodes)"
        )
        return found
