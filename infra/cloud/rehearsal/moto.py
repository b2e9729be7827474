"""A moto server on loopback: AWS's APIs for Terraform to plan and apply against.

moto stores what Terraform creates and boots nothing; its EC2 offers the images of
`images` (MOTO_AMIS_PATH) instead of its own list, so that the modules' Debian 13 lookup
finds one.  Its Route53 keeps what a CLOUDWATCH_METRIC health check is made of, which
moto 5.2 drops (keep_route53_alarm_health_checks).

    python -m infra.cloud.rehearsal.moto -H 127.0.0.1 -p 5000   # moto_server, so patched
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

from backend.errors import FedgateError
from backend.polling import wait_until
from infra.cloud.root_module import AWS_SERVICES
from infra.local.ports import free_port
from infra.local.settings import PROJECT_ROOT

#: Debian's official AMI account, the rabbitmq-nodes module's default owner.
DEBIAN_OWNER = "136693071363"


class MotoError(FedgateError):
    """moto's server is missing or did not start."""


def debian_image(
    ami_id: str, name: str, arch: str, created: str, owner: str = DEBIAN_OWNER
) -> dict[str, Any]:
    """An image as moto's MOTO_AMIS_PATH file lists it."""
    return {
        "ami_id": ami_id,
        "name": name,
        "owner_id": owner,
        "architecture": arch,
        "creation_date": created,
        "state": "available",
        "public": True,
        "image_type": "machine",
        "virtualization_type": "hvm",
        "hypervisor": "xen",
        "root_device_type": "ebs",
        "root_device_name": "/dev/xvda",
        "description": name,
    }


class MotoServer:
    """`with MotoServer(images) as moto:` -- moto.url until the block ends (then stopped)."""

    def __init__(self, images: list[dict[str, Any]], host: str = "127.0.0.1", port: int = 0):
        self.images = images
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self, timeout: float = 30) -> None:
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            raise MotoError(
                f"moto's server is missing from {sys.executable}: run `make setup` (moto[server])"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="fedgate-moto-")
        amis = Path(self._dir.name) / "amis.json"
        amis.write_text(json.dumps(self.images))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "infra.cloud.rehearsal.moto", "-H", self.host, "-p", str(self.port)],
            env={**os.environ, "MOTO_AMIS_PATH": str(amis), "PYTHONPATH": str(PROJECT_ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        proc = self._proc

        def listening_or_exited() -> str:
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return "listening"
            except OSError:
                return "exited" if proc.poll() is not None else ""

        if wait_until(listening_or_exited, timeout, 0.2) != "listening":
            self.stop()
            raise MotoError(f"moto_server did not start on {self.url}")

    def stop(self) -> None:
        """Safe twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> MotoServer:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


#: what an applied backend example calls beside the root module's services: its buckets, the
#: routers' release and secret, MSK's key, the tables' catalog database
APPLY_SERVICES = ("s3", "secretsmanager", "kms", "rds")


def provider_override(url: str, region: str) -> str:
    """A Terraform file (name it *_override.tf) that points every AWS API of a root module at
    moto at `url`, with moto's credentials and no account or metadata lookups (S3 by path:
    moto's buckets are no host names)."""
    endpoints = "\n".join(f'    {s} = "{url}"' for s in (*AWS_SERVICES, *APPLY_SERVICES))
    return f"""# written by fedgate: every AWS API goes to moto
provider "aws" {{
  region                      = "{region}"
  access_key                  = "testing"
  secret_key                  = "testing"
  skip_credentials_validation = true
  skip_requesting_account_id  = true
  skip_metadata_api_check     = true
  s3_use_path_style           = true

  endpoints {{
{endpoints}
  }}
}}
"""


def keep_route53_alarm_health_checks() -> None:
    """moto 5.2's Route53 stores a CLOUDWATCH_METRIC health check without its alarm and its
    status without data, and answers it with an endpoint check's port and interval: Terraform
    would plan a change after every apply, and nothing could read which alarm a region's health
    follows.  Patched to keep what AWS keeps (idempotent)."""
    from moto.route53.models import HealthCheck
    from moto.route53.responses import Route53

    if getattr(Route53.create_health_check, "_fedgate", False):
        return
    create, config = Route53.create_health_check, HealthCheck.health_check_config

    def create_health_check(self: Route53) -> Any:
        request = self._get_param("HealthCheckConfig") or {}
        result = create(self)
        reference = self._get_param("CallerReference")
        for hc in self.backend.health_checks.values():
            if hc.caller_reference == reference:
                kept = {
                    k: request[k] for k in ("AlarmIdentifier", "InsufficientDataHealthStatus") if k in request
                }
                setattr(hc, "fedgate_alarm", kept)  # noqa: B010 -- an attribute moto's model lacks
        return result

    def health_check_config(self: HealthCheck) -> dict[str, Any]:
        cfg = dict(config.fget(self))  # type: ignore[attr-defined]
        if self.type_ == "CLOUDWATCH_METRIC":
            for endpoint_only in (
                "IPAddress",
                "Port",
                "RequestInterval",
                "FailureThreshold",
                "MeasureLatency",
            ):
                cfg.pop(endpoint_only, None)
            cfg.update(getattr(self, "fedgate_alarm", {}))
        return cfg

    create_health_check._fedgate = True  # type: ignore[attr-defined]
    Route53.create_health_check = create_health_check  # type: ignore[method-assign]
    HealthCheck.health_check_config = property(health_check_config)  # type: ignore[assignment,method-assign]


if __name__ == "__main__":
    from moto.server import main

    keep_route53_alarm_health_checks()
    main(sys.argv[1:])
