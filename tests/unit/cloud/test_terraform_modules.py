"""Every module and example is formatted, valid, and documents every input and output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.cloud.toolchain import Toolchain

from .conftest import EXAMPLES, MODULES, TERRAFORM_DIR, run_tf

pytestmark = pytest.mark.terraform

FOUR_FILES = {"main.tf", "variables.tf", "outputs.tf", "versions.tf"}


def _blocks(text: str, kind: str) -> dict[str, str]:
    """name -> body of each top-level `variable "name" {` / `output "name" {` block."""
    out = {}
    for m in re.finditer(rf'^{kind} "([^"]+)" \{{\n(.*?)^\}}', text, re.M | re.S):
        out[m.group(1)] = m.group(2)
    return out


@pytest.mark.parametrize("path", MODULES + EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_module_and_example_has_the_four_files(path: Path) -> None:
    assert {p.name for p in path.iterdir()} >= FOUR_FILES


@pytest.mark.parametrize("path", MODULES + EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_variable_is_typed_and_described_and_every_output_described(path: Path) -> None:
    variables = _blocks((path / "variables.tf").read_text(), "variable")
    outputs = _blocks((path / "outputs.tf").read_text(), "output")
    assert variables or path in EXAMPLES
    for name, body in variables.items():
        assert re.search(r"^\s+type\s+=", body, re.M), f"variable {name} has no type"
        assert re.search(r"^\s+description\s+=", body, re.M), f"variable {name} has no description"
    assert outputs
    for name, body in outputs.items():
        assert re.search(r"^\s+description\s+=", body, re.M), f"output {name} has no description"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_module_readme_tables_list_every_input_and_output(path: Path) -> None:
    readme = (path / "README.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \|", readme, re.M))
    variables = set(_blocks((path / "variables.tf").read_text(), "variable"))
    outputs = set(_blocks((path / "outputs.tf").read_text(), "output"))
    assert variables | outputs == rows, "README tables differ from variables.tf/outputs.tf"
    assert path.name in {e.name for e in EXAMPLES}, f"no examples/{path.name}"


def test_terraform_fmt_check_passes(toolchain: Toolchain) -> None:
    r = run_tf(toolchain, TERRAFORM_DIR, "fmt", "-check", "-recursive", "-diff", "-no-color")
    assert r.returncode == 0, f"terraform fmt -check found unformatted files:\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize("rel", [p.relative_to(TERRAFORM_DIR) for p in MODULES + EXAMPLES], ids=str)
def test_terraform_validate_passes(toolchain: Toolchain, terraform_tree: Path, rel: Path) -> None:
    cwd = terraform_tree / "infra" / "terraform" / rel
    init = run_tf(toolchain, cwd, "init", "-backend=false", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    r = run_tf(toolchain, cwd, "validate", "-no-color")
    assert r.returncode == 0, f"{rel}: {r.stdout}{r.stderr}"
    assert "Warning" not in r.stdout + r.stderr, r.stdout + r.stderr
