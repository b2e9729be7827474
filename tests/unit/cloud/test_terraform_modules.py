"""Every module and example is formatted, valid, and documents every input and output."""

from __future__ import annotations

import re
import shutil
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


@pytest.mark.parametrize("rel", [p.relative_to(TERRAFORM_DIR) for p in EXAMPLES], ids=str)
def test_terraform_validate_passes(toolchain: Toolchain, terraform_tree: Path, rel: Path) -> None:
    """Each example, and so the module it calls (validate checks the modules a configuration
    calls); each module on its own is validated copied alone, below (~10 CPU s a validate of
    the AWS provider: not twice)."""
    cwd = terraform_tree / "infra" / "terraform" / rel
    init = run_tf(toolchain, cwd, "init", "-backend=false", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    r = run_tf(toolchain, cwd, "validate", "-no-color")
    assert r.returncode == 0, f"{rel}: {r.stdout}{r.stderr}"
    assert "Warning" not in r.stdout + r.stderr, r.stdout + r.stderr


# --- self-contained modules: usable from a registry or a git subfolder --------------------------

#: Terraform's functions that read files, and their first argument.
FILE_READS = re.compile(
    r"\b(file|templatefile|fileset|filebase64|filemd5|filesha256|fileexists)\(\s*([^,)]*)"
)
LOCAL_SOURCE = re.compile(r'^\s*source\s*=\s*"(\.\.?/[^"]+)"', re.M)


def _called_modules(module: Path) -> set[Path]:
    """The local modules `module` calls, and theirs, recursively (not `module` itself)."""
    found: set[Path] = set()
    todo = [module]
    while todo:
        for tf in todo.pop().glob("*.tf"):
            for src in LOCAL_SOURCE.findall(tf.read_text()):
                called = (tf.parent / src).resolve()
                if called not in found:
                    found.add(called)
                    todo.append(called)
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_module_reads_files_of_its_own_folder_only(path: Path) -> None:
    for tf in path.glob("*.tf"):
        text = tf.read_text()
        for m in FILE_READS.finditer(text):
            arg = m.group(2).strip()
            assert arg.startswith('"${path.module}/') and ".." not in arg, f"{tf.name}: {m.group(0)}"
        assert "path.root" not in text and "path.cwd" not in text, tf.name
    # a module calls only its siblings, which a package of the modules folder carries along
    assert {p.parent for p in _called_modules(path)} <= {TERRAFORM_DIR / "modules"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_module_copied_alone_is_valid(toolchain: Toolchain, tmp_path: Path, path: Path) -> None:
    """The module's folder (and the sibling modules it calls) away from the repository."""
    for module in {path, *_called_modules(path)}:
        shutil.copytree(module, tmp_path / module.name, ignore=shutil.ignore_patterns(".terraform*"))
    cwd = tmp_path / path.name
    init = run_tf(toolchain, cwd, "init", "-backend=false", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    r = run_tf(toolchain, cwd, "validate", "-no-color")
    assert r.returncode == 0, f"{path.name} alone: {r.stdout}{r.stderr}"
    assert "Warning" not in r.stdout + r.stderr, r.stdout + r.stderr
