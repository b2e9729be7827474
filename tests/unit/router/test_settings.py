import pytest

from router.settings import RouterSettingsError, load_router_settings

BASE = 'amqp_url = "amqp://u:p@127.0.0.1:1/%2F"\nkafka_bootstrap = "127.0.0.1:2"\n'


def load(tmp_path, extra="", env=None):
    p = tmp_path / "router.toml"
    p.write_text(BASE + extra)
    return load_router_settings(p, env=env or {})


def test_a_complete_config(tmp_path):
    s = load(
        tmp_path,
        '[gateways.local-eu]\nmanagement_url = "http://h:1"\npassword = "x"\n'
        '[[rules]]\npattern = "d/{device}/{k:a|b}"\ntopic = "t.{k}"\n',
    )
    assert s.regions == ["local-eu"]
    assert s.rules[0].kafka_topics() == ["t.a", "t.b"]
    assert s.my_shards == [0, 1, 2, 3]


def test_environment_overrides_the_file(tmp_path):
    s = load(
        tmp_path,
        env={
            "FEDGATE_ROUTER_UNKNOWN_DEVICE": "park",
            "FEDGATE_ROUTER_PARK_TTL_S": "60",
            "FEDGATE_ROUTER_DOWNLINK": "false",
        },
    )
    assert s.unknown_device == "park" and s.park_ttl_s == 60.0 and s.downlink is False


def test_routers_split_the_shards(tmp_path):
    a = load(tmp_path, "router_index = 0\nrouter_count = 2\n")
    b = load(tmp_path, "router_index = 1\nrouter_count = 2\n")
    assert a.my_shards == [0, 2] and b.my_shards == [1, 3]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ('unknown_device = "drop"\n', "unknown_device"),
        ("park_ttl_s = 0\n", "park_ttl_s"),
        ("router_index = 2\nrouter_count = 2\n", "router_index"),
        ("router_count = 5\n", "router_count"),
        ('max_inflight = "many"\n', "max_inflight"),
        ('[[rules]]\npattern = "d/{device}/{s}"\ntopic = "t.{s}"\n', "rules"),
        ('[gateways.Bad_Region]\nmanagement_url = "http://h"\n', "gateways"),
        ("bogus = 1\n", "unknown setting 'bogus'"),
    ],
)
def test_bad_values_fail_at_start_naming_the_field(tmp_path, extra, field):
    with pytest.raises(RouterSettingsError, match=field):
        load(tmp_path, extra)


def test_missing_required_setting_is_named(tmp_path):
    p = tmp_path / "router.toml"
    p.write_text('kafka_bootstrap = "x:1"\n')
    with pytest.raises(RouterSettingsError, match="amqp_url: missing"):
        load_router_settings(p, env={})
