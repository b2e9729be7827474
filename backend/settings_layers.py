"""How every fedgate part reads its settings: a TOML file, then environment variables.

The local driver (FEDGATE_*), the router (FEDGATE_ROUTER_*) and the Spark job
(FEDGATE_SPARK_*) each keep their settings in a dataclass; this reads the raw
values for its fields and converts them to the fields' types, naming the
field in every error.
"""

from __future__ import annotations

import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any


def read_layers(
    known: Collection[str],
    *,
    path: str | Path | None,
    env: Mapping[str, str],
    env_prefix: str,
    error: type[Exception],
    section: str | None = None,
    skip_env: Collection[str] = (),
) -> dict[str, Any]:
    """Raw values of `known` settings: the TOML file's (its [section] if it has one),
    then every non-empty <env_prefix><NAME> variable over them.  A key the
    file has and `known` lacks is an error, not ignored."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as e:
            raise error(f"config file {path} does not exist") from e
        except tomllib.TOMLDecodeError as e:
            raise error(f"config file {path}: {e}") from e
        if section is not None:
            data = data.get(section, data)
        for key, raw in data.items():
            if key not in known:
                raise error(f"config file {path}: unknown setting {key!r}")
            values[key] = raw
    for key in known:
        raw = env.get(env_prefix + key.upper())
        if raw not in (None, "") and key not in skip_env:
            values[key] = raw
    return values


def coerce(name: str, kind: str, raw: Any, error: type[Exception]) -> Any:
    """`raw` (TOML value or environment text) as a field of type `kind` (its annotation)."""
    try:
        if kind == "Path":
            return Path(raw).expanduser().resolve()
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return raw if isinstance(raw, bool) else str(raw).strip().lower() in ("1", "true", "yes")
        if kind == "str":
            return str(raw)
        if kind == "tuple[str, ...]":
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(s.strip() for s in items if s.strip())
        if kind == "dict[str, int]":
            if isinstance(raw, str):  # env: "gw-local-eu.mqtt=18830,kafka.bootstrap=19092"
                raw = dict(item.split("=", 1) for item in raw.split(",") if item.strip())
            return {str(k).strip(): int(v) for k, v in dict(raw).items()}
        return raw
    except (TypeError, ValueError) as e:
        raise error(f"{name}: cannot read {raw!r} ({e})") from e
