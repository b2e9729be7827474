"""What each live connection subscribes to, as far as the router has seen it.

MQTT drops a message for a topic nobody subscribes to, and a device
subscribes only after its connect, which the router learns of first.  So a
command for a device whose subscriptions are known and do not match waits
(the downlink holds it) until a `binding.created` event says the device
subscribed.  Connections the router did not see open (those found by the
rebuild at start) are taken as subscribed: their subscriptions were made
before this router ran.

Also kept per connection: the desired-state topics already replayed to it,
so that a device gets its desired state once per connection; and the QoS of
each filter seen subscribed (from the binding event's queue name): a command
that reaches a connection only through QoS 0 subscriptions is one its device
acknowledges itself (docs/router.md, "Acknowledged commands").
"""

from __future__ import annotations

import time

from router.routing import topic_matches


class Subscriptions:
    def __init__(self) -> None:
        #: connection -> filters seen, with their QoS; a connection missing here counts as subscribed
        self._filters: dict[str, dict[str, int]] = {}
        #: connection -> when (monotonic) its gateway was last asked for its subscriptions
        self._asked: dict[str, float] = {}
        #: connection -> desired-state topics already replayed to it
        self._replayed: dict[str, set[str]] = {}

    def opened(self, connection: str) -> None:
        """A connection the router saw open: it subscribes to nothing until it says so."""
        self._filters[connection] = {}

    def add(self, connection: str, filters: list[str], qos: int = 1) -> None:
        """Filters the connection subscribed with (subscribing again replaces the QoS, as in MQTT).

        Filters asked from a gateway (a persistent session's) are taken as QoS 1."""
        if connection in self._filters:
            self._filters[connection].update(dict.fromkeys(filters, qos))

    def unknown(self, connection: str) -> None:
        """Its gateway could not say: count the connection as subscribed to everything."""
        self._filters.pop(connection, None)

    def covers(self, connection: str, topic: str) -> bool:
        """Whether a message on `topic` reaches the connection now."""
        filters = self._filters.get(connection)
        return filters is None or any(topic_matches(f, topic) for f in filters)

    def filters(self, connection: str) -> list[str] | None:
        """The filters seen subscribed; None when unknown (counted as subscribed to everything)."""
        filters = self._filters.get(connection)
        return None if filters is None else list(filters)

    def only_qos0(self, connection: str, topic: str) -> bool:
        """Whether a message on `topic` reaches the connection through QoS 0 subscriptions only:
        MQTT then delivers it at most once, and only the device's acknowledgement says it arrived."""
        filters = self._filters.get(connection)
        if not filters:
            return False
        matching = [q for f, q in filters.items() if topic_matches(f, topic)]
        return bool(matching) and max(matching) == 0

    def delivery(self, connection: str, topic: str) -> str:
        """How a message on `topic` reaches the connection: "qos1" (MQTT carries it from the
        session's queue, at least once), "qos0" (at most once: the device acknowledges it
        itself, router/acks.py), "" when the router does not know the connection's filters."""
        filters = self._filters.get(connection)
        matching = [q for f, q in (filters or {}).items() if topic_matches(f, topic)]
        return f"qos{max(matching)}" if matching else ""

    def ask_due(self, connection: str, every_s: float, now: float | None = None) -> bool:
        """True the first time, and again once `every_s` passed since the last ask: the caller
        asks the gateway for the connection's filters (and marks the ask)."""
        now = time.monotonic() if now is None else now
        last = self._asked.get(connection)
        if last is not None and now - last < every_s:
            return False
        self._asked[connection] = now
        return True

    def mark_asked(self, connection: str) -> None:
        self._asked[connection] = time.monotonic()

    def replayed(self, connection: str, topic: str) -> bool:
        return topic in self._replayed.get(connection, ())

    def mark_replayed(self, connection: str, topic: str) -> None:
        self._replayed.setdefault(connection, set()).add(topic)

    def forget(self, connection: str) -> None:
        """The connection ended."""
        self._replayed.pop(connection, None)
        self._filters.pop(connection, None)
        self._asked.pop(connection, None)
