"""fedgate's Prometheus rules (infra/prometheus/rules.yml) as Prometheus's own promtool checks
them: they parse, every alert fires in its test case where it should (rules_test.yml), the
config the local federation renders is valid, and the operators' guide says what to do."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from infra.local.layout import NodeSpec
from infra.local.prometheus_node import RULES, config, targets

ROOT = Path(__file__).resolve().parents[2]
TESTS = RULES.parent / "rules_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is missing: `make setup` installs Debian's prometheus"
)


def _alerts() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)


@needs_promtool
def test_the_rules_parse_and_every_test_case_passes_in_promtool():
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", str(TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not():
    cases = yaml.safe_load(TESTS.read_text())["tests"]
    evaluations = [e for case in cases for e in case.get("alert_rule_test", [])]
    for alert in _alerts():
        seen = [bool(e["exp_alerts"]) for e in evaluations if e["alertname"] == alert]
        assert True in seen, f"{alert}: no test case where it fires"
        assert False in seen, f"{alert}: no test case where it stays quiet"


def test_every_alert_is_in_the_operators_guide():
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide[guide.index("## Observing the fleet") :]
    for alert in _alerts():
        assert f"`{alert}`" in section, f"{alert} missing from docs/operations.md"


@needs_promtool
def test_the_config_the_local_federation_renders_is_valid(tmp_path):
    specs = [
        NodeSpec("backend", "backend", None, {"prometheus": 17023}),
        NodeSpec("gw-local-eu", "gateway", "local-eu", {"prometheus": 17104}),
        NodeSpec("router-0", "router", None, {"metrics": 17030}),
        NodeSpec("prometheus", "prometheus", None, {"http": 17009}),
    ]
    (tmp_path / "targets").mkdir()
    for job, entries in targets(specs, "127.0.0.1").items():
        (tmp_path / "targets" / f"{job}.json").write_text(json.dumps(entries))
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config(tmp_path, 5, "127.0.0.1:17009")))
    checked = _promtool("check", "config", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert targets(specs, "127.0.0.1")["rabbitmq"][1] == {
        "targets": ["127.0.0.1:17104"],
        "labels": {"node": "gw-local-eu", "role": "gateway", "region": "local-eu"},
    }
