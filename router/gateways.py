"""What the router asks the gateways directly, through their management APIs.

Presence comes from the gateways' events; what the events cannot
tell, the router asks a region's gateway itself:

- which MQTT connections it holds (the presence rebuild at start, and the
  periodic reconcile);
- whether a device id is registered (router/registry.py);
- whether it answers at all (a command came back from it: dead or slow?);
- which subscriptions a persistent session kept across connections;

and it closes the older of two sessions of one client id there.

Reading needs a user tagged `monitoring` (what the cloud gives the routers:
gateways/wiring.py).  Looking a user up and closing a connection need
`administrator`; a gateway that refuses them (HTTP 401/403) is not asked
for them again until the regions change: the registry cannot say (the
router's `unknown_device` setting decides), and an older session is left
to end by its keepalive.  Each refusal is logged once and counted.

The management clients (backend.rabbitmq_admin.RabbitAdmin) are passed in
(`Gateways(clients)`), so tests give fakes with the same methods;
`Gateways.clients_from_settings` builds the real ones.  The clients block
(urllib), so every call runs in the default executor, off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from backend.rabbitmq_admin import AdminError, RabbitAdmin
from gateways import mqtt_plugin
from router.metrics import Metrics
from router.presence import PresenceTable, Session
from router.settings import RouterSettings

log = logging.getLogger(__name__)

#: A clean session's queue (exclusive, by client id) this long after its connection opened is
#: that connection's: MQTT allows one connection per client id, and the one before took its
#: exclusive queue with it when it closed.  RabbitMQ's management API names no owner for an
#: MQTT connection's queues (owner_pid_details is null), so age is what tells.
CLEAN_QUEUE_OWNED_AFTER_S = 5.0

#: A returned command asks whether its gateway answers; the answer holds this long.
GATEWAY_CHECK_EVERY_S = 5.0
GATEWAY_CHECK_TIMEOUT_S = 3.0
#: How long the router keeps trying to close an older session its gateway does not list yet.
CLOSE_PATIENCE_S = 30.0
#: The calls a monitoring user is refused: what they are, and what the router does without them.
REFUSED_CALLS = {
    "users": ("user lookups", "the registry cannot say there, unknown_device decides"),
    "close": ("closing connections", "an older session there ends by its keepalive"),
    "nodes": ("listing its nodes", "the sessions of a node that died end at the next connection list"),
}


class Gateways:
    """The router's view of each region's gateway management API."""

    def __init__(self, clients: Mapping[str, RabbitAdmin], metrics: Metrics | None = None):
        self.clients = dict(clients)
        self.metrics = metrics or Metrics()
        #: region -> (monotonic time, whether its gateway answered then)
        self._answers: dict[str, tuple[float, bool]] = {}
        self._closers: set[asyncio.Task[None]] = set()
        #: regions whose gateway did not answer when last asked: their sessions are kept (a
        #: partition heals), and their connection lists asked again soon (the downlink's reconcile)
        self.suspect: set[str] = set()
        #: region -> what its gateway refused this router's user ("users", "close")
        self.forbidden: dict[str, set[str]] = {}
        self.metrics.gauge(
            "fedgate_router_region_suspect",
            lambda: {(("region", r),): float(r in self.suspect) for r in self.clients},
        )

    @staticmethod
    def clients_from_settings(settings: RouterSettings) -> dict[str, RabbitAdmin]:
        return {g.region: g.admin() for g in settings.gateways}

    def set_clients(self, clients: Mapping[str, RabbitAdmin]) -> None:
        """A region was added or removed."""
        self.clients = dict(clients)
        self._answers = {r: a for r, a in self._answers.items() if r in self.clients}
        self.suspect &= set(self.clients)
        # the new clients may hold other credentials (a region registered anew): ask again
        self.forbidden = {}

    def allows(self, region: str, what: str) -> bool:
        """Whether the router's user may do `what` ("users", "close") at the region's gateway,
        as far as it knows (it was not refused)."""
        return what not in self.forbidden.get(region, ())

    def _refused(self, region: str, what: str, e: AdminError) -> bool:
        """Whether `e` is the gateway refusing the router's user `what`; remembered, logged once."""
        if e.status not in (401, 403):
            return False
        if self.allows(region, what):
            self.forbidden.setdefault(region, set()).add(what)
            self.metrics.inc("fedgate_router_gateway_refusals_total", region=region, call=what)
            log.warning(
                "gateway of %s refuses this router's user %s (it needs the administrator tag): %s; %s",
                region,
                REFUSED_CALLS[what][0],
                e,
                REFUSED_CALLS[what][1],
            )
        return True

    @property
    def regions(self) -> list[str]:
        return list(self.clients)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def connections(self, region: str) -> list[dict[str, Any]]:
        """The region's connections (AdminError when it does not answer)."""
        listed = await self._call(self.clients[region].connections)
        self._answered(region, True)
        return listed  # type: ignore[no-any-return]

    async def nodes(self, region: str) -> dict[str, bool]:
        """The region's cluster nodes, name -> whether it runs (AdminError when it does not
        answer; nothing when it refuses this router's user)."""
        try:
            listed = await self._call(self.clients[region].get, "nodes?columns=name,running")
        except AdminError as e:
            if self._refused(region, "nodes", e):
                return {}
            raise
        return {str(n["name"]): bool(n.get("running")) for n in listed}

    async def answers(self, region: str) -> bool:
        """Whether the region's management API answers, asked at most every few seconds:
        a dead gateway sends back every command it was sent, and each would
        otherwise wait out the timeout while routing holds the lock."""
        now = time.monotonic()
        cached = self._answers.get(region)
        if cached is not None and now - cached[0] < GATEWAY_CHECK_EVERY_S:
            return cached[1]
        client = self.clients.get(region)
        answers = False
        if client is not None:
            # a short timeout and no retries: a gateway that does not answer at once counts as down
            try:
                await self._call(
                    client.request_with_headers, "GET", "overview", {}, timeout=GATEWAY_CHECK_TIMEOUT_S
                )
                answers = True
            except AdminError:
                pass
        self._answers[region] = (now, answers)
        self._answered(region, answers)
        return answers

    def _answered(self, region: str, answers: bool) -> None:
        if answers and region in self.suspect:
            log.warning("gateway of %s answers again: its connections are reconciled", region)
            self.suspect.discard(region)
        elif not answers and region not in self.suspect:
            log.warning("gateway of %s does not answer: suspect until it does", region)
            self.suspect.add(region)

    async def has_user(self, region: str, name: str, *, timeout: float) -> bool:
        """Whether the region's gateway has the user `name` (a device of the registry);
        AdminError when it does not answer."""
        try:
            await self._call(
                self.clients[region].request_with_headers,
                "GET",
                f"users/{quote(name, safe='')}",
                {},
                timeout=timeout,
            )
        except AdminError as e:
            if e.status == 404:
                return False
            self._refused(region, "users", e)
            raise
        return True

    async def kept_filters(self, session: Session, now: float | None = None) -> list[str] | None:
        """The subscriptions the gateway holds for the session: a persistent session's kept
        across connections; a clean session's once the session is CLEAN_QUEUE_OWNED_AFTER_S
        old (its queue is then this connection's, not the previous one's on its way out).
        None when the gateway could not be asked."""
        age_s = (time.time() if now is None else now) - session.connected_at / 1000
        own_clean_queue = age_s >= CLEAN_QUEUE_OWNED_AFTER_S
        client = self.clients.get(session.region)
        if client is None:
            return None
        filters: list[str] = []
        for qos in (0, 1):
            queue = quote(mqtt_plugin.subscription_queue(session.client_id, qos), safe="")
            try:
                info = await self._call(client.get, f"queues/%2F/{queue}")
                if mqtt_plugin.is_clean_session_queue(info) and not own_clean_queue:
                    # a clean session's queue: it may still be the previous connection's, on its
                    # way out; this connection's own subscriptions arrive as binding events
                    continue
                bindings = await self._call(client.get, f"queues/%2F/{queue}/bindings")
            except AdminError as e:
                if e.status == 404:
                    continue  # no such queue: a clean session subscribes after connecting
                log.warning("subscriptions of %s on %s: %s", session.client_id, session.region, e)
                return None
            filters += mqtt_plugin.filters_of_bindings(bindings)
        return filters

    async def subscribed(self, region: str) -> dict[str, dict[str, int]] | None:
        """What every MQTT session of the region subscribes to now, from one listing of the
        bindings of its gateways' `amq.topic`: client id -> {filter: QoS}; None when the
        gateway could not be asked."""
        client = self.clients.get(region)
        if client is None:
            return None
        try:
            bindings = await self._call(client.get, "exchanges/%2F/amq.topic/bindings/source")
        except AdminError as e:
            log.warning("subscriptions at %s: %s", region, e)
            return None
        return mqtt_plugin.subscriptions_of_bindings(bindings)

    # --- one live session per client id -------------------------------------------------

    def close_soon(self, older: Session, presence: PresenceTable) -> None:
        """Close the older session of a client id at its gateway, in the background.

        A gateway that collects statistics (3.10) lists a new connection only
        with its next statistics round (~5 s), so the close is retried until the
        connection is known there or has gone by itself.
        """
        task = asyncio.create_task(self._close_when_known(older, presence))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    def in_background(self, coro: Any) -> None:
        """Run a coroutine that must not hold up routing; cancelled by stop()."""
        task = asyncio.ensure_future(coro)
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _close_when_known(self, s: Session, presence: PresenceTable) -> None:
        client = self.clients.get(s.region)
        if client is None or not self.allows(s.region, "close"):
            return
        path = f"connections/{quote(s.connection, safe='')}"
        deadline = time.monotonic() + CLOSE_PATIENCE_S
        while True:
            if presence.get(s.client_id) == s:
                return  # it became the current session again (a newer connect was undone)
            try:
                await self._call(client.request, "DELETE", path)
            except AdminError as e:
                if e.status == 404 and time.monotonic() < deadline:
                    await asyncio.sleep(1.0)
                    continue
                if e.status != 404 and not self._refused(s.region, "close", e):
                    log.error("could not close the older session of %s at %s: %s", s.client_id, s.region, e)
                return
            self.metrics.inc("fedgate_router_sessions_closed_total", region=s.region)
            log.info("closed the older session of %s at %s (%s)", s.client_id, s.region, s.connection)
            return

    def stop(self) -> None:
        for task in list(self._closers):
            task.cancel()
