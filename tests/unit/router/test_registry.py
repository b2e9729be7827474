"""Which device ids exist (router/registry.py): asked of the gateways, once per id at a time,
remembered; a gateway that does not answer never makes a registered device look unknown."""

from __future__ import annotations

import asyncio

from backend.rabbitmq_admin import AdminError
from router.gateways import Gateways
from router.registry import Registry


class _Admin:
    """A gateway's management API: its users, or silence."""

    def __init__(self, users: set[str] | None):
        self.users = users
        self.asked: list[str] = []

    def request_with_headers(self, method: str, path: str, headers: dict, body: object = None, **kw: object):
        self.asked.append(path)
        if self.users is None:
            raise AdminError(f"{method} {path}: connection refused", retriable=True)
        if path.removeprefix("users/") not in self.users:
            raise AdminError(f"{method} {path}: HTTP 404", status=404)
        return {"name": path.removeprefix("users/")}


def _registry(**regions: set[str] | None) -> tuple[Registry, dict[str, _Admin]]:
    admins = {region: _Admin(users) for region, users in regions.items()}
    return Registry(Gateways(admins)), admins  # type: ignore[arg-type]


def test_a_registered_device_is_found_and_remembered():
    registry, admins = _registry(eu={"pump-1"}, us={"pump-1"})
    assert asyncio.run(registry.look_up("pump-1")) is True
    assert asyncio.run(registry.look_up("pump-1")) is True
    assert registry.says("pump-1") is True
    assert sum(len(a.asked) for a in admins.values()) == 1, "asked once, of one gateway"


def test_an_id_no_gateway_knows_is_not_registered_for_a_while():
    registry, admins = _registry(eu=set(), us=set())
    assert asyncio.run(registry.look_up("typo-1")) is False
    assert asyncio.run(registry.look_up("typo-1")) is False
    assert len(admins["eu"].asked) == 1, "remembered, not asked again at once"


def test_a_gateway_that_does_not_answer_leaves_it_to_the_others_or_unsaid():
    registry, _ = _registry(eu=None, us={"pump-1"})
    assert asyncio.run(registry.look_up("pump-1")) is True
    silent, _ = _registry(eu=None, us=None)
    assert asyncio.run(silent.look_up("pump-1")) is None, "the registry cannot say: the setting decides"
    assert silent.says("pump-1") is None


def test_many_commands_for_one_new_id_ask_once():
    registry, admins = _registry(eu={"pump-1"})

    async def together() -> list[bool | None]:
        return await asyncio.gather(*(registry.look_up("pump-1") for _ in range(50)))

    assert asyncio.run(together()) == [True] * 50
    assert len(admins["eu"].asked) == 1


def test_fedgate_own_users_are_no_devices():
    registry, admins = _registry(eu={"fedgate-admin"})
    assert asyncio.run(registry.look_up("fedgate-admin")) is False
    assert admins["eu"].asked == []
