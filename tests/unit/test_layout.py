import dataclasses

import pytest

from infra.local.driver import FederationError, port_layout
from infra.local.layout import NodeSpec
from infra.local.settings import SettingsError, load_settings

STANDARD_PORTS = {1883, 8883, 5672, 5671, 15672, 15692, 25672, 4369, 9092, 9093}


def _ports(specs):
    return [p for s in specs for p in s.ports.values()]


def _host_ports(specs, host="127.0.0.1"):
    """(address, port) of every listener: a gateway's MQTT ports are on its own address."""
    return [(s.bind_address(k, host), p) for s in specs for k, p in s.ports.items()]


def test_every_node_gets_distinct_ports_clear_of_the_standard_ones_but_gateways_mqtt_on_their_own_address():
    specs = port_layout(load_settings(env={}))
    names = [s.name for s in specs]
    assert names == [
        "epmd",
        "backend",
        "gw-local-eu",
        "gw-local-us",
        "kafka",
        "router-0",
        "router-1",
        "spark",
        "dns",
        "prometheus",
    ]
    listeners = _host_ports(specs)
    assert len(listeners) == len(set(listeners))
    on_host = [p for a, p in listeners if a == "127.0.0.1"]
    assert not set(on_host) & STANDARD_PORTS, "a system broker on the machine does not clash"
    gw = {s.region: s for s in specs if s.role == "gateway"}
    assert set(gw["local-eu"].ports) == {
        "mqtt",
        "mqtts",
        "amqp",
        "amqps",
        "management",
        "management_tls",
        "dist",
        "prometheus",
    }
    # each gateway a host of its own with the standard device ports, as a DNS answer needs
    assert [(g.address, g.ports["mqtt"], g.ports["mqtts"]) for g in gw.values()] == [
        ("127.170.1.1", 1883, 8883),
        ("127.170.2.1", 1883, 8883),
    ]


def test_port_base_moves_the_whole_block_and_the_gateways_addresses():
    a = port_layout(load_settings(env={}, port_base=20000))
    b = port_layout(load_settings(env={}, port_base=30000))
    on_host = [(x, y) for x, y in zip(_host_ports(a), _host_ports(b), strict=True) if x[0] == "127.0.0.1"]
    assert on_host and all(x[1] - 20000 == y[1] - 30000 for x, y in on_host)
    assert {s.address for s in a if s.address} == {"127.200.1.1", "127.200.2.1"}
    assert {s.address for s in b if s.address} == {"127.44.1.1", "127.44.2.1"}


def test_a_pinned_port_wins():
    specs = port_layout(load_settings(env={}, ports={"gw-local-us.mqtt": 41883}))
    assert next(s for s in specs if s.name == "gw-local-us").ports["mqtt"] == 41883


def test_recorded_nodes_keep_their_ports_when_a_region_is_added():
    first = {s.name: s for s in port_layout(load_settings(env={}, regions="local-eu,local-us"))}
    # local-eu removed from config, local-ap added: local-us keeps its slot,
    # local-ap does not take it, and the recorded local-eu is kept, not orphaned
    second = {s.name: s for s in port_layout(load_settings(env={}, regions="local-us,local-ap"), first)}
    assert second["gw-local-us"].ports == first["gw-local-us"].ports
    assert "gw-local-eu" in second
    taken = set(_host_ports([first["gw-local-eu"], first["gw-local-us"]]))
    assert not set(_host_ports([second["gw-local-ap"]])) & taken
    assert second["gw-local-ap"].address == "127.170.3.1", "the next free slot: a host of its own"


def test_two_nodes_on_one_port_is_refused():
    with pytest.raises(FederationError, match="given to both"):
        port_layout(load_settings(env={}, ports={"kafka.bootstrap": 17101}))


def test_node_spec_round_trips_through_json():
    s = NodeSpec("gw-x", "gateway", "local-x", {"mqtt": 1}, "127.0.1.1")
    assert NodeSpec.from_json(s.to_json()) == s
    old = NodeSpec("gw-y", "gateway", "local-y", {"mqtt": 2})
    assert NodeSpec.from_json(old.to_json()) == old and "address" not in old.to_json()


def test_kraft_cluster_ids_never_start_with_a_dash_and_are_one_per_federation():
    """One UUID in 64 encodes to an id starting with '-', which kafka-storage read as an option;
    every broker of a federation formats its storage with the same id."""
    from infra.local import services

    ids = [services.kraft_cluster_id(f"/state/{n}") for n in range(300)]
    assert all(not i.startswith("-") and len(i) == 22 for i in ids)
    assert len(set(ids)) == 300, "one per federation"
    assert services.kraft_cluster_id("/state/7") == ids[7], "the same for each broker of one"


def test_a_node_recorded_before_a_port_kind_existed_gets_it_at_its_layout_place():
    """An upgrade adds mqtts/amqps: recorded gateways keep their ports and gain the new ones in their slot."""
    s = load_settings(env={}, port_base=20000, regions="local-eu,local-us")
    fresh = {x.name: x for x in port_layout(s)}
    # recorded before too: MQTT at its layout place on the federation's host, no address of its own
    old = {
        name: NodeSpec(
            x.name,
            x.role,
            x.region,
            {k: v for k, v in x.ports.items() if k not in ("mqtts", "amqps")}
            | ({"mqtt": x.ports["amqp"] - 1} if x.role == "gateway" else {}),
        )
        for name, x in fresh.items()
    }
    upgraded = {x.name: x for x in port_layout(s, old)}
    us = upgraded["gw-local-us"]
    assert us.address is None and us.ports["mqtt"] == old["gw-local-us"].ports["mqtt"], "kept where it was"
    assert us.ports["mqtts"] == us.ports["amqp"] + 4, "the new kind at its layout place, on the host"
    assert upgraded["backend"].ports["amqps"] == fresh["backend"].ports["amqps"]


