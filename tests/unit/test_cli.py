import re
import subprocess
from pathlib import Path

from fedgate.cli import build_parser, format_status
from infra.local.driver import NodeStatus

ROOT = Path(__file__).resolve().parents[2]


def test_status_table_has_one_row_per_node_with_ports_and_state():
    rows = [
        NodeStatus(
            "backend", "backend", None, {"amqp": 1, "management": 2, "dist": 3}, "running", 10, 4, 0, 150
        ),
        NodeStatus("gw-local-eu", "gateway", "local-eu", {"mqtt": 5}, "stopped", None, None, None),
    ]
    lines = format_status(rows).splitlines()
    assert lines[0].split() == ["NODE", "ROLE", "REGION", "PORTS", "STATE", "CONNS", "MSGS", "RSS_MB"]
    assert lines[1].split() == [
        "backend",
        "backend",
        "-",
        "amqp=1",
        "management=2",
        "running",
        "4",
        "0",
        "150",
    ]
    assert lines[2].split() == ["gw-local-eu", "gateway", "local-eu", "mqtt=5", "stopped", "-", "-", "-"]


def test_cli_has_the_subcommands_the_makefile_wraps():
    parser = build_parser()
    for cmd in ("up", "down", "status", "demo"):
        assert parser.parse_args([cmd]).command == cmd
    assert parser.parse_args(["status", "--json"]).json
    assert parser.parse_args(["down", "--purge"]).purge


def test_make_help_lists_every_target():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    listed = set(re.findall(r"make (\S+)", out))
    assert targets == listed


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert [line for line in ci.splitlines() if line and not line.startswith("#")][-1] == "make test"


def _cli(*args):
    import sys

    return subprocess.run(
        [sys.executable, "-m", "fedgate.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
    )


def test_gateway_with_an_invalid_region_name_names_the_rule():
    out = _cli("gateway", "add", "Local_AP")
    assert out.returncode == 1
    assert "invalid region name 'Local_AP'" in out.stderr
