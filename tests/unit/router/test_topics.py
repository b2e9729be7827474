import pytest

from router.topics import (
    DEFAULT_RULES,
    Rule,
    RuleError,
    TopicMapper,
    decode_topic_name,
    encode_topic_name,
    kafka_topics,
    parse_rules,
)


def test_default_rule_maps_stream_to_topic_and_device_to_key():
    m = TopicMapper().map("devices/thermo-1/telemetry/temp")
    assert (m.kafka_topic, m.key) == ("telemetry.telemetry", "thermo-1")
    assert m.variables == {"device": "thermo-1", "stream": "telemetry"}


def test_trailing_rest_matches_zero_segments():
    assert TopicMapper().map("devices/d1/events").kafka_topic == "telemetry.events"


@pytest.mark.parametrize("topic", ["devices/d1/commands/reboot", "other/d1/telemetry", "devices/d1", ""])
def test_unmatched_topics_fall_through_to_the_catch_all(topic):
    assert TopicMapper().map(topic) is None


def test_a_topic_with_an_empty_device_segment_does_not_match():
    assert TopicMapper().map("devices//telemetry") is None


def test_first_matching_rule_wins():
    rules = parse_rules(
        [
            {"pattern": "devices/{device}/telemetry/{kind:power}", "topic": "power", "key": "{device}"},
            {"pattern": "devices/{device}/{stream:telemetry}/...", "topic": "t.{stream}"},
        ]
    )
    mapper = TopicMapper(rules)
    assert mapper.map("devices/a/telemetry/power").kafka_topic == "power"
    assert mapper.map("devices/a/telemetry/temp").kafka_topic == "t.telemetry"


def test_every_topic_a_rule_can_produce_is_listed_for_creation_ahead_of_time():
    assert TopicMapper(DEFAULT_RULES).kafka_topics() == [
        "fedgate.unmatched",
        "telemetry.acks",
        "telemetry.events",
        "telemetry.replies",
        "telemetry.state",
        "telemetry.telemetry",
    ]


def test_a_devices_answers_to_commands_are_bridged_by_the_default_rule():
    m = TopicMapper().map("devices/d1/replies")
    assert (m.kafka_topic, m.key) == ("telemetry.replies", "d1")


def test_the_topics_a_bridge_writes_are_the_rules_topics_plus_catch_all_and_dead_letters():
    rules = parse_rules(
        [
            {"pattern": "devices/{device}/energy/{kind:power|total}", "topic": "energy.{kind}"},
            {
                "pattern": "devices/{device}/{stream:telemetry|events|state}/...",
                "topic": "telemetry.{stream}",
            },
        ]
    )
    assert kafka_topics(rules, "u.caught", "u.dead") == [
        "energy.power",
        "energy.total",
        "telemetry.events",
        "telemetry.state",
        "telemetry.telemetry",
        "u.caught",
        "u.dead",
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([{"pattern": "d/{device}", "topic": "t", "kye": "{device}"}], "rule #1: unknown key 'kye'"),
        (["d/{device} -> t"], "rule #1: a table"),
        ({"pattern": "d/{device}", "topic": "t"}, "a list of rule tables"),
    ],
)
def test_rules_that_are_not_rule_tables_are_refused(raw, message):
    with pytest.raises(RuleError, match=message):
        parse_rules(raw)


def test_topic_variables_must_list_their_values():
    with pytest.raises(RuleError, match="must list its values"):
        Rule("devices/{device}/{stream}", "t.{stream}")


@pytest.mark.parametrize(
    ("pattern", "topic", "message"),
    [
        ("devices/{device}/#", "t", "bad segment"),
        ("devices//x", "t", "bad segment"),
        ("devices/{d}/{d}", "t", "appears twice"),
        ("devices/{device}", "t.{stream}", "unknown {stream}"),
    ],
)
def test_malformed_rules_are_refused_at_load(pattern, topic, message):
    with pytest.raises(RuleError, match=message):
        Rule(pattern, topic)


def test_missing_rule_field_is_named():
    with pytest.raises(RuleError, match="rule #1: missing 'topic'"):
        parse_rules([{"pattern": "a/{device}"}])


@pytest.mark.parametrize("name", ["telemetry.temp", "sensor/α", "a_b", "x y+z#", "ünïcode-名前"])
def test_kafka_topic_names_are_legal_and_reversible(name):
    enc = encode_topic_name(name)
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in enc)
    assert decode_topic_name(enc) == name


def test_names_kafka_accepts_stay_readable():
    assert encode_topic_name("telemetry.temp-1") == "telemetry.temp-1"
    assert encode_topic_name("a_b") == "a_5fb"


def test_a_topic_of_a_rules_shape_with_an_empty_variable_names_that_variable():
    mapper = TopicMapper()
    assert mapper.empty_variable("devices//telemetry") == "device"
    assert mapper.empty_variable("devices//anything/else") == "device"
    assert mapper.empty_variable("devices/d1/telemetry") is None
    assert mapper.empty_variable("factory//line") is None
