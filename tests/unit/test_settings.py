from pathlib import Path

import pytest

from infra.local.settings import SettingsError, load_settings


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
