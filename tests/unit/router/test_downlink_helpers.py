import pytest

from router.metrics import Metrics
from router.routing import topic_matches


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
