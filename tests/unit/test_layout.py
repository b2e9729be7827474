import dataclasses

import pytest

from infra.local.driver import FederationError, port_layout
from infra.local.layout import NodeSpec
from infra.local.settings import load_settings

STANDARD_PORTS = {1883, 8883, 5672, 5671, 15672, 15692, 25672, 4369, 9092, 9093}


def _ports(specs):
    return [p for s in specs for p in s.ports.values()]


def test_every_node_gets_distinct_ports_clear_of_the_standard_ones():
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
    ]
    ports = _ports(specs)
    assert len(ports) == len(set(ports))
    assert not set(ports) & STANDARD_PORTS
    gw = {s.region: s.ports for s in specs if s.role == "gateway"}
    assert set(gw["local-eu"]) == {"mqtt", "mqtts", "amqp", "amqps", "management", "dist", "prometheus"}


def test_port_base_moves_the_whole_block():
    a = _ports(port_layout(load_settings(env={}, port_base=20000)))
    b = _ports(port_layout(load_settings(env={}, port_base=30000)))
    assert [p - 20000 for p in a] == [p - 30000 for p in b]


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
    taken = set(_ports([first["gw-local-eu"], first["gw-local-us"]]))
    assert not set(second["gw-local-ap"].ports.values()) & taken


def test_two_nodes_on_one_port_is_refused():
    with pytest.raises(FederationError, match="given to both"):
        port_layout(load_settings(env={}, ports={"kafka.bootstrap": 17100}))


def test_node_spec_round_trips_through_json():
    s = NodeSpec("gw-x", "gateway", "local-x", {"mqtt": 1})
    assert NodeSpec.from_json(s.to_json()) == s


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
    old = {
        name: NodeSpec(
            x.name, x.role, x.region, {k: v for k, v in x.ports.items() if k not in ("mqtts", "amqps")}
        )
        for name, x in fresh.items()
    }
    upgraded = {x.name: x for x in port_layout(s, old)}
    assert upgraded["gw-local-us"].ports == fresh["gw-local-us"].ports
    assert upgraded["backend"].ports["amqps"] == fresh["backend"].ports["amqps"]


def test_the_ha_profile_lays_out_three_kafka_brokers_and_a_federation_keeps_its_count(tmp_path):
    from infra.local.layout import FederationError, port_layout
    from infra.local.settings import load_settings

    single = load_settings(env={}, state_dir=tmp_path, port_base=21000)
    ha = load_settings(env={}, state_dir=tmp_path, port_base=21000, profile="ha")
    assert [s.name for s in port_layout(single) if s.role == "kafka"] == ["kafka"]
    kafka = [s for s in port_layout(ha) if s.role == "kafka"]
    assert [s.name for s in kafka] == ["kafka", "kafka-2", "kafka-3"]
    assert len({p for s in kafka for p in s.ports.values()}) == 6, "each broker its own ports"
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
    ports = _ports(specs)
    assert len(ports) == len(set(ports)) and max(ports) < 21000 + 1000, "one block, each port once"
    # a fourth region added later: the recorded nodes keep their ports, the new one gets three nodes
    recorded = {s.name: s for s in specs}
    grown = port_layout(dataclasses.replace(ha, regions=("r-a", "r-b", "r-c", "r-d")), recorded)
    assert all(s.ports == recorded[s.name].ports for s in grown if s.name in recorded)
    assert [s.name for s in grown if s.region == "r-d"] == ["gw-r-d", "gw-r-d-n2", "gw-r-d-n3"]
    with pytest.raises(FederationError, match="down --purge"):
        port_layout(ha, {s.name: s for s in port_layout(single)})


def test_a_region_named_like_another_regions_second_node_is_refused():
    ha = load_settings(env={}, port_base=21000, profile="ha", regions=("r-eu", "r-eu-n2"))
    with pytest.raises(FederationError, match="gw-r-eu-n2"):
        port_layout(ha)


def test_a_nodes_process_marker_is_no_prefix_of_another_nodes(tmp_path):
    from infra.local.processes import marker

    assert not marker(tmp_path, "backend-2").startswith(marker(tmp_path, "backend"))
    assert not marker(tmp_path, "gw-eu-n2").startswith(marker(tmp_path, "gw-eu"))
    assert marker(tmp_path, "gw-eu").startswith(marker(tmp_path, "")), "the federation's marker covers all"
