"""The layout's rules, checked: what each top-level folder may depend on.

docs/architecture.md ("Where to change what") states them; these tests keep
them true as the code grows.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(folder: str) -> dict[str, set[str]]:
    """module path -> the top-level packages it imports (at any depth, lazily too)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        tops: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                tops.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = tops
    return out


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        # the running services never import the deployment tool or the CLI
        ("router", {"infra", "fedgate", "bench", "spark"}),
        ("spark", {"infra", "fedgate", "bench", "router"}),
        # the shared contract and the gateway's home stand below everything
        ("backend", {"infra", "fedgate", "bench", "router", "spark", "gateways"}),
        ("gateways", {"infra", "fedgate", "bench", "router", "spark"}),
    ],
)
def test_a_folder_imports_only_what_stands_below_it(folder, forbidden):
    wrong = {
        mod: sorted(tops & forbidden) for mod, tops in imported_packages(folder).items() if tops & forbidden
    }
    assert not wrong, f"{folder}/ must not import {sorted(forbidden)}: {wrong}"


#: A module may grow past this only if its docstring says why ("Longer than ..." ).
MAX_LINES = 400


@pytest.mark.parametrize("folder", ["router", "infra/local", "gateways", "backend", "fedgate/army"])
def test_modules_stay_small_enough_to_read(folder):
    long = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and "Longer than" not in doc:
            long[str(path.relative_to(ROOT))] = lines
    assert not long, f"modules over {MAX_LINES} lines whose docstring does not say why: {long}"
