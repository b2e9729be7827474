"""Writing settings files in TOML: the inverse of backend/settings_layers.py for the
flat values fedgate renders (router.toml, spark.toml, the benchmarks' configs).

Python's standard library reads TOML but does not write it; this is the one
writer, so every rendered file quotes strings the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def to_toml(value: Any) -> str:
    """One value as TOML: booleans, numbers, arrays, inline tables (the router's
    [[rules]] pass through this way), and everything else as a quoted string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(to_toml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{to_toml(str(k))} = {to_toml(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def toml_lines(values: Mapping[str, Any]) -> list[str]:
    """``key = value`` lines of a flat table."""
    return [f"{k} = {to_toml(v)}" for k, v in values.items()]