def test_the_ha_profile_lays_out_three_kafka_brokers_and_a_federation_keeps_its_count(tmp_path):
    from infra.local.layout import FederationError, port_layout
    from infra.local.settings import load_settings

    single = load_settings(env={}, state_dir=tmp_path, port_base=21000)
    ha = load_settings(env={}, state_dir=tmp_path, port_base=21000, profile="ha")
    assert [s.name for s in port_layout(single) if s.role == "kafka"] == ["kafka"]
    kafka = [s for s in port_layout(ha) if s.role == "kafka"]
    assert [s.name for s in kafka] == ["kafka", "kafka-2", "kafka-3"]
    assert len({p for s in kafka for p in s.ports.values()}) == 12, (
        "each broker its own ports (bootstrap, controller, sasl, metrics)"
    )
    assert (ha.kafka_replication, ha.kafka_min_insync) == (3, 2)
    assert (single.kafka_replication, single.kafka_min_insync) == (1, 1)
    with pytest.raises(FederationError, match="down --purge"):
        port_layout(ha, {s.name: s for s in port_layout(single)})


def test_the_ha_profile_makes_each_region_a_gateway_cluster_of_three_with_ports_of_their_own(tmp_path):
    single = load_settings(env={}, state_dir=tmp_path, port_base=21000)
    ha = load_settings(
        env={}, state_dir=tmp_path, port_base=21000, profile="ha", regions=("r-a", "r-b", "r-c")
    )
    assert [s.name for s in port_layout(single) if s.role == "gateway"] == ["gw-local-eu", "gw-local-us"]
    specs = port_layout(ha)
    gateways = [s for s in specs if s.role == "gateway"]
    assert [(s.name, s.region) for s in gateways] == [
        (f"gw-{r}{suffix}", r) for r in ("r-a", "r-b", "r-c") for suffix in ("", "-n2", "-n3")
    ]
    listeners = _host_ports(specs)
    on_host = [p for a, p in listeners if a == "127.0.0.1"]
    assert len(listeners) == len(set(listeners)) and max(on_host) < 21000 + 1000, "one block, each port once"
    assert [s.address for s in gateways][:3] == ["127.210.1.1", "127.210.1.2", "127.210.1.3"], "a host each"
    # a fourth region added later: the recorded nodes keep their ports, the new one gets three nodes
    recorded = {s.name: s for s in specs}
    grown = port_layout(dataclasses.replace(ha, regions=("r-a", "r-b", "r-c", "r-d")), recorded)
    assert all(s.ports == recorded[s.name].ports for s in grown if s.name in recorded)
    assert [s.name for s in grown if s.region == "r-d"] == ["gw-r-d", "gw-r-d-n2", "gw-r-d-n3"]
    with pytest.raises(FederationError, match="down --purge"):
        port_layout(ha, {s.name: s for s in port_layout(single)})


def test_a_larger_gateway_cluster_gets_wider_port_slots_up_to_the_block(tmp_path):
    six = load_settings(
        env={}, state_dir=tmp_path, port_base=21000, regions=("r-a", "r-b"), gateway_cluster_nodes=6
    )
    assert six.backend_nodes == 1 and six.gateway_nodes == 6, "the cluster size alone, in the single profile"
    specs = port_layout(six)
    gateways = [s for s in specs if s.role == "gateway"]
    assert [s.name for s in gateways if s.region == "r-b"] == [
        "gw-r-b",
        *(f"gw-r-b-n{m}" for m in range(2, 7)),
    ]
    listeners = _host_ports(specs)
    on_host = [p for a, p in listeners if a == "127.0.0.1"]
    assert len(listeners) == len(set(listeners)) and max(on_host) < 21000 + 1000, "one block, each port once"
    with pytest.raises(SettingsError, match="gateway_cluster_nodes: 0 .* to 21 with 2 region"):
        load_settings(env={}, regions=("r-a", "r-b"), gateway_cluster_nodes=22)


def test_a_region_named_like_another_regions_second_node_is_refused():
    ha = load_settings(env={}, port_base=21000, profile="ha", regions=("r-eu", "r-eu-n2"))
    with pytest.raises(FederationError, match="gw-r-eu-n2"):
        port_layout(ha)


def test_a_nodes_process_marker_is_no_prefix_of_another_nodes(tmp_path):
    from infra.local.processes import marker

    assert not marker(tmp_path, "backend-2").startswith(marker(tmp_path, "backend"))
    assert not marker(tmp_path, "gw-eu-n2").startswith(marker(tmp_path, "gw-eu"))
    assert marker(tmp_path, "gw-eu").startswith(marker(tmp_path, "")), "the federation's marker covers all"


def test_the_client_networks_come_from_the_record_not_from_the_readers_port_base():
    """`fedgate army|presence` given only FEDGATE_STATE_DIR read the record with the default
    port base; the client networks must still be the ones the zone was written with (CI saw
    '127.170.576.0/24' for a federation at 27000)."""
    from infra.local.dns_node import dns_endpoint

    at_27000 = load_settings(env={}, port_base=27000)
    specs = port_layout(at_27000)
    dns = next(s for s in specs if s.role == "dns")
    written = dns_endpoint(at_27000, dns, specs)["client_networks"]
    read = dns_endpoint(load_settings(env={}), dns, specs)["client_networks"]
    assert read == written == {"local-eu": "127.14.101.0/24", "local-us": "127.14.102.0/24"}
