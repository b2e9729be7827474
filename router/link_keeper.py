"""Federation links RabbitMQ lost, started again by the leading router.

Why it exists: RabbitMQ 4.0 keeps each federated exchange's links under a
*mirrored supervisor*: one node runs them, every node holds a record of
them, and when that node dies another takes them over from the record.
Debian 13's 4.0.5 can lose the records: a node whose supervisor starts
before it has seen its peers' (a restart on a busy machine) deletes every
record of the group, cluster-wide -- RabbitMQ fixed that in 2026
(rabbitmq-server 0adbd040be, "only delete all child records on a genuine
single-node start", 4.2/4.3).  The links go on running where they ran until
that node dies; then no node takes them over, nor starts them when it comes
back, and the uplink and presence of every region stop (nothing is lost:
readings wait in the gateways' link queues, but nothing moves).  What
RabbitMQ's maintainers advise an operator to do then (rabbitmq-server#3148,
#11492) is what this does: apply the exchange's policy anew (delete it, put
it back), which starts its links on a running node.

The leader alone does it (two routers re-applying one policy at once would
restart the links twice).  Every CHECK_EVERY_S it asks each cluster -- the
backend, each region's gateways -- for its links, and looks for the ones the
federation wiring makes there: on the backend the uplink and presence links
of every region, on a region's gateways the downlink link.  A link absent
for `link_repair_after_s` while its cluster answers gets its policy
re-applied.  Absent is what the lost records leave; a link that is listed
but not running (its other side down) is RabbitMQ's own to retry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from backend import contract as c
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from gateways.wiring import DOWNLINK_UPSTREAM
from router.lifecycle import cancel_task
from router.metrics import Metrics
from router.tasks import every, spawn

log = logging.getLogger(__name__)

#: How often the leader looks at every cluster's links.
CHECK_EVERY_S = 5.0
#: The policy fields a PUT takes back.
_POLICY_FIELDS = ("pattern", "definition", "priority", "apply-to")
_VHOST = quote("/", safe="")
#: The clusters' names, as `fedgate status` gives them.
BACKEND = "backend"


def gateways_cluster(region: str) -> str:
    return f"gateways {region}"


@dataclass(frozen=True)
class Link:
    """A link the wiring makes: on `cluster`, `exchange` federated from `upstream`."""

    cluster: str
    exchange: str
    upstream: str


def expected_links(regions: list[str]) -> list[Link]:
    """The links the federation wiring makes for these regions (backend/wiring.py,
    gateways/wiring.py), on the backend and on each region's gateway cluster."""
    out = []
    for region in regions:
        upstream = c.gateway_upstream_name(region)
        out.append(Link(BACKEND, c.TELEMETRY_EXCHANGE, upstream))
        out.append(Link(BACKEND, c.PRESENCE_EXCHANGE, upstream))
        out.append(Link(gateways_cluster(region), c.GATEWAY_DOWNLINK_EXCHANGE, DOWNLINK_UPSTREAM))
    return out


def absent(links: list[Link], listed: list[dict[str, Any]]) -> list[Link]:
    """Those of `links` (one cluster's) that `listed` (its /api/federation-links) lacks,
    whatever a listed one's status."""
    present = {(lk.get("exchange"), lk.get("upstream")) for lk in listed}
    return [lk for lk in links if (lk.exchange, lk.upstream) not in present]


