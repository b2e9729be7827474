import pytest

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
