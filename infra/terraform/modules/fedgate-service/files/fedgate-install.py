#!/usr/bin/python3
"""Installs a fedgate service on its instance before the first start (cloud-init runs it).

1. the release wheel from S3 into a virtualenv (/opt/fedgate/venv), its dependencies from
   PyPI (through the VPC's NAT gateway);
2. the service's secrets from Secrets Manager -- a JSON object of environment variables --
   into the unit's EnvironmentFile (mode 600, read by systemd as root), so no password is
   ever in the launch template, the config file or the process list;
3. with --id-variable, the instance's own name for the service (<service>-<instance id>,
   from the instance metadata service) into the same file: instances of one launch
   template are identical, and a router's id names its own queues;
4. with --jars-key, the Spark job's jars (a tar.gz of the release) into <prefix>/jars.

Retries what the first seconds of a boot may refuse (the instance role's credentials, the
network); fails loudly otherwise: cloud-init's log then says why the service is not running.
Runs with Debian's python3 and python3-boto3, before any venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import boto3

ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def retried(what: str, call: Callable[[], Any], attempts: int = 10) -> Any:
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 -- any failure of a boot's first seconds
            if attempt == attempts - 1:
                raise SystemExit(f"fedgate-install: {what} failed: {e}") from e
            time.sleep(min(2**attempt, 15))
    raise AssertionError("unreachable")


def env_file_text(secret: str) -> str:
    """The secret's JSON object as systemd EnvironmentFile lines; refuses what would not
    round-trip (a name that is not an environment variable's, a line break in a value)."""
    values = json.loads(secret)
    if not isinstance(values, dict):
        raise SystemExit("fedgate-install: the secret is not a JSON object of environment variables")
    lines = []
    for name, value in sorted(values.items()):
        if not ENV_NAME.fullmatch(name) or not isinstance(value, str) or "\n" in value:
            raise SystemExit(f"fedgate-install: secret entry {name!r}: NAME=single-line string only")
        # systemd: double quotes keep spaces; backslash and quote escaped
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{name}="{escaped}"')
    return "\n".join(lines) + "\n"


def instance_id(imds_url: str) -> str:
    """This instance's id from the metadata service (IMDSv2: a session token first)."""
    put = urllib.request.Request(
        f"{imds_url}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}
    )
    with urllib.request.urlopen(put, timeout=5) as r:
        token = r.read().decode()
    get = urllib.request.Request(
        f"{imds_url}/latest/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": token}
    )
    with urllib.request.urlopen(get, timeout=5) as r:
        found = r.read().decode().strip()
    if not re.fullmatch(r"i-[0-9a-f]+", found):
        raise ValueError(f"the metadata service's instance-id is {found!r}")
    return found


def unpack_jars(archive: str, dest: str) -> None:
    """The release's jars into `dest` (emptied first): plain .jar files only, no paths."""
    import shutil
    import tarfile

    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        bad = [m.name for m in members if not m.isfile() or "/" in m.name or not m.name.endswith(".jar")]
        if bad or not members:
            raise SystemExit(f"fedgate-install: the jars archive holds {bad[:3] or 'nothing'}, not jars")
        for m in members:
            source = tar.extractfile(m)
            assert source is not None
            with source, open(os.path.join(dest, m.name), "wb") as out:
                shutil.copyfileobj(source, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--region", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--key", required=True, help="the release wheel's key (its file name is kept)")
    p.add_argument("--secret-arn", required=True)
    p.add_argument("--env-file", required=True)
    p.add_argument("--prefix", default="/opt/fedgate", help="where the virtualenv goes")
    p.add_argument("--endpoint-url", help="an S3/Secrets Manager stand-in (tests)")
    p.add_argument(
        "--id-variable", help="also write NAME=<service>-<instance id> (e.g. FEDGATE_ROUTER_ROUTER_ID)"
    )
    p.add_argument("--service", default="fedgate", help="the <service> of --id-variable's value")
    p.add_argument("--imds-url", default="http://169.254.169.254", help="the instance metadata service")
    p.add_argument("--pip-arg", action="append", default=[], help="passed on to pip install")
    p.add_argument(
        "--jars-key", help="the Spark job's jars (tar.gz) in --bucket, unpacked into <prefix>/jars"
    )
    args = p.parse_args(argv)
    aws = {"region_name": args.region, "endpoint_url": args.endpoint_url}

    secret = retried(
        "reading the secret",
        lambda: boto3.client("secretsmanager", **aws).get_secret_value(SecretId=args.secret_arn)[
            "SecretString"
        ],
    )
    text = env_file_text(secret)
    if args.id_variable:
        if not ENV_NAME.fullmatch(args.id_variable):
            raise SystemExit(f"fedgate-install: --id-variable {args.id_variable!r} is not a variable name")
        found = retried("asking the metadata service for the instance id", lambda: instance_id(args.imds_url))
        text += f'{args.id_variable}="{args.service}-{found}"\n'
    os.makedirs(os.path.dirname(args.env_file), exist_ok=True)
    tmp = f"{args.env_file}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, args.env_file)

    with tempfile.TemporaryDirectory() as work:
        wheel = os.path.join(work, os.path.basename(args.key))
        retried(
            f"downloading s3://{args.bucket}/{args.key}",
            lambda: boto3.client("s3", **aws).download_file(args.bucket, args.key, wheel),
        )
        venv = os.path.join(args.prefix, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
        pip = [os.path.join(venv, "bin", "pip"), "install", "--quiet", "--no-input", *args.pip_arg, wheel]
        retried("pip install of the release", lambda: subprocess.run(pip, check=True))
        if args.jars_key:
            archive = os.path.join(work, "jars.tar.gz")
            retried(
                f"downloading s3://{args.bucket}/{args.jars_key}",
                lambda: boto3.client("s3", **aws).download_file(args.bucket, args.jars_key, archive),
            )
            unpack_jars(archive, os.path.join(args.prefix, "jars"))
    print(f"fedgate-install: {os.path.basename(args.key)} in {venv}, environment in {args.env_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
