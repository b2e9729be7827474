"""The MQTT plugin's internals as the router reads them (gateways/mqtt_plugin.py)."""

from gateways.mqtt_plugin import (
    client_id_from_event,
    client_id_of_queue,
    filter_of_binding_key,
    filters_of_bindings,
    is_clean_session_queue,
    mqtt_connections,
    subscription_from_event,
    subscription_queue,
)


def test_subscription_queue_names_give_the_client_id():
    assert client_id_of_queue("mqtt-subscription-dev-1qos1") == "dev-1"
    assert client_id_of_queue("mqtt-subscription-dev-1qos0") == "dev-1"
    assert client_id_of_queue(subscription_queue("dev-7", 1)) == "dev-7"
    assert client_id_of_queue("federation: amq.topic -> x") is None
    assert client_id_of_queue("mqtt-subscription-qos1") is None


def test_binding_keys_become_mqtt_filters():
    assert filter_of_binding_key("devices.d/1.commands.#") == "devices/d.1/commands/#"
    assert filter_of_binding_key("devices.*.commands.*") == "devices/+/commands/+"


def test_client_id_from_a_310_event_and_from_a_table():
    erlang_text = {"protocol": "{'MQTT',\"3.1.1\"}", "variable_map": '#{<<"client_id">> => <<"dev-1">>}'}
    assert client_id_from_event(erlang_text) == "dev-1"
    assert client_id_from_event({"protocol": "MQTT", "variable_map": {"client_id": b"dev-2"}}) == "dev-2"
    assert client_id_from_event({"protocol": "AMQP 0-9-1", "variable_map": {"client_id": "x"}}) is None
    assert client_id_from_event({"protocol": "MQTT"}) is None


def test_client_id_from_a_40_event():
    # as a RabbitMQ 4.0.5 gateway sent it, federated to the backend
    event = {
        "protocol": "{'MQTT',{3,1,1}}",
        "client_properties": ['{client_id,longstr,<<"probe-1">>}'],
        "user": "probe-1",
    }
    assert client_id_from_event(event) == "probe-1"
    assert client_id_from_event({**event, "client_properties": [b'{client_id,longstr,<<"d\\"q">>}']}) == 'd"q'
    assert client_id_from_event({**event, "client_properties": ['{other,longstr,<<"x">>}']}) is None


def test_connection_listing_keeps_mqtt_connections_with_a_client_id():
    listing = [
        {
            "protocol": "MQTT 3.1.1",
            "client_properties": {"client_id": "d1"},
            "node": "n",
            "name": "c1",
            "connected_at": 5,
            "user": "d1",
        },
        {"protocol": "MQTT 3.1.1", "variable_map": {"client_id": "d2"}, "node": "n", "name": "c2"},
        {"protocol": "AMQP 0-9-1", "client_properties": {}, "node": "n", "name": "c3"},
        {"protocol": "MQTT 3.1.1", "client_properties": {}, "node": "n", "name": "c4"},
    ]
    conns = mqtt_connections(listing)
    assert [(x.client_id, x.name, x.connected_at, x.user) for x in conns] == [
        ("d1", "c1", 5, "d1"),
        ("d2", "c2", 0, ""),
    ]


def test_a_tracked_listing_gives_devices_by_their_user():
    # as a 4.0.5 gateway that collects no management statistics lists its connections
    listing = [
        {"name": "127.0.0.1:32805 -> 127.0.0.1:21100", "vhost": "/", "user": "qd1", "node": "gw@h"},
        {
            "name": "127.0.0.1:46270 -> 127.0.0.1:21106",
            "vhost": "/",
            "user": "fedgate-backend",
            "node": "gw@h",
        },
        {"name": "127.0.0.1:46271 -> 127.0.0.1:21101", "vhost": "/", "user": "fedgate-admin", "node": "gw@h"},
        {"name": "<gw@h.1795464680.972.0>", "vhost": "/", "user": "none", "node": "gw@h"},
    ]
    conns = mqtt_connections(listing)
    assert [(x.client_id, x.node, x.name, x.connected_at, x.user) for x in conns] == [
        ("qd1", "gw@h", "127.0.0.1:32805 -> 127.0.0.1:21100", 0, "qd1")
    ]


def test_binding_created_events_are_subscriptions_only_from_the_mqtt_exchange():
    headers = {
        "source_name": "amq.topic",
        "destination_name": "mqtt-subscription-dev-1qos1",
        "routing_key": "devices.dev-1.commands.#",
        "x-received-from": [{"cluster-name": "local-eu"}],
    }
    made = subscription_from_event(headers)
    assert made is not None
    assert (made.client_id, made.region, made.topic_filter) == (
        "dev-1",
        "local-eu",
        "devices/dev-1/commands/#",
    )
    assert subscription_from_event({**headers, "source_name": "fedgate.downlink"}) is None
    assert subscription_from_event({**headers, "destination_name": "some-queue"}) is None


def test_filters_of_bindings_leave_out_the_default_binding():
    bindings = [
        {"source": "", "routing_key": "mqtt-subscription-d1qos1"},
        {"source": "amq.topic", "routing_key": "devices.d1.commands.#"},
    ]
    assert filters_of_bindings(bindings) == ["devices/d1/commands/#"]


def test_a_clean_sessions_queue_is_auto_delete_on_310_and_exclusive_on_40():
    assert is_clean_session_queue({"auto_delete": True, "exclusive": False})
    assert is_clean_session_queue({"auto_delete": False, "exclusive": True, "durable": True})
    persistent = {"auto_delete": False, "exclusive": False, "arguments": {"x-expires": 86400000}}
    assert not is_clean_session_queue(persistent)


def test_the_bindings_of_amq_topic_say_what_each_session_subscribes_to_with_its_qos():
    from gateways.mqtt_plugin import subscriptions_of_bindings

    bindings = [
        {
            "destination": "mqtt-subscription-pump-1qos0",
            "destination_type": "queue",
            "routing_key": "devices.pump-1.commands.#",
        },
        {
            "destination": "mqtt-subscription-pump-1qos1",
            "destination_type": "queue",
            "routing_key": "devices.pump-1.config",
        },
        {"destination": "federation: amq.topic -> b:t", "destination_type": "queue", "routing_key": "#"},
        {"destination": "fedgate.downlink", "destination_type": "exchange", "routing_key": "#"},
    ]
    assert subscriptions_of_bindings(bindings) == {
        "pump-1": {"devices/pump-1/commands/#": 0, "devices/pump-1/config": 1}
    }
