"""MQTT 5 properties as RabbitMQ 4.0's MQTT plugin carries them in AMQP 0.9.1
(gateways/mqtt_plugin.py); the shapes are the ones seen on a 4.0.5 gateway."""

from gateways.mqtt_plugin import NO_PROPERTIES, Mqtt5Properties, amqp_fields, properties_of

#: what a 4.0.5 backend received for an MQTT 5 PUBLISH with user properties
#: unit=C, fw=1.2.3, unit=K (repeated), binary correlation data and a response topic
SEEN_ON_4_0 = {
    "fw": "1.2.3",
    "unit": "C",
    "x-correlation-id": "\x00\x01corr",
    "x-received-from": [{"uri": "amqps://127.0.0.1:21106", "cluster-name": "local-eu"}],
    "x-reply-to-topic": "devices.m5-a.replies",
}


def test_user_properties_are_the_headers_rabbitmq_did_not_set_itself():
    p = properties_of(SEEN_ON_4_0, "application/json", None)
    assert dict(p.user_properties) == {"fw": "1.2.3", "unit": "C"}
    assert p.content_type == "application/json"
    assert p.response_topic == "devices/m5-a/replies"
    assert p.correlation_data == b"\x00\x01corr"


def test_an_mqtt_3_1_1_message_has_no_properties():
    assert properties_of({"x-received-from": []}, None, None) == NO_PROPERTIES
    assert properties_of(None, None, None) == NO_PROPERTIES


def test_text_correlation_data_travels_as_the_amqp_correlation_id():
    p = properties_of({}, None, "cmd-123")
    assert p.correlation_data == b"cmd-123"
    headers, props = amqp_fields(Mqtt5Properties(correlation_data=b"cmd-123"))
    assert props == {"correlation_id": "cmd-123"} and headers == {}


def test_binary_or_long_correlation_data_travels_in_the_header_the_plugin_reads():
    for corr in (b"\xff\x00", b"x" * 256):
        headers, props = amqp_fields(Mqtt5Properties(correlation_data=corr))
        assert "correlation_id" not in props and headers["x-correlation-id"] == corr


def test_the_response_topic_goes_out_in_amqp_form_and_comes_back_the_same():
    p = Mqtt5Properties(response_topic="devices/d1/replies", content_type="text/plain")
    headers, props = amqp_fields(p)
    assert headers == {"x-reply-to-topic": "devices.d1.replies"} and props == {"content_type": "text/plain"}
    assert properties_of(headers, props["content_type"], None) == p


def test_a_subscriptions_qos_is_read_from_its_queue_name():
    from gateways.mqtt_plugin import qos_of_queue, subscription_from_event

    assert qos_of_queue("mqtt-subscription-d1qos0") == 0
    assert qos_of_queue("mqtt-subscription-d1qos1") == 1
    assert qos_of_queue("fedgate.router.acks") is None
    event = {
        "source_name": "amq.topic",
        "destination_name": "mqtt-subscription-d1qos0",
        "routing_key": "devices.d1.commands.#",
        "x-received-from": [{"cluster-name": "local-eu"}],
    }
    made = subscription_from_event(event)
    assert made is not None and (made.client_id, made.topic_filter, made.qos) == (
        "d1",
        "devices/d1/commands/#",
        0,
    )
