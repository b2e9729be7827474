import re
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from backend.errors import FedgateError
from fedgate import cli
from fedgate.cli import build_parser, format_status
from infra import device_registry
from infra.local.driver import NodeStatus
from infra.local.settings import load_settings
from infra.regions import LocalRegions, driver_for

ROOT = Path(__file__).resolve().parents[2]


def test_status_table_has_one_row_per_node_with_ports_and_state():
    rows = [
        NodeStatus(
            "backend",
            "backend",
            None,
            {"amqp": 1, "management": 2, "dist": 3},
            "running",
            10,
            4,
            0,
            150,
            "4.0.5",
        ),
        NodeStatus("gw-local-eu", "gateway", "local-eu", {"mqtt": 5}, "stopped", None, None, None),
    ]
    lines = format_status(rows).splitlines()
    assert lines[0].split() == [
        "NODE",
        "ROLE",
        "REGION",
        "PORTS",
        "STATE",
        "PID",
        "CONNS",
        "MSGS",
        "RSS_MB",
        "VERSION",
    ]
    assert lines[1].split() == [
        "backend",
        "backend",
        "-",
        "amqp=1",
        "management=2",
        "running",
        "10",
        "4",
        "0",
        "150",
        "4.0.5",
    ]
    assert lines[2].split() == [
        "gw-local-eu",
        "gateway",
        "local-eu",
        "mqtt=5",
        "stopped",
        "-",
        "-",
        "-",
        "-",
        "-",
    ]


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


# --- in process: what each command builds, and how errors come out --------------------------


@pytest.fixture
def state(tmp_path, monkeypatch):
    """A state folder of its own; no federation runs there."""
    monkeypatch.setenv("FEDGATE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FEDGATE_CLOUD_STATE_DIR", str(tmp_path / "cloud"))
    monkeypatch.delenv("FEDGATE_CONFIG", raising=False)
    return tmp_path


