"""MQTT topic -> Kafka topic + key: the bridge's mapping rules.

A rule has an MQTT topic *pattern* made of segments:

    devices/{device}/{stream:telemetry|events|state|replies|acks}/...

- a literal segment matches itself;
- ``{name}`` matches any one non-empty segment and captures it;
- ``{name:a|b|c}`` matches only one of the listed values.  Variables used in
  the Kafka topic template must be listed this way, so that the set of Kafka
  topics a rule can produce is finite and created ahead of time;
- a trailing ``...`` matches any number (zero or more) of further segments.

and templates for the Kafka topic and key, e.g. ``telemetry.{stream}`` and
``{device}``.  The first rule that matches wins.  A topic no rule matches
goes to the catch-all topic with its MQTT topic in a header.

The rules alone say which Kafka topics the bridge can write (kafka_topics):
the router creates exactly those at start, and the Spark job subscribes to
exactly those.

Kafka topic names may only hold ``[a-zA-Z0-9._-]`` and at most 249
characters.  Any other character a template produces is encoded reversibly
(see encode_topic_name).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from backend.errors import FedgateError

KAFKA_TOPIC_MAX = 249
_LEGAL = re.compile(r"[a-zA-Z0-9.-]")
_VAR = re.compile(r"^\{([a-z_][a-z0-9_]*)(?::([^{}]+))?\}$")
_TEMPLATE_VAR = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


class RuleError(FedgateError, ValueError):
    """A mapping rule is malformed; raised when settings are loaded, not per message."""


def encode_topic_name(name: str) -> str:
    """Make `name` a legal Kafka topic name, reversibly.

    Letters, digits, "." and "-" stay; every other character, including "_"
    itself, becomes "_" followed by the two hex digits of each of its UTF-8
    bytes ("sensor/α" -> "sensor_2f_ce_b1").
    """
    out = []
    for ch in name:
        if _LEGAL.match(ch):
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode())
    return "".join(out)


def decode_topic_name(encoded: str) -> str:
    raw = bytearray()
    i = 0
    while i < len(encoded):
        if encoded[i] == "_":
            raw.append(int(encoded[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(encoded[i].encode())
            i += 1
    return raw.decode()


@dataclass(frozen=True)
class Segment:
    literal: str | None = None
    var: str | None = None
    allowed: frozenset[str] | None = None


@dataclass(frozen=True)
class Match:
    rule: Rule
    variables: dict[str, str]
    kafka_topic: str
    key: str


@dataclass(frozen=True)
class Rule:
    pattern: str
    topic: str
    key: str = "{device}"
    segments: tuple[Segment, ...] = field(init=False, repr=False)
    rest: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts = self.pattern.split("/")
        rest = parts[-1] == "..."
        if rest:
            parts = parts[:-1]
        segments = []
        for p in parts:
            m = _VAR.match(p)
            if m:
                allowed = frozenset(v.strip() for v in m.group(2).split("|")) if m.group(2) else None
                segments.append(Segment(var=m.group(1), allowed=allowed))
            elif not p or any(ch in p for ch in "{}+#") or p == "...":
                raise RuleError(f"rule {self.pattern!r}: bad segment {p!r}")
            else:
                segments.append(Segment(literal=p))
        names = [s.var for s in segments if s.var]
        if len(names) != len(set(names)):
            raise RuleError(f"rule {self.pattern!r}: a variable appears twice")
        object.__setattr__(self, "segments", tuple(segments))
        object.__setattr__(self, "rest", rest)
        for tmpl, what in ((self.topic, "topic"), (self.key, "key")):
            for var in _TEMPLATE_VAR.findall(tmpl):
                if var not in names:
                    raise RuleError(f"rule {self.pattern!r}: {what} template uses unknown {{{var}}}")
        for var in _TEMPLATE_VAR.findall(self.topic):
            seg = next(s for s in segments if s.var == var)
            if seg.allowed is None:
                raise RuleError(
                    f"rule {self.pattern!r}: topic template variable {{{var}}} must list its values "
                    f"({{{var}:a|b}}) so that its Kafka topics can be created ahead of time"
                )
        for t in self.kafka_topics():
            if len(t) > KAFKA_TOPIC_MAX or t in ("", ".", ".."):
                raise RuleError(f"rule {self.pattern!r}: Kafka topic {t!r} is not a valid name")

    def match(self, mqtt_topic: str) -> Match | None:
        parts = mqtt_topic.split("/")
        if len(parts) < len(self.segments) or (not self.rest and len(parts) != len(self.segments)):
            return None
        variables: dict[str, str] = {}
        for seg, part in zip(self.segments, parts, strict=False):
            if seg.literal is not None:
                if part != seg.literal:
                    return None
            else:
                if not part or (seg.allowed is not None and part not in seg.allowed):
                    return None
                variables[seg.var or ""] = part
        return Match(
            self,
            variables,
            encode_topic_name(self.topic.format(**variables)),
            self.key.format(**variables),
        )

    def empty_variable(self, mqtt_topic: str) -> str | None:
        """The variable whose segment is empty in a topic of this rule's shape ("devices//x" -> "device")."""
        parts = mqtt_topic.split("/")
        if len(parts) < len(self.segments) or (not self.rest and len(parts) != len(self.segments)):
            return None
        empty = None
        for seg, part in zip(self.segments, parts, strict=False):
            if seg.literal is not None and part != seg.literal:
                return None
            if seg.var is not None and not part and empty is None:
                empty = seg.var
        return empty

    def kafka_topics(self) -> list[str]:
        """Every Kafka topic this rule can produce."""
        names = _TEMPLATE_VAR.findall(self.topic)
        choices = [sorted(next(s for s in self.segments if s.var == n).allowed or ()) for n in names]
        return [
            encode_topic_name(self.topic.format(**dict(zip(names, combo, strict=True))))
            for combo in itertools.product(*choices)
        ]


