"""Generated credentials, kept in one JSON file readable by its owner only.

Each secret is made the first time something asks for it and never changes
after, so a node restarted later gets the password it was created with.  The
local driver and the cloud driver each keep one such file.
"""

from __future__ import annotations

import json
import secrets as pysecrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class SecretsFile:
    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.path.read_text())
        except FileNotFoundError:
            data = {}
        return data

    def ensure(
        self,
        keys: Iterable[str] = (),
        per_region: Mapping[str, Iterable[str]] | None = None,
        nbytes: int = 18,
    ) -> dict[str, Any]:
        """All secrets; any of `keys` and of `per_region` (group -> regions) not yet made are made now."""
        data = self.read()
        changed = False
        for key in keys:
            if key not in data:
                data[key] = pysecrets.token_urlsafe(nbytes)
                changed = True
        for group, regions in (per_region or {}).items():
            held = data.setdefault(group, {})
            for region in regions:
                if region not in held:
                    held[region] = pysecrets.token_urlsafe(nbytes)
                    changed = True
        if changed:
            self.write(data)
        return data

    def forget(self, region: str, groups: Iterable[str]) -> None:
        """Drop a removed region's secrets (a region added again gets new ones)."""
        data = self.read()
        if any(data.get(group, {}).pop(region, None) is not None for group in list(groups)):
            self.write(data)

    def write(self, data: Any) -> None:
        write_private_json(self.path, data)


def write_private_json(path: Path, data: Any) -> None:
    """Write `data` as JSON readable by its owner only, replacing the file in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.chmod(0o600)
    tmp.replace(path)
