"""The zone devices resolve (infra/dns/zone.py): what it is made of, and what it refuses.
What PowerDNS answers with it is tests/integration/test_dns.py."""

from __future__ import annotations

import pytest

from infra.dns.zone import ZoneError, ZoneSpec, lua_answer, zone_file

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


def test_with_every_gateway_healthy_each_network_is_answered_its_nearest_region():
    s = spec()
    assert s.answer_for("127.10.1.7") == ["127.0.1.1"]
    assert s.answer_for("127.10.2.7") == ["127.0.2.1", "127.0.2.2"]
    assert s.answer_for("192.0.2.1") == ["127.0.1.1"], "no listed network: the listed order"


def test_a_region_without_a_healthy_gateway_is_skipped_for_the_next_nearest():
    s = spec(healthy={"local-eu": [], "local-us": ["127.0.2.2"]})
    assert s.answer_for("127.10.1.7") == ["127.0.2.2"], "eu down: its network gets us's healthy one"
    assert s.answer_for("127.10.2.7") == ["127.0.2.2"], "only the healthy node of a cluster"
    # a region left out of the health has no healthy gateway either
    assert spec(healthy={"local-us": ["127.0.2.1"]}).answer_for("127.10.1.7") == ["127.0.2.1"]


def test_healthy_addresses_keep_the_regions_order_whatever_order_the_checks_gave():
    s = spec(healthy={"local-us": ["127.0.2.2", "127.0.2.1"]})
    assert s.answer_for("127.10.2.7") == ["127.0.2.1", "127.0.2.2"]


def test_no_region_healthy_each_network_gets_its_nearest_regions_whole_list_as_route53_answers():
    s = spec(healthy={"local-eu": [], "local-us": []})
    assert s.answer_for("127.10.1.7") == ["127.0.1.1"]
    assert s.answer_for("127.10.2.7") == ["127.0.2.1", "127.0.2.2"]


def test_the_record_holds_each_networks_answer_and_checks_nothing_itself():
    lua = lua_answer(spec(healthy={"local-eu": [], "local-us": ["127.0.2.1"]}))
    assert f"{{'{EU_NET}', {{'127.0.2.1'}}}}" in lua, "eu's network: us's healthy gateway"
    assert f"{{'{US_NET}', {{'127.0.2.1'}}}}" in lua
    assert lua.endswith("return {'127.0.2.1'}"), "a client in no network: the listed order's answer"
    assert "newNetmask(n[1]):match(client)" in lua and "bestwho" in lua
    # PowerDNS's own checks (a TCP connect) and any address but a gateway's are gone
    assert "ifportup" not in lua and "127.255.255.254" not in lua
    assert {p for p in lua.split("'") if p.startswith("127.0.")} <= {"127.0.1.1", "127.0.2.1", "127.0.2.2"}


def test_health_naming_an_address_that_is_no_gateway_of_the_region_is_refused():
    with pytest.raises(ZoneError, match=r"healthy: local-eu: \['127.0.2.1'\]"):
        zone_file(spec(healthy={"local-eu": ["127.0.2.1"]}))


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