_MISS: Any = object()

DEFAULT_RULES = (
    Rule("devices/{device}/{stream:telemetry|events|state|replies|acks}/...", "telemetry.{stream}"),
)


class TopicMapper:
    def __init__(self, rules: tuple[Rule, ...] = DEFAULT_RULES, unmatched_topic: str = "fedgate.unmatched"):
        self.rules = rules
        self.unmatched_topic = unmatched_topic
        self._cache: dict[str, Match | None] = {}

    def map(self, mqtt_topic: str) -> Match | None:
        """The first matching rule's result, or None (-> the catch-all topic)."""
        # Devices repeat their topics: remember the last answers (rules never change).
        hit = self._cache.get(mqtt_topic, _MISS)
        if hit is not _MISS:
            return hit
        result = self._map(mqtt_topic)
        if len(self._cache) >= 100_000:
            self._cache.clear()
        self._cache[mqtt_topic] = result
        return result

    def _map(self, mqtt_topic: str) -> Match | None:
        for rule in self.rules:
            m = rule.match(mqtt_topic)
            if m is not None:
                return m
        return None

    def empty_variable(self, mqtt_topic: str) -> str | None:
        """For a topic no rule maps: the variable a rule would have captured but found empty."""
        for rule in self.rules:
            var = rule.empty_variable(mqtt_topic)
            if var is not None:
                return var
        return None

    def kafka_topics(self) -> list[str]:
        topics = {t for r in self.rules for t in r.kafka_topics()}
        topics.add(self.unmatched_topic)
        return sorted(topics)


def kafka_topics(rules: Iterable[Rule], unmatched_topic: str, deadletter_topic: str) -> list[str]:
    """Every Kafka topic a bridge with these rules writes to: each rule's topics (finite, as
    every variable of a topic template lists its values), the catch-all and the dead-letter
    topic.  The router creates these ahead of time; the Spark job subscribes to these."""
    return sorted({*(t for r in rules for t in r.kafka_topics()), unmatched_topic, deadletter_topic})


_RULE_KEYS = ("pattern", "topic", "key")


def parse_rules(raw: list[dict[str, str]]) -> tuple[Rule, ...]:
    """Rules from config: a list of {pattern, topic, key?} tables."""
    if not isinstance(raw, list):
        raise RuleError(f"a list of rule tables ([[rules]]), not {raw!r}")
    rules = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RuleError(f"rule #{i + 1}: a table with {', '.join(_RULE_KEYS)}, not {item!r}")
        unknown = sorted(set(item) - set(_RULE_KEYS))
        if unknown:
            raise RuleError(f"rule #{i + 1}: unknown key {unknown[0]!r} (a rule has {', '.join(_RULE_KEYS)})")
        try:
            rules.append(Rule(item["pattern"], item["topic"], item.get("key", "{device}")))
        except KeyError as e:
            raise RuleError(f"rule #{i + 1}: missing {e.args[0]!r}") from e
    if not rules:
        raise RuleError("at least one mapping rule is needed")
    return tuple(rules)
