"""Held commands ask again: the subscriptions of a connected session the router has not seen.

A command for a connected device whose subscription the router has not seen is held
(router/routing.py) until a binding event shows the subscription.  Those events are at most
once: the gateway's event exchange publishes them without confirms, and one published while
the gateway node leading the presence link's queue dies is gone (docs/reliability.md: one
node of every engine killed at once held a moved device's commands until they expired).  So
while commands are held for a connected session, the leader asks its gateway again, every
REASK_EVERY_S per connection, at most REASK_PER_ROUND sessions a round (each ask is two
management calls).  A round runs every REASK_ROUND_S, so that a held command waits about
REASK_EVERY_S after the first ask, not up to twice that.
"""

from __future__ import annotations

from collections.abc import Callable

from router.parking import ParkingLot
from router.presence import PresenceTable, Session
from router.subscriptions import Subscriptions

#: How often one connection's gateway is asked again while commands are held for it.
REASK_EVERY_S = 10.0
#: How often the leader looks for held sessions due an ask (a walk of the parked devices).
REASK_ROUND_S = 2.0
#: Sessions asked in one round at most: a fleet holding commands for devices that never
#: subscribe must not turn into a storm of management calls.
REASK_PER_ROUND = 20


def held_sessions(
    parking: ParkingLot, presence: PresenceTable, subscriptions: Subscriptions
) -> list[Session]:
    """The connected sessions with parked commands whose subscriptions the router saw none of."""
    held = []
    for device in parking.all_devices():
        session = presence.get(device)
        if session is not None and subscriptions.filters(session.connection) == []:
            held.append(session)
    return held


def reask_round(
    parking: ParkingLot, presence: PresenceTable, subscriptions: Subscriptions, ask: Callable[[Session], bool]
) -> int:
    """`ask` (which says whether it asked: once per REASK_EVERY_S per connection) about the
    sessions held_sessions names, REASK_PER_ROUND at most; how many were asked."""
    asked = 0
    for session in held_sessions(parking, presence, subscriptions):
        if ask(session):
            asked += 1
            if asked >= REASK_PER_ROUND:
                break
    return asked
