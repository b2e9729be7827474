import pytest

from router.downlink import client_id_of_queue, filter_of_binding_key, topic_matches
from router.metrics import Metrics


@pytest.mark.parametrize(
    ("flt", "topic", "ok"),
    [
        ("devices/d1/commands/#", "devices/d1/commands/reboot", True),
        ("devices/d1/commands/#", "devices/d1/commands", True),
        ("devices/+/commands/+", "devices/d1/commands/reboot", True),
        ("devices/+/commands/+", "devices/d1/commands/a/b", False),
        ("devices/d1/config", "devices/d1/config", True),
        ("devices/d1/config", "devices/d2/config", False),
        ("#", "anything/at/all", True),
    ],
)
def test_mqtt_filter_matching(flt, topic, ok):
    assert topic_matches(flt, topic) is ok


def test_subscription_queue_names_give_the_client_id():
    assert client_id_of_queue("mqtt-subscription-dev-1qos1") == "dev-1"
    assert client_id_of_queue("mqtt-subscription-dev-1qos0") == "dev-1"
    assert client_id_of_queue("federation: amq.topic -> x") is None


def test_binding_keys_become_mqtt_filters():
    assert filter_of_binding_key("devices.d/1.commands.#") == "devices/d.1/commands/#"
    assert filter_of_binding_key("devices.*.commands.*") == "devices/+/commands/+"


def test_metrics_render_in_prometheus_text_format():
    m = Metrics()
    m.inc("fedgate_router_routed_total", region="local-eu")
    m.inc("fedgate_router_routed_total", region="local-eu")
    m.observe("fedgate_router_kafka_delivery_seconds", 0.003)
    m.gauge("fedgate_router_inflight", lambda: {(): 7.0})
    text = m.render()
    assert "# TYPE fedgate_router_routed_total counter" in text
    assert 'fedgate_router_routed_total{region="local-eu"} 2' in text
    assert 'fedgate_router_kafka_delivery_seconds_bucket{le="0.005"} 1' in text
    assert 'fedgate_router_kafka_delivery_seconds_bucket{le="0.0025"} 0' in text
    assert "fedgate_router_kafka_delivery_seconds_count 1" in text
    assert "fedgate_router_inflight 7" in text
