"""The zone devices resolve (infra/dns/zone.py): what it is made of, and what it refuses.
What PowerDNS answers with it is tests/integration/test_dns.py."""

from __future__ import annotations

import pytest

from infra.dns.zone import SENTINEL, ZoneError, ZoneSpec, lua_answer, zone_file

EU_NET, US_NET = "127.10.1.0/24", "127.10.2.0/24"


def spec(**kw) -> ZoneSpec:
    base = dict(
        domain="fedgate.test",
        regions={"local-eu": ["127.0.1.1"], "local-us": ["127.0.2.1", "127.0.2.2"]},
        client_networks=[(EU_NET, ["local-eu", "local-us"]), (US_NET, ["local-us", "local-eu"])],
    )
    return ZoneSpec(**{**base, **kw})


def test_each_client_network_gets_its_regions_nearest_first_and_others_the_listed_order():
    s = spec()
    assert s.order_for("127.10.1.7") == ["local-eu", "local-us"]
    assert s.order_for("127.10.2.7") == ["local-us", "local-eu"]
    assert s.order_for("192.0.2.1") == ["local-eu", "local-us"]


def test_the_record_checks_every_gateway_beside_the_sentinel_and_names_each_network():
    lua = lua_answer(spec())
    assert f"local sentinel = '{SENTINEL}'" in lua
    assert "['local-us'] = {'127.0.2.1', '127.0.2.2'}" in lua
    assert f"{{'{EU_NET}', {{'local-eu', 'local-us'}}}}" in lua
    assert "ifportup(port, candidates, {selector = 'all', backupSelector = 'all'})" in lua
    assert "local port = 1883" in lua


def test_the_zone_has_its_soa_ns_and_one_lua_record_with_the_ttl():
    text = zone_file(spec(ttl=7), serial=42)
    lines = text.splitlines()
    assert lines[0] == "$TTL 7"
    assert "hostmaster.fedgate.test. 42 " in lines[1]
    assert lines[2] == "@ IN NS ns1.fedgate.test."
    (record,) = [ln for ln in lines if " LUA " in ln]
    assert record.startswith('mqtt 7 IN LUA A ";') and record.endswith('"')
    assert '"' not in record[len('mqtt 7 IN LUA A ";') : -1], (
        "the Lua holds no double quote to end the record early"
    )


def test_a_federation_without_a_region_has_no_record_to_answer():
    assert " LUA " not in zone_file(spec(regions={}, client_networks=[]))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"domain": "fedgate test"}, "domain"),
        ({"regions": {"local-eu": ["127.0.1.1'); os.exit() --"]}}, "not an IP address"),
        # not just "region": the client networks' check names their (now unknown) regions too
        ({"regions": {"Local EU": ["127.0.1.1"]}}, "invalid region name 'Local EU'"),
        ({"client_networks": [("127.10.1.0/33", ["local-eu"])]}, "client network"),
        ({"client_networks": [(EU_NET, ["local-ap"])]}, "unknown: ['local-ap']"),
        ({"mqtt_port": 70000}, "mqtt_port"),
    ],
)
def test_what_would_break_the_record_is_refused_with_the_field_named(change, says):
    with pytest.raises((ZoneError, ValueError), match=r".*" + __import__("re").escape(says)):
        zone_file(spec(**change))
