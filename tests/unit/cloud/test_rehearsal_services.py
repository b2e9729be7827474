"""The rehearsal's service instances read what the fedgate-service module writes as systemd
would: the installer's EnvironmentFile lines and the unit's [Service] section."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from infra.cloud.rehearsal.services import ServiceError, Unit, systemd_env_file

from .conftest import TERRAFORM_DIR

INSTALLER = TERRAFORM_DIR / "modules" / "fedgate-service" / "files" / "fedgate-install.py"


def _installer():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fedgate_install", INSTALLER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_the_installer_writes_reads_back_as_the_secret_held_it() -> None:
    """Tried: passwords with quotes, backslashes, spaces, '=', '#' and '$' (a URL-quoted AMQP URL)."""
    secret = {
        "FEDGATE_ROUTER_AMQP_URL": "amqp://fedgate-router:a%2Fb%40c@lb.example:5672/%2F",
        "FEDGATE_ROUTER_KAFKA_SASL_PASSWORD": 'pa ss"wo\\rd=#$x',
        "FEDGATE_ROUTER_BACKEND_MANAGEMENT_PASSWORD": "",
    }
    import json

    text = _installer().env_file_text(json.dumps(secret))
    assert systemd_env_file(text) == secret


def test_the_unit_of_the_module_is_read_for_its_command_environment_and_folder() -> None:
    main_tf = (TERRAFORM_DIR / "modules" / "fedgate-service" / "main.tf").read_text()
    unit_text = re.search(r"unit = <<-EOT\n(.*?)\n  EOT", main_tf, re.S)
    assert unit_text is not None
    rendered = (
        unit_text.group(1)
        .replace("${local.env_file}", "/etc/fedgate/router.env")
        .replace("${local.python}", "/opt/fedgate/venv/bin/python")
        .replace("${local.entry}", "router")
        .replace("${local.config_file}", "/etc/fedgate/router.toml")
        .replace("${var.service}", "router")
    )
    unit = Unit.parse(rendered)
    assert unit.exec_start == (
        "/opt/fedgate/venv/bin/python",
        "-m",
        "router",
        "--config",
        "/etc/fedgate/router.toml",
    )
    assert unit.environment_file == "/etc/fedgate/router.env"
    assert unit.environment == {"HOME": "/var/lib/fedgate-router"}
    assert unit.working_directory == "/var/lib/fedgate-router"
    assert unit.kill_mode == "mixed"
    with pytest.raises(ServiceError, match="no ExecStart"):
        Unit.parse("[Service]\nType=simple\n")


def test_a_path_outside_the_rehearsed_ones_is_left_as_it_is(tmp_path: Path) -> None:
    from infra.cloud.rehearsal.hosts import Host
    from infra.cloud.rehearsal.render import CloudConfig
    from infra.cloud.rehearsal.services import ServiceInstance

    i = ServiceInstance(Host("x", "10.0.0.1"), tmp_path, CloudConfig({}, (), ()), {})
    assert i.path("/opt/fedgate/venv/bin/python") == str(tmp_path / "opt/fedgate/venv/bin/python")
    assert i.path("/var/lib/fedgate-router") == str(tmp_path / "var/lib/fedgate-router")
    assert i.path("/usr/bin/python3") == "/usr/bin/python3"
