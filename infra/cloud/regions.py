"""Which names are AWS regions: botocore's own endpoint data (no network), every partition."""

from __future__ import annotations

import difflib
import functools

from backend.errors import FedgateError

LOCAL_PREFIX = "local-"


class UnknownRegionError(FedgateError, ValueError):
    """Not a region fedgate can stamp out; the message lists the closest names."""


@functools.cache
def aws_regions() -> frozenset[str]:
    """Every region botocore knows for EC2, across partitions (aws, aws-cn, aws-us-gov, ...)."""
    import boto3  # here, not at import time: `is_local` is all most commands need

    session = boto3.session.Session()
    names: set[str] = set()
    for partition in session.get_available_partitions():
        names.update(session.get_available_regions("ec2", partition_name=partition))
    return frozenset(names)


def is_local(region: str) -> bool:
    return region.startswith(LOCAL_PREFIX)


def validate_aws_region(region: str) -> str:
    """Return `region` if AWS has it, else raise naming the closest real regions."""
    known = aws_regions()
    if region in known:
        return region
    close = difflib.get_close_matches(region, sorted(known), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UnknownRegionError(
        f"{region!r} is not an AWS region{hint} (local regions are named local-<name>, e.g. local-ap)"
    )
