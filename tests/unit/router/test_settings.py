import pytest

from router.settings import (
    RouterSettings,
    RouterSettingsError,
    check_router_table,
    describe,
    load_router_settings,
    router_table,
)

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


def test_the_backend_management_password_may_come_from_the_environment_only(tmp_path):
    table = '[backend_management]\nmanagement_url = "http://b:15672"\nuser = "fedgate-router"\n'
    s = load(tmp_path, table, env={"FEDGATE_ROUTER_BACKEND_MANAGEMENT_PASSWORD": "from-secret"})
    assert s.backend_management is not None
    assert (s.backend_management.user, s.backend_management.password) == ("fedgate-router", "from-secret")
    # without the variable, the file's (here none); without the table, the variable creates nothing
    assert load(tmp_path, table).backend_management.password == ""
    assert load(tmp_path, env={"FEDGATE_ROUTER_BACKEND_MANAGEMENT_PASSWORD": "x"}).backend_management is None


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


ENERGY_RULE = {"pattern": "devices/{device}/energy/{kind:power|total}", "topic": "energy.{kind}"}


def test_a_router_table_passes_through_unchanged_with_the_variables_over_it():
    table = {"park_ttl_s": 25, "rules": [ENERGY_RULE]}
    out = router_table(table, env={"FEDGATE_ROUTER_UNKNOWN_DEVICE": "park", "FEDGATE_ROUTER_RULES": "x"})
    # nothing defaulted, nothing rewritten: the router's own defaults apply where the table is silent
    assert out == {"park_ttl_s": 25, "rules": [ENERGY_RULE], "unknown_device": "park"}
    s = check_router_table(out)
    assert s.max_inflight == RouterSettings.__dataclass_fields__["max_inflight"].default
    assert s.kafka_topics() == [
        "energy.power",
        "energy.total",
        "fedgate.deadletter",
        "fedgate.unmatched",
    ]


def test_the_router_reads_a_rendered_table_as_it_was_checked(tmp_path):
    """What router_table returns, written into router.toml beside the wiring, loads the same."""
    table = router_table({"park_ttl_s": 25.5, "rules": [ENERGY_RULE]}, env={})
    rules = "".join(
        f'[[rules]]\npattern = "{r["pattern"]}"\ntopic = "{r["topic"]}"\n' for r in table["rules"]
    )
    s = load(tmp_path, f"park_ttl_s = {table['park_ttl_s']}\n{rules}")
    assert s.park_ttl_s == 25.5 and s.kafka_topics() == check_router_table(table).kafka_topics()


@pytest.mark.parametrize(
    ("table", "env", "field"),
    [
        ({"park_ttl_s": -1}, {}, "^park_ttl_s: must be positive"),
        ({"presence_reconcile_s": -5}, {}, "^presence_reconcile_s: must be 0 \\(off\\) or positive"),
        ({}, {"FEDGATE_ROUTER_UNKNOWN_DEVICE": "drop"}, "^unknown_device"),
        ({}, {"FEDGATE_ROUTER_MAX_INFLIGHT": "lots"}, "^max_inflight: cannot read"),
        ({"rules": [{"pattern": "devices/{device}/{k}", "topic": "t.{k}"}]}, {}, "^rules: .*must list"),
        ({"rules": [{"pattern": "devices/{device}"}]}, {}, "^rules: rule #1: missing 'topic'"),
        ({"rules": []}, {}, "^rules: at least one"),
        ({"amqp_url": "amqp://x"}, {}, "^amqp_url: set by the deployment"),
        ({"router_count": 2}, {}, "^router_count: set by the deployment"),
        ({"park_ttl": 1}, {}, "^unknown setting 'park_ttl'"),
    ],
)
def test_a_wrong_router_table_is_refused_naming_the_field(table, env, field):
    with pytest.raises(RouterSettingsError, match=field):
        router_table(table, env=env)


def test_the_router_settings_are_described_from_their_fields():
    names = {name: (default, doc) for name, default, doc in describe()}
    assert names["FEDGATE_ROUTER_PARK_TTL_S"] == ("3600.0", "How long a parked message waits for its device.")
    assert "telemetry.{stream}" in names["[[router.rules]]"][0]
    assert not any("AMQP_URL" in n or "ROUTER_INDEX" in n for n in names), "wiring is the deployment's"


def test_routers_that_cannot_be_numbered_share_the_shards_by_rendezvous_hashing_of_their_ids():
    """Each shard goes to the running router with the highest priority; the priorities are the
    same in every process and every run, spread the shards over the routers, and move a dead
    router's shards to the others without moving anyone else's."""
    from dataclasses import replace

    from router.shards import RENDEZVOUS_PRIORITIES, rendezvous_priority, shard_priority

    base = RouterSettings(amqp_url="amqp://u:p@h/%2F", kafka_bootstrap="k:9092", uplink_shards=64)
    routers = [f"router-i-{n:017x}" for n in range(4)]
    settings = {r: replace(base, router_id=r, shard_owner="rendezvous").validate() for r in routers}

    def owners(alive: list[str]) -> dict[int, str]:
        return {s: max(alive, key=lambda r: shard_priority(settings[r], s)) for s in range(64)}

    assert all(1 <= rendezvous_priority(r, s) <= RENDEZVOUS_PRIORITIES for r in routers for s in range(64))
    # pinned: the same in every process and release (a switch to Python's salted hash() fails here)
    assert [rendezvous_priority(routers[0], s) for s in (0, 3, 63)] == [326, 792, 518]
    assert (rendezvous_priority("router-a", 0), rendezvous_priority("router-b", 7)) == (248, 59)
    everyone = owners(routers)
    counts = sorted(list(everyone.values()).count(r) for r in routers)
    assert counts[0] >= 8 and counts[-1] <= 24, counts  # 16 each on average
    # one dies: only its shards move, spread over the others
    without = owners(routers[1:])
    moved = {s for s in range(64) if everyone[s] != without[s]}
    assert moved == {s for s, r in everyone.items() if r == routers[0]}
    assert len({without[s] for s in moved}) > 1
    # the numbered way stays as it was
    numbered = replace(base, router_count=2, router_index=1).validate()
    assert [shard_priority(numbered, s) for s in range(4)] == [0, 10, 0, 10]
    with pytest.raises(RouterSettingsError, match="shard_owner"):
        replace(base, shard_owner="random").validate()
