import dataclasses
from pathlib import Path

import pytest

from infra.local.settings import SettingsError, describe_settings, load_settings


def test_defaults_stay_clear_of_standard_ports():
    s = load_settings(env={})
    assert s.port_base == 17000
    assert s.regions == ("local-eu", "local-us")
    assert s.host == "127.0.0.1"


def test_environment_overrides(tmp_path):
    s = load_settings(
        env={
            "FEDGATE_PORT_BASE": "30000",
            "FEDGATE_REGIONS": "local-eu, local-ap",
            "FEDGATE_STATE_DIR": str(tmp_path),
            "FEDGATE_PORTS": "gw-local-eu.mqtt=31883",
        }
    )
    assert s.port_base == 30000
    assert s.regions == ("local-eu", "local-ap")
    assert s.state_dir == tmp_path
    assert s.ports == {"gw-local-eu.mqtt": 31883}


def test_config_file(tmp_path):
    cfg = tmp_path / "fedgate.toml"
    cfg.write_text('port_base = 20000\nregions = ["local-a1"]\n[ports]\n"kafka.bootstrap" = 40999\n')
    s = load_settings(env={}, config_file=cfg)
    assert s.port_base == 20000 and s.regions == ("local-a1",)
    assert s.ports == {"kafka.bootstrap": 40999}


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"FEDGATE_PORT_BASE": "eighty"}, "port_base"),
        ({"FEDGATE_PORT_BASE": "80"}, "port_base"),
        ({"FEDGATE_REGIONS": "Local_EU"}, "regions"),
        ({"FEDGATE_REGIONS": "local-eu,local-eu"}, "regions"),
        ({"FEDGATE_PORTS": "mqtt=1883"}, "ports"),
        ({"FEDGATE_PORTS": "gw-local-eu.mqtt=99999"}, "ports"),
        ({"FEDGATE_RABBITMQ_MEMORY_MB": "0"}, "rabbitmq_memory_mb"),
    ],
)
def test_bad_settings_fail_at_once_naming_the_field(env, field):
    with pytest.raises(SettingsError, match=f"^{field}"):
        load_settings(env=env)


def test_unknown_key_in_config_file_is_an_error(tmp_path):
    cfg = tmp_path / "fedgate.toml"
    cfg.write_text("prot_base = 1\n")
    with pytest.raises(SettingsError, match="unknown setting 'prot_base'"):
        load_settings(env={}, config_file=cfg)


def test_missing_config_file_is_an_error():
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(env={"FEDGATE_CONFIG": str(Path("/nonexistent/fedgate.toml"))})


def test_port_block_inside_the_ephemeral_range_is_refused():
    with pytest.raises(SettingsError, match="ephemeral port range"):
        load_settings(env={"FEDGATE_PORT_BASE": "40000"})


ROUTER_TOML = """
[router]
park_ttl_s = 600
unknown_device = "park"

[[router.rules]]
pattern = "devices/{device}/energy/{kind:power|total}"
topic = "energy.{kind}"

[[router.rules]]
pattern = "devices/{device}/{stream:telemetry|events|state}/..."
topic = "telemetry.{stream}"
"""


def test_the_router_table_is_passed_through_as_written(tmp_path):
    cfg = tmp_path / "fedgate.toml"
    cfg.write_text(ROUTER_TOML)
    s = load_settings(env={"FEDGATE_ROUTER_MAX_INFLIGHT": "500"}, config_file=cfg)
    assert s.router == {
        "park_ttl_s": 600,
        "unknown_device": "park",
        "rules": [
            {"pattern": "devices/{device}/energy/{kind:power|total}", "topic": "energy.{kind}"},
            {
                "pattern": "devices/{device}/{stream:telemetry|events|state}/...",
                "topic": "telemetry.{stream}",
            },
        ],
        "max_inflight": 500,  # FEDGATE_ROUTER_<NAME> over the table, as the router reads it
    }
    assert "energy.total" in s.router_settings.kafka_topics()


def test_infra_keeps_no_router_defaults():
    """A table that says nothing renders nothing: the router's own defaults apply."""
    s = load_settings(env={})
    assert s.router == {}
    assert not {"park_ttl_s", "unknown_device"} & {f.name for f in dataclasses.fields(s)}


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ('[[router.rules]]\npattern = "devices/{device}/{k}"\ntopic = "t.{k}"\n', {}, "^router.rules: .*{k}"),
        ("[router]\npark_ttl_s = 0\n", {}, "^router.park_ttl_s: must be positive"),
        ("", {"FEDGATE_ROUTER_UNKNOWN_DEVICE": "drop"}, "^router.unknown_device"),
        ('[router]\namqp_url = "amqp://x"\n', {}, "^router.amqp_url: set by the deployment"),
        ("router = 3\n", {}, "^router: a table"),
    ],
)
def test_a_wrong_router_setting_stops_start_up_naming_the_field(tmp_path, text, env, message):
    cfg = tmp_path / "fedgate.toml"
    cfg.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings(env=env, config_file=cfg)


def test_settings_list_the_router_settings_with_the_routers_docs():
    described = {name: doc for name, _, doc in describe_settings()}
    assert described["FEDGATE_ROUTER_PARK_TTL_S"] == "Router: How long a parked message waits for its device."
    assert "[[router.rules]]" in described
    assert "FEDGATE_ROUTER" not in described and "FEDGATE_PARK_TTL_S" not in described
