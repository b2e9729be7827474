from gateways.mqtt_plugin import client_id_from_event
from router.presence import PresenceTable, Session, sessions_from_management


def created(cid, region, conn, at, node=None):
    return {
        "x-received-from": [{"cluster-name": region}],
        "node": node or f"fedgate-gw-{region}@localhost",
        "name": conn,
        "protocol": "{'MQTT',\"3.1.1\"}",
        "variable_map": f'#{{<<"client_id">> => <<"{cid}">>}}',
        "connected_at": at,
    }


def closed(region, conn, node=None):
    return {
        "x-received-from": [{"cluster-name": region}],
        "node": node or f"fedgate-gw-{region}@localhost",
        "name": conn,
    }


def test_client_id_is_read_from_the_erlang_formatted_variable_map():
    assert client_id_from_event(created("dev-1", "local-eu", "c1", 1)) == "dev-1"
    assert client_id_from_event({"protocol": "MQTT", "variable_map": {"client_id": b"dev-2"}}) == "dev-2"


def test_amqp_connections_are_not_devices():
    t = PresenceTable()
    ch = t.apply_event("connection.created", {**created("x", "local-eu", "c1", 1), "protocol": "{0,9,1}"})
    assert ch.session is None and len(t) == 0


def test_connect_then_close_of_the_same_connection():
    t = PresenceTable()
    t.apply_event("connection.created", created("d", "local-eu", "c1", 100))
    assert t.get("d").region == "local-eu"
    t.apply_event("connection.closed", closed("local-eu", "c1"))
    assert t.get("d") is None


def test_roaming_newest_connection_wins_and_the_older_one_is_displaced():
    t = PresenceTable()
    t.apply_event("connection.created", created("d", "local-eu", "c1", 100))
    ch = t.apply_event("connection.created", created("d", "local-us", "c2", 200))
    assert t.get("d").region == "local-us"
    assert ch.displaced.region == "local-eu" and ch.displaced.connection == "c1"
    # the old gateway's close arrives after the new connect: presence stays at local-us
    t.apply_event("connection.closed", closed("local-eu", "c1"))
    assert t.get("d").region == "local-us"


def test_an_older_connect_reported_late_does_not_win():
    t = PresenceTable()
    t.apply_event("connection.created", created("d", "local-us", "c2", 200))
    ch = t.apply_event("connection.created", created("d", "local-eu", "c1", 100))
    assert t.get("d").region == "local-us"
    assert ch.displaced.connection == "c1", "the stale connection is the one to close"


def test_reconnect_on_the_same_gateway_is_not_a_displacement():
    t = PresenceTable()
    t.apply_event("connection.created", created("d", "local-eu", "c1", 100))
    ch = t.apply_event("connection.created", created("d", "local-eu", "c2", 200))
    assert ch.displaced is None
    t.apply_event("connection.closed", closed("local-eu", "c1"))
    assert t.get("d").connection == "c2"


def test_duplicate_event_is_idempotent():
    t = PresenceTable()
    t.apply_event("connection.created", created("d", "local-eu", "c1", 100))
    ch = t.apply_event("connection.created", created("d", "local-eu", "c1", 100))
    assert ch.ignored and len(t) == 1


def test_counts_per_region():
    t = PresenceTable()
    for i, region in enumerate(["local-eu", "local-eu", "local-us"]):
        t.apply_event("connection.created", created(f"d{i}", region, f"c{i}", i))
    assert t.per_region() == {"local-eu": 2, "local-us": 1}


def test_rebuild_from_management_api_listing():
    listing = [
        {
            "protocol": "MQTT 3.1.1",
            "client_properties": {"client_id": "d1"},
            "node": "n",
            "name": "c1",
            "connected_at": 5,
        },
        {"protocol": "AMQP 0-9-1", "client_properties": {}, "node": "n", "name": "fed", "connected_at": 1},
    ]
    sessions = sessions_from_management("local-eu", listing)
    assert sessions == [Session("d1", "local-eu", "n", "c1", 5)]
    t = PresenceTable()
    t.replace_all(sessions)
    assert t.get("d1").region == "local-eu"


def test_a_device_posing_as_another_does_not_move_it():
    t = PresenceTable()
    t.apply_event("connection.created", {**created("pump-1", "local-eu", "c1", 100), "user": "pump-1"})
    # pump-2 logs in with its own secret but takes pump-1's client id on another gateway
    ch = t.apply_event("connection.created", {**created("pump-1", "local-us", "c2", 200), "user": "pump-2"})
    assert ch.refused and "pump-2" in ch.ignored
    assert t.get("pump-1").region == "local-eu", "pump-1's commands still go where pump-1 is"


def test_the_administrator_may_use_any_client_id():
    t = PresenceTable()
    ch = t.apply_event(
        "connection.created", {**created("monitor", "local-eu", "c1", 1), "user": "fedgate-admin"}
    )
    assert not ch.refused and t.get("monitor") is not None


def test_rebuild_skips_connections_posing_as_another_device():
    listing = [
        {
            "protocol": "MQTT 3.1.1",
            "client_properties": {"client_id": "d1"},
            "user": "d1",
            "node": "n",
            "name": "c1",
            "connected_at": 5,
        },
        {
            "protocol": "MQTT 3.1.1",
            "client_properties": {"client_id": "d2"},
            "user": "d3",
            "node": "n",
            "name": "c2",
            "connected_at": 6,
        },
    ]
    assert [s.client_id for s in sessions_from_management("local-eu", listing)] == ["d1"]


def test_rebuild_from_a_tracked_listing_dates_connections_at_the_listing():
    # a 4.0 gateway without management statistics lists name, user and node only
    listing = [
        {"name": "p:1 -> g:1883", "vhost": "/", "user": "d1", "node": "n"},
        {"name": "p:2 -> g:5672", "vhost": "/", "user": "fedgate-backend", "node": "n"},
    ]
    sessions = sessions_from_management("local-eu", listing, listed_at_ms=9_000)
    assert sessions == [Session("d1", "local-eu", "n", "p:1 -> g:1883", 9_000)]
    # a saved session of d1 on a connection made before the listing gives way to the listed one
    t = PresenceTable()
    t.replace_all([Session("d1", "local-us", "m", "old", 5_000)])
    t.connected(sessions[0])
    assert t.get("d1").region == "local-eu"
