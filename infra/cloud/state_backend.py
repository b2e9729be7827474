"""Where the cloud regions' Terraform state lives: each region's folder (the default) or S3.

Local state ties a region to the machine that added it.  With a bucket, every
region's state is one S3 object (``<key_prefix>/<region>/terraform.tfstate``),
locked while Terraform runs: by a DynamoDB table if one is named, else by a lock
object beside the state (Terraform >= 1.10).  The bucket and the table exist
before the first region is added; fedgate does not create them (they outlive
every region).

The root module holds an empty ``backend "s3"`` block; the settings go to
``terraform init -backend-config=state.s3.tfbackend`` as a file in the region's
folder, so that ``terraform`` run by hand in that folder finds the same state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra.cloud.errors import CloudError

#: The partial backend configuration's file in a region's folder.
BACKEND_FILE = "state.s3.tfbackend"

#: The settings' environment variables, named in errors.
ENV = {
    "bucket": "FEDGATE_CLOUD_STATE_BUCKET",
    "key_prefix": "FEDGATE_CLOUD_STATE_KEY_PREFIX",
    "region": "FEDGATE_CLOUD_STATE_REGION",
}


@dataclass(frozen=True)
class S3StateBackend:
    """The regions' Terraform state in an S3 bucket (settings cloud_state_*: LocalSettings)."""

    bucket: str
    region: str
    key_prefix: str = "fedgate"
    #: empty: a lock object beside the state in the bucket
    lock_table: str = ""
    #: one endpoint for S3 and DynamoDB (a moto server in tests); empty: AWS
    endpoint_url: str = ""

    def __post_init__(self) -> None:
        for name in ("bucket", "region"):
            if not getattr(self, name):
                raise CloudError(f"{ENV[name]} is required with {ENV['bucket']} (remote Terraform state)")
        if self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise CloudError(f"{ENV['key_prefix']}={self.key_prefix!r}: no leading or trailing '/'")

    @classmethod
    def from_settings(cls, s: Any, env: Mapping[str, str]) -> S3StateBackend | None:
        """From LocalSettings' cloud_state_*; None without a bucket (local state).  The region
        defaults to the AWS SDK's own variables in `env`."""
        if not s.cloud_state_bucket:
            return None
        return cls(
            s.cloud_state_bucket,
            s.cloud_state_region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "",
            s.cloud_state_key_prefix,
            s.cloud_state_lock_table,
            s.aws_endpoint_url,
        )

    def key(self, region: str) -> str:
        return f"{self.key_prefix}/{region}/terraform.tfstate"

    def config(self, region: str) -> dict[str, Any]:
        """The backend settings of one region's root module."""
        cfg: dict[str, Any] = {
            "bucket": self.bucket,
            "key": self.key(region),
            "region": self.region,
            "encrypt": True,
        }
        if self.lock_table:
            cfg["dynamodb_table"] = self.lock_table
        else:
            cfg["use_lockfile"] = True
        if self.endpoint_url:
            # a stand-in answers S3 and DynamoDB: path-style buckets, no account or credential lookups
            cfg.update(
                endpoints={"s3": self.endpoint_url, "dynamodb": self.endpoint_url},
                use_path_style=True,
                skip_credentials_validation=True,
                skip_requesting_account_id=True,
                skip_metadata_api_check=True,
                skip_region_validation=True,
            )
        return cfg

    def tfbackend(self, region: str) -> str:
        """The config as a .tfbackend file (HCL attributes; JSON's literals are HCL's too)."""
        lines = ["# written by fedgate: the region's state in S3 (terraform init -backend-config=this file)"]
        for name, value in self.config(region).items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{name} = {{ {inner} }}")
            else:
                lines.append(f"{name} = {json.dumps(value)}")
        return "\n".join(lines) + "\n"