@contextmanager
def silent_port():
    """A port whose connections are accepted by the kernel and never answered: a stopped node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_settings_and_query_list_build_no_federation(state, monkeypatch, capsys):
    def no_federation(*a, **kw):
        raise AssertionError("a LocalFederation was built")

    monkeypatch.setattr(cli, "LocalFederation", no_federation)
    assert cli.main(["settings"]) == 0
    assert cli.main(["recompute", "--since", "2026-01-02", "--until", "2026-01-01"]) == 2
    assert "FEDGATE_STATE_DIR" in capsys.readouterr().out


def test_an_expected_error_is_one_line_without_a_traceback(state, capsys):
    assert cli.main(["gateway", "add", "local-ap"]) == 1
    err = capsys.readouterr().err
    assert err == "fedgate: error: the local federation is not running; start it with `fedgate up`\n"


def test_the_driver_is_picked_by_the_regions_kind():
    settings = load_settings(env={})
    assert isinstance(driver_for("local-ap", settings), LocalRegions)
    assert driver_for("eu-west-1", settings).kind == "cloud"
    with pytest.raises(FedgateError, match="invalid region name"):
        driver_for("Local_AP", settings)


def test_devices_add_with_a_gateway_not_answering_registers_names_it_and_sync_repairs(
    state, monkeypatch, capsys
):
    from backend.rabbitmq_admin import RabbitAdmin
    from tests.unit.cloud.fakes import fake_management_api

    monkeypatch.setattr(device_registry, "ANSWER_TIMEOUT_S", 0.5)
    with fake_management_api() as eu, silent_port() as us_url:
        gateways = {"local-eu": eu.url, "local-us": us_url}

        def running_gateways(self):
            for region, url in gateways.items():
                yield region, f"gw-{region}", RabbitAdmin(url, "fedgate-admin", "pw", timeout=0.5)

        monkeypatch.setattr(LocalRegions, "_running_gateways", running_gateways)
        t0 = time.monotonic()
        assert cli.main(["devices", "add", "pump-1"]) == 1
        assert time.monotonic() - t0 < 10, "a gateway that does not answer is given up quickly"
        out, err = capsys.readouterr()
        secret = out.splitlines()[1].split()[1]
        assert out.splitlines()[1] == f"pump-1  {secret}", "the secret is shown once, all the same"
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(
            "fedgate: devices: local region local-us not updated (gateway gw-local-us: "
        )
        assert "does not answer" in lines[0] and "run `fedgate devices sync`" in lines[0]
        assert [u["name"] for u in eu.body("POST", "/api/definitions")["users"]] == ["pump-1"]
        registry = device_registry.DeviceRegistry(state / "state" / "devices.json")
        assert set(registry.devices()) == {"pump-1"}, "the registry is the truth"

        # sync names the one still silent and updates the other
        eu.requests.clear()
        assert cli.main(["devices", "sync"]) == 1
        out, err = capsys.readouterr()
        assert out == "local-eu: 1 devices, removed none\n"
        assert len(err.splitlines()) == 1 and "local region local-us not updated" in err

        # once it answers, sync makes it whole
        gateways["local-us"] = eu.url
        assert cli.main(["devices", "sync"]) == 0
        out, err = capsys.readouterr()
        assert out.splitlines() == ["local-eu: 1 devices, removed none", "local-us: 1 devices, removed none"]
        assert err == ""


def test_a_closed_management_port_is_named_on_revoke(state, monkeypatch, capsys):
    from backend.rabbitmq_admin import RabbitAdmin

    device_registry.DeviceRegistry(state / "state" / "devices.json").add(["pump-1"])

    def running_gateways(self):
        yield "local-eu", "gw-local-eu", RabbitAdmin("http://127.0.0.1:9", "fedgate-admin", "pw", timeout=1)

    monkeypatch.setattr(LocalRegions, "_running_gateways", running_gateways)
    assert cli.main(["devices", "revoke", "pump-1"]) == 1
    out, err = capsys.readouterr()
    assert out == "pump-1: revoked, 0 connection(s) closed\n"
    assert len(err.splitlines()) == 1 and "local region local-eu not updated" in err
    assert "Connection refused" in err


def test_send_takes_a_deadline_and_a_wait_with_a_default_and_refuses_nonsense(capsys):
    topic = "devices/d1/commands/x"
    a = cli.parse_args(["send", "d1", topic, "{}", "--expires-in", "30", "--wait"])
    assert (a.expires_in, cli._wait_seconds(a)) == (30.0, 30.0)
    a = cli.parse_args(["send", "d1", topic, "{}", "--wait", "--timeout", "5"])
    assert (a.expires_in, cli._wait_seconds(a)) == (None, 5.0)
    assert cli._wait_seconds(cli.parse_args(["send", "d1", topic, "{}"])) is None
    a = cli.parse_args(["send", "d1", topic, "{}", "--timeout", "5", "--answer"])
    assert (cli._wait_seconds(a), a.answer) == (5.0, True)
    assert cli._wait_seconds(cli.parse_args(["send", "d1", topic, "{}", "--answer"])) == 30.0
    for bad in (["--expires-in", "0"], ["--expires-in", "-3"], ["--timeout", "soon"], ["--wait", "-3"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["send", "d1", topic, "{}", *bad])
    assert "a positive number of seconds" in capsys.readouterr().err


def test_status_names_each_clusters_members_down_and_what_lacks_a_replica():
    from infra.local.status import ClusterStatus, format_clusters

    text = format_clusters(
        [
            ClusterStatus(
                "backend", ["backend", "backend-2", "backend-3"], ["backend", "backend-2"], 2, "q1, q2"
            ),
            ClusterStatus("kafka", ["kafka"], ["kafka"], 0),
            ClusterStatus("gateways local-eu", ["gw-local-eu"], [], None),
        ]
    )
    assert text.splitlines() == [
        "backend: 2/3 running (backend-3 down); under-replicated quorum queues: 2 (q1, q2)",
        "kafka: 1/1 running; under-replicated partitions: 0",
        "gateways local-eu: 0/1 running (gw-local-eu down); under-replicated quorum queues: ?",
    ]