class LinkKeeper:
    """The leader's watch over the federation links (see the module docstring)."""

    def __init__(
        self,
        backend: RabbitAdmin | None,
        gateways: Callable[[], Mapping[str, RabbitAdmin]],
        repair_after_s: float,
        metrics: Metrics,
        check_every_s: float = CHECK_EVERY_S,
    ):
        #: the backend's management client (None: the router has none, its links unwatched)
        self.backend = backend
        #: region -> its gateways' client, asked each round: a reload adds or removes regions
        self.gateways = gateways
        self.repair_after_s = repair_after_s
        self.check_every_s = check_every_s
        self.metrics = metrics
        #: link -> when it was first seen absent (monotonic), while its cluster answers
        self._absent_since: dict[Link, float] = {}
        #: (cluster, policy) deleted whose PUT back failed: put back first, every round
        self._to_put_back: dict[tuple[str, str], dict[str, Any]] = {}
        self._task: asyncio.Task[None] | None = None
        metrics.gauge(
            "fedgate_router_federation_links_absent",
            lambda: {(("cluster", k),): float(v) for k, v in self._absent_counts().items()},
        )

    def _absent_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lk in self._absent_since:
            out[lk.cluster] = out.get(lk.cluster, 0) + 1
        return out

    def lead(self) -> None:
        if self.repair_after_s > 0 and self._task is None:
            self._task = spawn(self._run(), "link-keeper", "link-keeper failed: %r", logger=log)

    async def stand_by(self) -> None:
        task, self._task = self._task, None
        await cancel_task(task)
        self._absent_since.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # a bug here must not end the watch
        await every(
            self.check_every_s,
            lambda: loop.run_in_executor(None, self.check),
            "federation link check failed",
            logger=log,
            traceback=True,
        )

    def check(self, now: float | None = None) -> list[tuple[str, str]]:
        """One round (blocking: the management calls).  Returns the (cluster, policy) pairs
        re-applied."""
        now = time.monotonic() if now is None else now
        regions = dict(self.gateways())
        clients = {gateways_cluster(r): admin for r, admin in regions.items()}
        if self.backend is not None:
            clients[BACKEND] = self.backend
        for (cluster, policy), body in list(self._to_put_back.items()):
            if cluster in clients and self._put_policy(clients[cluster], cluster, policy, body):
                del self._to_put_back[(cluster, policy)]
        wanted: dict[str, list[Link]] = {}
        for lk in expected_links(list(regions)):
            if lk.cluster in clients:
                wanted.setdefault(lk.cluster, []).append(lk)
        seen: set[Link] = set()
        repaired: list[tuple[str, str]] = []
        for cluster, links in wanted.items():
            try:
                missing = absent(links, clients[cluster].federation_links())
            except AdminError:
                continue  # the cluster does not answer: nothing to tell, the timers forgotten
            for lk in missing:
                seen.add(lk)
                since = self._absent_since.setdefault(lk, now)
                if now - since < self.repair_after_s:
                    continue
                applied = self._repair(clients[cluster], lk, now - since)
                if applied is not None:
                    repaired.append((cluster, applied))
                    # the exchange's other links are started by the same re-application
                    for other in missing:
                        if other.exchange == lk.exchange:
                            self._absent_since[other] = now
        self._absent_since = {lk: t for lk, t in self._absent_since.items() if lk in seen}
        return repaired

    def _repair(self, admin: RabbitAdmin, lk: Link, for_s: float) -> str | None:
        """Apply anew the policy that federates `lk.exchange`; the policy's name, or None."""
        try:
            policy = admin.get(f"exchanges/{_VHOST}/{quote(lk.exchange, safe='')}").get("policy")
            if not policy:
                log.error(
                    "federation link %s <- %s on %s is absent and no policy federates the exchange",
                    lk.exchange,
                    lk.upstream,
                    lk.cluster,
                )
                return None
            body = {
                k: v
                for k, v in admin.get(f"policies/{_VHOST}/{quote(policy, safe='')}").items()
                if k in _POLICY_FIELDS
            }
        except AdminError as e:
            log.warning(
                "federation link %s <- %s on %s: cannot read its policy (%s)",
                lk.exchange,
                lk.upstream,
                lk.cluster,
                e,
            )
            return None
        log.warning(
            "federation link %s <- %s on %s absent for %.0f s: applying policy %s anew "
            "(RabbitMQ lost the link's record when a node restarted; docs/operations.md)",
            lk.exchange,
            lk.upstream,
            lk.cluster,
            for_s,
            policy,
        )
        try:
            admin.delete(f"policies/{_VHOST}/{quote(policy, safe='')}")
        except AdminError as e:
            log.warning("federation link repair on %s: deleting policy %s failed (%s)", lk.cluster, policy, e)
            return None
        self._to_put_back[(lk.cluster, policy)] = body
        if self._put_policy(admin, lk.cluster, policy, body):
            del self._to_put_back[(lk.cluster, policy)]
        self.metrics.inc("fedgate_router_federation_link_repairs_total", cluster=lk.cluster)
        return policy

    def _put_policy(self, admin: RabbitAdmin, cluster: str, policy: str, body: dict[str, Any]) -> bool:
        try:
            admin.request("PUT", f"policies/{_VHOST}/{quote(policy, safe='')}", body)
            return True
        except AdminError as e:
            log.error(
                "federation link repair on %s: policy %s deleted, putting it back failed (%s); "
                "trying again in %.0f s",
                cluster,
                policy,
                e,
                self.check_every_s,
            )
            return False
