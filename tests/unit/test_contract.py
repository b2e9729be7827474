import pytest

from backend import contract as c


@pytest.mark.parametrize(
    ("topic", "key"),
    [
        ("devices/d1/telemetry", "devices.d1.telemetry"),
        ("devices/d.1/telemetry", "devices.d/1.telemetry"),
        ("devices/+/commands/#", "devices.*.commands.#"),
    ],
)
def test_mqtt_topics_map_to_the_routing_keys_rabbitmq_uses(topic, key):
    assert c.mqtt_topic_to_routing_key(topic) == key


def test_routing_key_maps_back_to_the_original_topic():
    topic = "devices/sensor.7/telemetry/temp"
    assert c.routing_key_to_mqtt_topic(c.mqtt_topic_to_routing_key(topic)) == topic


@pytest.mark.parametrize("region", ["local-eu", "eu-west-1", "us-east-2", "abc"])
def test_valid_region_names(region):
    assert c.validate_region(region) == region
    assert c.downlink_exchange(region) == f"fedgate.downlink.{region}"


@pytest.mark.parametrize("region", ["", "EU", "eu_west", "-eu", "eu-", "e", "a" * 40, "eu west", "../x"])
def test_invalid_region_names_are_refused_with_the_rule(region):
    with pytest.raises(c.InvalidRegionError, match="lowercase letters"):
        c.validate_region(region)


def test_region_comes_from_the_gateway_hop_of_x_received_from():
    headers = {
        "x-received-from": [
            {
                "uri": "amqp://gw",
                "exchange": "amq.topic",
                "redelivered": False,
                "cluster-name": "local-us",
            }
        ]
    }
    assert c.region_from_headers(headers) == "local-us"


def test_region_of_a_message_with_bytes_cluster_name():
    assert c.region_from_headers({"x-received-from": [{"cluster-name": b"local-eu"}]}) == "local-eu"


@pytest.mark.parametrize("headers", [None, {}, {"x-received-from": []}, {"x-received-from": [{}]}])
def test_message_that_did_not_cross_a_gateway_link_has_no_region(headers):
    assert c.region_from_headers(headers) is None


def test_a_command_returned_from_a_downlink_queue_names_its_region():
    death = {"queue": b"federation: fedgate.downlink.local-eu -> rabbit@gw-local-eu", "reason": b"expired"}
    assert c.region_of_returned({"x-death": [death]}) == "local-eu"
    assert c.region_of_returned({"x-death": [{"queue": b"some-other-queue", "reason": b"expired"}]}) is None
    assert c.region_of_returned({}) is None
