"""The management API client against a local HTTP stand-in: what it sends, in how many requests."""

from __future__ import annotations

from backend.devices import device_users, password_hash
from backend.rabbitmq_admin import RabbitAdmin
from tests.unit.cloud.fakes import fake_management_api


def test_a_large_fleet_is_imported_a_few_hundred_users_per_request_with_their_permissions():
    hashes = {f"pump-{i:04d}": password_hash("s") for i in range(1200)}
    with fake_management_api() as api:
        RabbitAdmin(api.url, "fedgate-admin", "pw").import_users(device_users(hashes))
        bodies = [b for m, p, b in api.requests if m == "POST" and p == "/api/definitions"]
    assert [len(b["users"]) for b in bodies] == [500, 500, 200]
    for b in bodies:
        names = {u["name"] for u in b["users"]}
        assert {p["user"] for p in b["permissions"]} == names
        assert {p["user"] for p in b["topic_permissions"]} == names
    assert sorted(u["name"] for b in bodies for u in b["users"]) == sorted(hashes)
