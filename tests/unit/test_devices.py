"""Device identities: ids, secrets stored as hashes only, and the permissions each device gets."""

from __future__ import annotations

import base64
import hashlib
import re
import stat

import pytest

from backend import contract as c
from backend.devices import (
    PUBLISH_PATTERN,
    SUBSCRIBE_PATTERN,
    DeviceRegistryError,
    device_users,
    password_hash,
    verify,
)
from backend.rabbitmq_admin import definitions_file
from infra.device_registry import DeviceRegistry


def test_the_hash_is_rabbitmqs_salted_sha256():
    h = password_hash("s3cret", salt=b"\x01\x02\x03\x04")
    raw = base64.b64decode(h)
    assert raw[:4] == b"\x01\x02\x03\x04"
    assert raw[4:] == hashlib.sha256(b"\x01\x02\x03\x04" + b"s3cret").digest()
    assert verify("s3cret", password_hash("s3cret")) and not verify("wrong", password_hash("s3cret"))


def test_add_issues_secrets_once_and_stores_only_hashes(tmp_path):
    reg = DeviceRegistry(tmp_path / "devices.json")
    issued = reg.add(["pump-1", "pump-2"])
    assert set(issued) == {"pump-1", "pump-2"} and issued["pump-1"] != issued["pump-2"]
    text = (tmp_path / "devices.json").read_text()
    assert issued["pump-1"] not in text and issued["pump-2"] not in text, "no secret on disk"
    assert verify(issued["pump-1"], reg.hashes()["pump-1"])
    assert stat.S_IMODE((tmp_path / "devices.json").stat().st_mode) == 0o600


def test_adding_a_known_device_needs_rotate_and_rotate_replaces_the_secret(tmp_path):
    reg = DeviceRegistry(tmp_path / "devices.json")
    first = reg.add(["pump-1"])["pump-1"]
    with pytest.raises(DeviceRegistryError, match="already registered: pump-1.*--rotate"):
        reg.add(["pump-1"])
    second = reg.add(["pump-1"], rotate=True)["pump-1"]
    assert verify(second, reg.hashes()["pump-1"]) and not verify(first, reg.hashes()["pump-1"])


def test_revoke_forgets_only_the_named_devices(tmp_path):
    reg = DeviceRegistry(tmp_path / "devices.json")
    reg.add(["a", "b"])
    assert reg.revoke(["a", "never-added"]) == ["a"]
    assert set(reg.devices()) == {"b"}


@pytest.mark.parametrize(
    "bad", ["", "has space", "dot.ted", "slash/x", "plus+", "-lead", "x" * 65, "#", "guest"]
)
def test_ids_that_are_not_safe_as_user_names_topic_segments_and_regexes_are_refused(tmp_path, bad):
    with pytest.raises(DeviceRegistryError):
        DeviceRegistry(tmp_path / "devices.json").add([bad])
    assert not (tmp_path / "devices.json").exists(), "nothing is written when one id is bad"


def test_each_device_may_publish_under_its_own_prefix_and_subscribe_to_its_own_commands():
    d = device_users({"pump-1": password_hash("x")})
    assert [u.name for u in d.users] == ["pump-1"] and d.users[0].password == ""
    (tp,) = d.topic_permissions
    assert (tp.user, tp.exchange) == ("pump-1", c.MQTT_EXCHANGE)

    def allowed(pattern: str, topic: str) -> bool:  # as RabbitMQ expands {username} and matches
        return (
            re.search(pattern.replace("{username}", "pump-1"), c.mqtt_topic_to_routing_key(topic)) is not None
        )

    assert allowed(PUBLISH_PATTERN, c.device_telemetry_topic("pump-1"))
    assert allowed(PUBLISH_PATTERN, "devices/pump-1/state/valve")
    assert not allowed(PUBLISH_PATTERN, c.device_telemetry_topic("pump-2"))
    assert not allowed(PUBLISH_PATTERN, "devices/pump-10/telemetry"), "a prefix of another id is not enough"
    assert not allowed(PUBLISH_PATTERN, "factory/line-1")
    assert allowed(SUBSCRIBE_PATTERN, c.device_command_topic("pump-1", "#"))
    assert not allowed(SUBSCRIBE_PATTERN, c.device_command_topic("pump-2", "#"))
    assert not allowed(SUBSCRIBE_PATTERN, "devices/+/commands/#")
    assert not allowed(SUBSCRIBE_PATTERN, "#")


def test_a_device_may_declare_read_and_delete_its_own_session_queues_only():
    # before: ^mqtt-subscription-.*$ for every device, so one that claimed another's client id
    # could resume (read) or wipe (configure) that device's session queue and its commands
    d = device_users({"pump-1": password_hash("x"), "pump-10": password_hash("y")})
    perms = {p.user: p for p in d.permissions}
    p = perms["pump-1"]

    def may(pattern: str, resource: str) -> bool:
        return re.search(pattern, resource) is not None

    for own in ("mqtt-subscription-pump-1qos0", "mqtt-subscription-pump-1qos1", "mqtt-will-pump-1"):
        assert may(p.configure, own) and may(p.read, own) and may(p.write, own), own
    assert may(p.read, c.MQTT_EXCHANGE) and may(p.write, c.MQTT_EXCHANGE)
    for other in (
        "mqtt-subscription-pump-10qos1",  # an id that starts with its own
        "mqtt-subscription-pump-2qos1",
        "mqtt-will-pump-10",
        "mqtt-subscription-pump-1qos1x",
        c.COMMANDS_QUEUE,
    ):
        assert not (may(p.configure, other) or may(p.read, other) or may(p.write, other)), other
    assert may(perms["pump-10"].read, "mqtt-subscription-pump-10qos1")


def test_the_definitions_file_carries_hashes_and_topic_permissions_not_secrets():
    body = definitions_file(device_users({"pump-1": password_hash("top-secret")}))
    (user,) = body["users"]
    assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256" and "password" not in user
    assert "top-secret" not in str(body)
    assert body["topic_permissions"][0]["write"] == PUBLISH_PATTERN
