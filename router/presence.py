"""Presence: which gateway holds each device (MQTT client id), and since when.

Fed by the gateways' connection events (federated to the backend's presence
exchange) and rebuilt at start from each gateway's management API, so a
restarted router routes correctly from its first message.

Races are settled by connection time: the newest connection of a client id
wins, wherever it is.  A close removes presence only if it closes the very
connection presence points to (a device that reconnected elsewhere first
and whose old connection closes later stays where it is now).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend import contract as c
from gateways import mqtt_plugin
from gateways.mqtt_plugin import text as _text


@dataclass(frozen=True)
class Session:
    """One live MQTT connection of a device."""

    client_id: str
    region: str
    node: str
    #: connection name, unique per node ("peer -> listener"); what closes it
    connection: str
    #: milliseconds since the epoch, from the gateway
    connected_at: int


@dataclass(frozen=True)
class Change:
    """What an event did to presence; `displaced` is a connection to close."""

    session: Session | None
    displaced: Session | None = None
    ignored: str = ""
    #: the event was a device posing as another one (ignored says how)
    refused: bool = False
    #: the event lacked what every gateway event carries (ignored says what)
    malformed: bool = False


class PresenceTable:
    def __init__(self) -> None:
        self._by_client: dict[str, Session] = {}
        self._by_conn: dict[tuple[str, str], str] = {}

    # --- queries -------------------------------------------------------------

    def get(self, client_id: str) -> Session | None:
        return self._by_client.get(client_id)

    def __len__(self) -> int:
        return len(self._by_client)

    def per_region(self) -> Counter[str]:
        return Counter(s.region for s in self._by_client.values())

    def sessions(self) -> list[Session]:
        return sorted(self._by_client.values(), key=lambda s: s.client_id)

    # --- updates ---------------------------------------------------------------

    def connected(self, s: Session) -> Change:
        current = self._by_client.get(s.client_id)
        if current is not None and (current.node, current.connection) == (s.node, s.connection):
            return Change(current, ignored="already known")
        if current is not None and current.connected_at > s.connected_at:
            # an older connection reported late: the newer one stays, the old one must go
            return Change(current, displaced=s, ignored="older than the current session")
        if current is not None:
            self._by_conn.pop((current.node, current.connection), None)
        self._by_client[s.client_id] = s
        self._by_conn[(s.node, s.connection)] = s.client_id
        # the same client id on another connection is displaced; on the same node
        # RabbitMQ already closed it (client id takeover)
        displaced = current if current is not None and current.node != s.node else None
        return Change(s, displaced=displaced)

    def closed(self, node: str, connection: str) -> Change:
        cid = self._by_conn.pop((node, connection), None)
        if cid is None:
            return Change(None, ignored="not the current session of any device")
        return Change(self._by_client.pop(cid))

    def replace_all(self, sessions: list[Session]) -> None:
        """Reset to what the gateways report (rebuild); newest per client id wins."""
        self._by_client.clear()
        self._by_conn.clear()
        for s in sorted(sessions, key=lambda s: s.connected_at):
            self.connected(s)

    # --- from the wire ------------------------------------------------------------

    def apply_event(self, routing_key: str, headers: Mapping[str, Any]) -> Change:
        """Apply one federated gateway event (connection.created / connection.closed)."""
        region = c.region_from_headers(headers)
        node = _text(headers.get("node", ""))
        name = _text(headers.get("name", ""))
        if region is None or not node or not name:
            return Change(None, ignored="event without region, node or connection name", malformed=True)
        if routing_key == "connection.created":
            cid = mqtt_plugin.client_id_from_event(headers)
            if cid is None:
                return Change(None, ignored="not an MQTT connection")
            refused = impersonation(cid, _text(headers.get("user", "")))
            if refused:
                return Change(None, ignored=refused, refused=True)
            at = headers.get("connected_at") or headers.get("timestamp_in_ms") or int(time.time() * 1000)
            return self.connected(Session(cid, region, node, name, int(at)))
        if routing_key == "connection.closed":
            return self.closed(node, name)
        return Change(None, ignored=f"event {routing_key} is not about presence")


def impersonation(client_id: str, user: str) -> str:
    """Why a connection may not stand for device `client_id` ("" if it may).

    Each device logs in as itself (backend/devices.py), so a connection is
    device X only if it authenticated as X: a device that takes another's
    client id must not draw that device's commands to its own gateway.
    fedgate's administrator (operators' tools) may use any client id.
    """
    if not user or user in (client_id, c.ADMIN_USER):
        return ""
    return f"client id {client_id!r} used by user {user!r}: a device connects only as itself"


def sessions_from_management(
    region: str, connections: list[dict[str, Any]], listed_at_ms: int | None = None
) -> list[Session]:
    """Sessions from a gateway's /api/connections (rebuild at start); impostors left out.

    A listing that does not say when a connection was made (connection
    tracking's) dates it at the listing: it was live then, so it wins over a
    saved session of the same device on another connection.
    """
    at = int(time.time() * 1000) if listed_at_ms is None else listed_at_ms
    return [
        Session(conn.client_id, region, conn.node, conn.name, conn.connected_at or at)
        for conn in mqtt_plugin.mqtt_connections(connections)
        if not impersonation(conn.client_id, conn.user)
    ]
