"""Held commands ask the gateway again (router/reask.py): a binding event lost with a gateway
node must not hold a connected device's commands until they expire."""

from __future__ import annotations

import asyncio

from router.parking import ParkingLot
from router.presence import PresenceTable, Session
from router.reask import REASK_EVERY_S, REASK_PER_ROUND, held_sessions, reask_round
from router.routing import Command
from router.subscriptions import Subscriptions
from tests.unit.router.test_waiting import _table


def _setup(devices: int) -> tuple[ParkingLot, PresenceTable, Subscriptions, list[Session]]:
    parking, presence, subs = ParkingLot(_table("parked"), ttl_s=60), PresenceTable(), Subscriptions()
    sessions = [Session(f"d{i}", "local-eu", "n2", f"conn-{i}", 1) for i in range(devices)]
    for s in sessions:
        presence.connected(s)
        subs.opened(s.connection)  # seen opening; its subscription's event never came
    return parking, presence, subs, sessions


def test_a_connected_session_with_parked_commands_and_no_subscription_seen_is_held():
    parking, presence, subs, (held, subscribed, idle) = _setup(3)

    async def scenario():
        for s in (held, subscribed):
            await parking.park_command(Command(s.client_id, f"devices/{s.client_id}/commands/x"), b"1")
        await parking.park_command(Command("away", "devices/away/commands/x"), b"1")  # no session

    asyncio.run(scenario())
    subs.add(subscribed.connection, ["devices/d1/commands/#"])
    assert held_sessions(parking, presence, subs) == [held], "only the one whose subscription is unknown"


def test_a_round_asks_a_rounds_worth_and_the_next_the_rest():
    parking, presence, subs, sessions = _setup(REASK_PER_ROUND + 5)
    asked: list[str] = []

    def ask(session: Session) -> bool:
        # the clock stands still: each connection is due once
        if not subs.ask_due(session.connection, REASK_EVERY_S, now=0.0):
            return False
        asked.append(session.client_id)
        return True

    async def park_all():
        for s in sessions:
            await parking.park_command(Command(s.client_id, f"devices/{s.client_id}/commands/x"), b"1")

    asyncio.run(park_all())
    assert reask_round(parking, presence, subs, ask) == REASK_PER_ROUND, "a round's worth at most"
    assert reask_round(parking, presence, subs, ask) == 5, "the next round asks the rest"
    assert reask_round(parking, presence, subs, ask) == 0, "none is due again within REASK_EVERY_S"
    assert sorted(asked) == sorted(s.client_id for s in sessions)
