"""The routing decision, case by case (router/routing.py): where each command goes."""

import pytest

from backend import contract as c
from router.presence import Session
from router.routing import Action, Command, Decision, View, decide, invalid, must_ask_gateway

EU = Session("d1", "local-eu", "rabbit@gw-local-eu", "conn-1", 1_000)


def test_a_connected_subscribed_device_gets_it_at_its_region_only():
    d = decide(Command("d1", "devices/d1/commands/x"), View(EU, subscribed=True, known=True))
    assert d == Decision(Action.SEND, region="local-eu")
    assert d.outcome() == "routed:local-eu"


def test_a_connected_device_not_subscribed_yet_has_it_held():
    d = decide(Command("d1", "devices/d1/commands/x"), View(EU, subscribed=False, known=True))
    assert d == Decision(Action.HOLD, region="local-eu")
    assert d.outcome() == "held:local-eu"


def test_desired_state_for_a_connected_device_not_subscribed_yet_waits_for_its_subscription():
    # before: sent at once (MQTT dropped it) and marked replayed to the connection, so the
    # subscription that followed never got it
    d = decide(Command("d1", "devices/d1/config", retain=True), View(EU, subscribed=False))
    assert d == Decision(Action.DESIRED, store_desired=True)
    subscribed = decide(Command("d1", "devices/d1/config", retain=True), View(EU, subscribed=True))
    assert subscribed == Decision(Action.SEND, region="local-eu", store_desired=True)


def test_desired_state_for_an_offline_device_is_kept_and_not_parked():
    d = decide(Command("d1", "devices/d1/config", retain=True), View(None, known=True))
    assert d == Decision(Action.DESIRED, store_desired=True)
    assert d.outcome() == "desired"


@pytest.mark.parametrize("unknown_device", ["broadcast", "park"])
def test_a_device_seen_before_and_offline_has_it_parked(unknown_device):
    d = decide(Command("d1", "devices/d1/commands/x"), View(None, known=True, unknown_device=unknown_device))
    assert d == Decision(Action.PARK)


@pytest.mark.parametrize("unknown_device", ["broadcast", "park"])
def test_a_registered_device_never_seen_has_it_parked_whatever_the_setting(unknown_device):
    # before the registry: broadcast, and every gateway dropped it (nobody subscribed)
    view = View(None, known=False, registered=True, unknown_device=unknown_device)
    assert decide(Command("new-1", "devices/new-1/commands/x"), view).action is Action.PARK


@pytest.mark.parametrize("retain", [False, True])
def test_an_id_the_registry_does_not_know_is_deadlettered_with_the_reason(retain):
    d = decide(Command("typo-1", "devices/typo-1/commands/x", retain=retain), View(None, registered=False))
    assert d.action is Action.DEADLETTER and d.reason == "device 'typo-1' is not registered"
    assert not d.store_desired, "no desired state kept for a device that does not exist"


def test_a_device_seen_before_and_since_revoked_still_has_it_parked():
    # the registry is asked only for devices never seen: a revoked one's commands expire
    view = View(None, known=True, registered=False)
    assert decide(Command("d1", "devices/d1/commands/x"), view).action is Action.PARK


def test_a_device_never_seen_gets_a_broadcast_or_a_parking_by_setting():
    # when the registry cannot say (no gateway answered): the setting decides
    cmd = Command("new", "devices/new/commands/x")
    assert decide(cmd, View(None, known=False, unknown_device="broadcast")).action is Action.BROADCAST
    assert decide(cmd, View(None, known=False, unknown_device="park")).action is Action.PARK


@pytest.mark.parametrize(
    ("device", "topic", "why"),
    [
        ("", "devices/d1/x", c.DEVICE_HEADER),
        ("d1", "", c.TOPIC_HEADER),
        ("d1", "devices/+/x", "is a filter"),
        ("d1", "devices/d1/#", "is a filter"),
        ("d1", "devices/d1/\x00", "is a filter"),
    ],
)
def test_a_command_that_cannot_be_routed_is_deadlettered_with_the_reason(device, topic, why):
    d = decide(Command(device, topic), View(EU, known=True))
    assert d.action is Action.DEADLETTER
    assert why in d.reason
    assert invalid(device, topic) == d.reason


