"""A moto server on loopback: AWS's APIs for Terraform to plan and apply against.

moto stores what Terraform creates and boots nothing; its EC2 offers the images of
`images` (MOTO_AMIS_PATH) instead of its own list, so that the modules' Debian 13 lookup
finds one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from backend.errors import FedgateError
from infra.cloud.root_module import AWS_SERVICES
from infra.local.ports import free_port

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
        server = Path(sys.executable).with_name("moto_server")
        if not server.exists():
            raise MotoError(f"{server} missing: run `make setup` (moto[server] is a dev dependency)")
        self._dir = tempfile.TemporaryDirectory(prefix="fedgate-moto-")
        amis = Path(self._dir.name) / "amis.json"
        amis.write_text(json.dumps(self.images))
        self._proc = subprocess.Popen(
            [str(server), "-H", self.host, "-p", str(self.port)],
            env={**os.environ, "MOTO_AMIS_PATH": str(amis)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise MotoError(f"moto_server did not start on {self.url}") from None
                time.sleep(0.2)

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
