"""The router's view of the regions registered in the backend (router/region_watch.py).

Against a stand-in for the management API's answers: what is under test is what the
router makes of them.  tests/integration/test_regions.py tries the same against the
federation's backend."""

from __future__ import annotations

import asyncio

import pytest

from backend.rabbitmq_admin import AdminError
from router.access import GatewayAccess, RouterSettingsError, parse_gateways
from router.metrics import Metrics
from router.region_watch import RegionWatch, merged


class Answers:
    """What GET global-parameters answers, or raises."""

    def __init__(self, parameters: list[dict] | AdminError):
        self.parameters = parameters

    def get(self, path: str):
        assert path == "global-parameters"
        if isinstance(self.parameters, AdminError):
            raise self.parameters
        return self.parameters


def entry(region: str, value: object) -> dict:
    return {"name": f"fedgate-region.{region}", "value": value}


def gw(region: str, url: str = "http://a:15672") -> GatewayAccess:
    return GatewayAccess(region, (url,), "u", "p")


def watch(answers: Answers, seen: list) -> RegionWatch:
    """A watch whose changes are recorded in `seen` (the regions it read, at each)."""
    w = RegionWatch(answers, 5.0, lambda: seen.append(w.registered), Metrics())  # type: ignore[arg-type]
    return w


def test_registered_regions_are_read_and_malformed_or_foreign_entries_skipped(caplog):
    answers = Answers(
        [
            entry(
                "eu-west-1",
                {"management_url": ["http://a:15672", "http://b:15672"], "user": "u", "password": "p"},
            ),
            entry("us-east-1", {"management_url": 42}),  # malformed: skipped, said once
            entry("Bad_Name", {"management_url": "http://c:15672"}),  # not a region name
            {"name": "cluster_name", "value": "rabbit@x"},  # RabbitMQ's own
        ]
    )
    w = watch(answers, [])
    for _ in range(2):
        got = w.read()
        assert [g.region for g in got] == ["eu-west-1"]
        assert got[0].management_urls == ("http://a:15672", "http://b:15672")
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2, "each malformed entry is logged once, not at every poll"


def test_a_change_is_handed_on_and_an_unreadable_registry_keeps_the_regions_known():
    seen: list = []
    answers = Answers(
        [entry("eu-west-1", {"management_url": "http://a:15672", "user": "u", "password": "p"})]
    )
    w = watch(answers, seen)
    asyncio.run(w.poll())
    asyncio.run(w.poll())
    assert [[g.region for g in s] for s in seen] == [["eu-west-1"]], "handed on once, when it changed"
    answers.parameters = AdminError("GET global-parameters: connection refused", retriable=True)
    asyncio.run(w.poll())
    assert w.registered is not None and [g.region for g in w.registered] == ["eu-west-1"]
    assert len(seen) == 1, "a management API down is not a region gone"
    answers.parameters = []
    asyncio.run(w.poll())
    assert seen[-1] == (), "deregistered: gone"


def test_the_configs_regions_keep_their_access_and_the_registry_adds_the_others():
    configured = (gw("local-eu", "http://config:1"),)
    registered = (gw("local-eu", "http://registry:1"), gw("local-us"))
    assert merged(configured, registered) == (gw("local-eu", "http://config:1"), gw("local-us"))


def test_a_gateways_table_with_a_bad_region_name_or_url_is_refused_by_name():
    with pytest.raises(RouterSettingsError, match="gateways: invalid region name"):
        parse_gateways({"EU": {"management_url": "http://a:1"}})
    with pytest.raises(RouterSettingsError, match="gateways: each needs management_url"):
        parse_gateways({"local-eu": {"user": "u"}})