def returned(**kw):
    return Command("d1", "devices/d1/commands/x", returned_from="local-eu", **kw)


def test_a_command_back_from_a_dead_gateway_ends_the_session_and_waits_for_the_device():
    cmd = returned()
    assert must_ask_gateway(cmd, EU)
    d = decide(cmd, View(EU, known=True, gateway_answers=False))
    assert d == Decision(Action.PARK, end_session=EU)


def test_a_command_back_from_a_slow_gateway_that_answers_goes_back_to_it():
    d = decide(returned(), View(EU, known=True, gateway_answers=True))
    assert d == Decision(Action.SEND, region="local-eu")


def test_a_command_back_while_the_device_is_elsewhere_now_follows_it():
    us = Session("d1", "local-us", "rabbit@gw-local-us", "conn-2", 2_000)
    cmd = returned()
    assert not must_ask_gateway(cmd, us)  # no question to the dead region's gateway
    assert decide(cmd, View(us, known=True)) == Decision(Action.SEND, region="local-us")


def test_a_returned_broadcast_copy_for_nobody_is_deadlettered_not_broadcast_again():
    d = decide(returned(broadcast_copy=True), View(None, known=False))
    assert d.action is Action.DEADLETTER
    assert "broadcast copy not taken by region local-eu" in d.reason


def test_returned_desired_state_is_resent_only_to_the_live_session_at_that_region():
    assert decide(returned(retain=True), View(EU, gateway_answers=True)) == Decision(
        Action.SEND, region="local-eu"
    )
    # gateway dead: the session ends, the desired state waits (already kept: not stored again)
    assert decide(returned(retain=True), View(EU, gateway_answers=False)) == Decision(
        Action.DESIRED, end_session=EU
    )


def test_a_returned_command_for_a_device_gone_offline_and_never_seen_is_broadcast_again():
    # a new router that never saw the device: the same rule as for a new command
    d = decide(returned(), View(None, known=False, unknown_device="broadcast"))
    assert d.action is Action.BROADCAST


# --- expiry and MQTT 5 answers ---------------------------------------------------------


@pytest.mark.parametrize("session", [EU, None], ids=["online", "offline"])
def test_a_command_past_its_expiry_is_dead_lettered_with_the_reason_wherever_the_device_is(session):
    cmd = Command("d1", "devices/d1/commands/x", expires_at=100.0)
    d = decide(cmd, View(session, known=True, now=100.5))
    assert d.action is Action.DEADLETTER
    assert c.EXPIRES_AT_HEADER in d.reason and "expired" in d.reason


def test_a_command_before_its_expiry_goes_on_as_any_other():
    cmd = Command("d1", "devices/d1/commands/x", expires_at=100.0)
    assert decide(cmd, View(EU, known=True, now=99.0)) == Decision(Action.SEND, region="local-eu")
    assert decide(cmd, View(None, known=True, now=99.0)) == Decision(Action.PARK)


def test_a_returned_command_keeps_its_expiry():
    cmd = Command("d1", "devices/d1/commands/x", returned_from="local-us", expires_at=100.0)
    assert decide(cmd, View(EU, known=True, now=101.0)).action is Action.DEADLETTER
    d = decide(cmd, View(EU, known=True, now=99.0))
    assert d == Decision(Action.SEND, region="local-eu")


@pytest.mark.parametrize(
    "response_topic",
    ["devices/d2/replies", "replies/d1", "devices/d1/", "devices/d1/replies/#", "devices/d1x/replies"],
)
def test_a_response_topic_the_device_may_not_publish_to_is_refused(response_topic):
    from gateways.mqtt_plugin import Mqtt5Properties

    cmd = Command("d1", "devices/d1/commands/x", properties=Mqtt5Properties(response_topic=response_topic))
    d = decide(cmd, View(EU, known=True))
    assert d.action is Action.DEADLETTER and "response topic" in d.reason


def test_a_response_topic_under_the_devices_own_topics_is_passed_on():
    from gateways.mqtt_plugin import Mqtt5Properties

    p = Mqtt5Properties(response_topic="devices/d1/replies", correlation_data=b"id-1")
    assert (
        decide(Command("d1", "devices/d1/commands/x", properties=p), View(EU, known=True)).action
        is Action.SEND
    )
