"""The leader's watch over the federation links (router/link_keeper.py), against a fake
management API; the real fault (RabbitMQ 4.0 losing a link's record) is in
tests/ha/test_ha_node_loss.py."""

from __future__ import annotations

from typing import Any

from backend import contract as c
from backend.rabbitmq_admin import AdminError
from gateways.wiring import DOWNLINK_UPSTREAM
from router.link_keeper import BACKEND, LinkKeeper, absent, expected_links, gateways_cluster
from router.metrics import Metrics

UPLINK = {"pattern": "^fedgate\\.telemetry$", "definition": {"federation-upstream-set": "up"}, "priority": 0}


class FakeCluster:
    """A cluster's management API: its links, its exchanges' policies, the policies."""

    def __init__(self, links: list[tuple[str, str]], policies: dict[str, tuple[str, dict[str, Any]]]):
        self.links = [{"exchange": x, "upstream": u, "status": "running"} for x, u in links]
        #: exchange -> (policy name, body)
        self.policies = dict(policies)
        self.calls: list[tuple[str, str]] = []
        self.answers = True
        self.refuse_put = False

    def federation_links(self) -> list[dict[str, Any]]:
        if not self.answers:
            raise AdminError("GET federation-links: refused", retriable=True)
        return self.links

    def get(self, path: str) -> Any:
        kind, _, name = path.split("/", 2)
        if kind == "exchanges":
            hit = self.policies.get(name)
            return {"name": name, "policy": hit[0] if hit else None}
        (body,) = [b for p, b in self.policies.values() if p == name]
        return {"name": name, "vhost": "/", "apply-to": "exchanges", **body}

    def delete(self, path: str) -> bool:
        self.calls.append(("DELETE", path))
        return True

    def request(self, method: str, path: str, body: Any = None) -> Any:
        self.calls.append((method, path))
        if self.refuse_put:
            raise AdminError("PUT: refused", retriable=True)
        self.put_body = body
        return None


def keeper(backend: FakeCluster, gateways: dict[str, FakeCluster] | None = None) -> LinkKeeper:
    """A keeper of the backend and region local-eu's gateways (their downlink link there)."""
    if gateways is None:
        gateways = {"local-eu": FakeCluster([(c.GATEWAY_DOWNLINK_EXCHANGE, DOWNLINK_UPSTREAM)], {})}
    return LinkKeeper(backend, lambda: gateways, 20.0, Metrics())  # type: ignore[arg-type]


def test_the_wiring_makes_three_links_per_region_two_on_the_backend_one_on_its_gateways():
    links = expected_links(["local-eu"])
    assert {(lk.cluster, lk.exchange, lk.upstream) for lk in links} == {
        (BACKEND, c.TELEMETRY_EXCHANGE, "gw-local-eu"),
        (BACKEND, c.PRESENCE_EXCHANGE, "gw-local-eu"),
        (gateways_cluster("local-eu"), c.GATEWAY_DOWNLINK_EXCHANGE, DOWNLINK_UPSTREAM),
    }


def test_a_listed_link_is_present_whatever_its_status():
    links = [lk for lk in expected_links(["local-eu"]) if lk.cluster == BACKEND]
    listed = [{"exchange": c.TELEMETRY_EXCHANGE, "upstream": "gw-local-eu", "status": "starting"}]
    assert [lk.exchange for lk in absent(links, listed)] == [c.PRESENCE_EXCHANGE]


def test_a_link_absent_past_the_grace_gets_its_policy_deleted_and_put_back_unchanged():
    backend = FakeCluster(
        [(c.PRESENCE_EXCHANGE, "gw-local-eu")], {c.TELEMETRY_EXCHANGE: ("fedgate-uplink", UPLINK)}
    )
    gw = FakeCluster([(c.GATEWAY_DOWNLINK_EXCHANGE, DOWNLINK_UPSTREAM)], {})
    k = keeper(backend, {"local-eu": gw})
    assert k.check(now=100.0) == []  # first seen absent
    assert k.check(now=119.0) == [] and backend.calls == []  # inside the grace: RabbitMQ may still move it
    assert k.check(now=120.5) == [(BACKEND, "fedgate-uplink")]
    assert backend.calls == [
        ("DELETE", "policies/%2F/fedgate-uplink"),
        ("PUT", "policies/%2F/fedgate-uplink"),
    ]
    assert backend.put_body == {**UPLINK, "apply-to": "exchanges"}
    assert k.metrics.get("fedgate_router_federation_link_repairs_total", cluster=BACKEND) == 1
    assert gw.calls == [], "a cluster whose links are all there is left alone"
    # still absent right after: a new grace, not a repair every round
    assert k.check(now=125.0) == []


def test_a_link_back_within_the_grace_is_forgotten():
    backend = FakeCluster([(c.PRESENCE_EXCHANGE, "gw-local-eu")], {c.TELEMETRY_EXCHANGE: ("p", UPLINK)})
    k = keeper(backend)
    k.check(now=100.0)
    backend.links.append({"exchange": c.TELEMETRY_EXCHANGE, "upstream": "gw-local-eu", "status": "running"})
    k.check(now=110.0)
    backend.links.pop()
    assert k.check(now=125.0) == [], "its grace starts again when it goes again"
    assert k.check(now=144.0) == []
    assert k.check(now=146.0) == [(BACKEND, "p")]


def test_a_cluster_that_does_not_answer_is_not_repaired_and_gets_a_new_grace_when_back():
    backend = FakeCluster([], {c.TELEMETRY_EXCHANGE: ("p", UPLINK), c.PRESENCE_EXCHANGE: ("q", UPLINK)})
    k = keeper(backend)
    k.check(now=100.0)
    backend.answers = False
    assert k.check(now=130.0) == []
    backend.answers = True
    assert k.check(now=131.0) == [] and backend.calls == []


def test_a_policy_deleted_whose_put_back_failed_is_put_back_first_next_round():
    backend = FakeCluster([(c.PRESENCE_EXCHANGE, "gw-local-eu")], {c.TELEMETRY_EXCHANGE: ("p", UPLINK)})
    k = keeper(backend)
    k.check(now=100.0)
    backend.refuse_put = True
    k.check(now=121.0)
    backend.refuse_put = False
    backend.calls.clear()
    k.check(now=122.0)
    assert backend.calls[0] == ("PUT", "policies/%2F/p"), (
        "the deleted policy is put back before anything else"
    )


def test_a_region_removed_by_a_reload_is_no_longer_watched():
    gateways = {"local-eu": FakeCluster([], {}), "local-us": FakeCluster([], {})}
    backend = FakeCluster([], {})
    k = LinkKeeper(backend, lambda: gateways, 20.0, Metrics())  # type: ignore[arg-type]
    k.check(now=100.0)
    del gateways["local-us"]
    k.check(now=101.0)
    assert {lk.cluster for lk in k._absent_since} == {BACKEND, gateways_cluster("local-eu")}
    assert all(lk.upstream != "gw-local-us" for lk in k._absent_since)
