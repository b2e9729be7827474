"""A small client for RabbitMQ's management HTTP API, and the definitions applier.

Used by the local driver and the cloud driver to make a node hold the
objects the federation wiring describes (backend/definitions.py), and by the
router to ask the gateways about connections and subscriptions: it lives in
backend/ so that the router never imports the deployment tool (infra/).  Every call
is an idempotent PUT/POST, so applying the same definitions twice changes
nothing; a failed call raises AdminError naming the object.

Over HTTPS (a cloud node's management API: gateways/templates/tls.conf) the
client checks the node's certificate against the nodes' CA (`ca_file`, or the
PEM itself in `ca_pem`, as the backend's region registry carries it) and for
`server_name`: the name the node certificates carry, not the load balancer's
address the URL dials.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any
from urllib.parse import quote

from prometheus_client.parser import text_string_to_metric_families

from backend.definitions import (
    Binding,
    Exchange,
    NodeDefinitions,
    Parameter,
    Permission,
    Policy,
    Queue,
    TopicPermission,
    User,
)
from backend.errors import FedgateError
from backend.management_tls import tls_opener

log = logging.getLogger(__name__)

VHOST = "/"


class AdminError(FedgateError):
    """A management API call failed. `retriable` is True for connection-level failures."""

    def __init__(self, msg: str, *, retriable: bool = False, status: int | None = None):
        super().__init__(msg, retriable=retriable)
        self.status = status


def _q(name: str) -> str:
    return quote(name, safe="")


# --- one body per object: the management API's PUTs and the definitions file share them ---


#: How fedgate hashes device secrets (backend/devices.py): RabbitMQ's default.
HASHING_ALGORITHM = "rabbit_password_hashing_sha256"


def _user_body(u: User) -> dict[str, Any]:
    if u.password_hash:
        return {
            "password_hash": u.password_hash,
            "hashing_algorithm": HASHING_ALGORITHM,
            "tags": ",".join(u.tags),
        }
    return {"password": u.password, "tags": ",".join(u.tags)}


def _permission_body(p: Permission) -> dict[str, Any]:
    return {"configure": p.configure, "write": p.write, "read": p.read}


def _topic_permission_body(p: TopicPermission) -> dict[str, Any]:
    return {"exchange": p.exchange, "write": p.write, "read": p.read}


def _exchange_body(x: Exchange) -> dict[str, Any]:
    return {
        "type": x.type,
        "durable": x.durable,
        "internal": x.internal,
        "auto_delete": False,
        "arguments": x.arguments,
    }


def _queue_body(q: Queue) -> dict[str, Any]:
    return {"durable": q.durable, "auto_delete": False, "arguments": q.arguments}


def _binding_body(b: Binding) -> dict[str, Any]:
    return {"routing_key": b.routing_key, "arguments": {}}


def _parameter_body(p: Parameter) -> dict[str, Any]:
    return {"value": p.value, "component": p.component, "vhost": VHOST, "name": p.name}


def _policy_body(p: Policy) -> dict[str, Any]:
    return {"pattern": p.pattern, "apply-to": p.apply_to, "definition": p.definition, "priority": p.priority}


def definitions_file(d: NodeDefinitions, rabbit_version: str = "4.0.5") -> dict[str, Any]:
    """`d` in RabbitMQ's definitions-file format, for `load_definitions` at a cloud node's boot."""
    vhost = {"vhost": VHOST}
    return {
        "rabbit_version": rabbit_version,
        "global_parameters": [{"name": "cluster_name", "value": d.cluster_name}],
        "vhosts": [{"name": VHOST}],
        "users": [{"name": u.name, **_user_body(u)} for u in d.users],
        "permissions": [{"user": p.user, **vhost, **_permission_body(p)} for p in d.permissions],
        "topic_permissions": [
            {"user": p.user, **vhost, **_topic_permission_body(p)} for p in d.topic_permissions
        ],
        "exchanges": [{"name": x.name, **vhost, **_exchange_body(x)} for x in d.exchanges],
        "queues": [{"name": q.name, **vhost, **_queue_body(q)} for q in d.queues],
        "bindings": [
            {
                "source": b.source,
                "destination": b.destination,
                "destination_type": b.destination_type,
                **vhost,
                **_binding_body(b),
            }
            for b in d.bindings
        ],
        "parameters": [_parameter_body(p) for p in d.parameters],
        "policies": [{"name": p.name, **vhost, **_policy_body(p)} for p in d.policies],
    }


class RabbitAdmin:
    """The management API of one node, or of a cluster: `base_url` may list every node's, and
    a call that cannot reach one node (refused, timed out) goes to the next, as a client of a
    cluster should.  Whichever node answered is asked first next time."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        user: str,
        password: str,
        timeout: float = 10.0,
        *,
        ca_file: str = "",
        ca_pem: str = "",
        server_name: str = "",
    ):
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("RabbitAdmin: no management URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        # the system's CAs for an https URL without ca_file/ca_pem (an operator's proxy)
        self._opener = (
            tls_opener(ca_file, ca_pem, server_name)
            if ca_file or ca_pem or server_name
            else urllib.request.build_opener()
        )
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self._auth = f"Basic {token}"

    @property
    def base_url(self) -> str:
        """The node asked first (the one that answered last)."""
        return self.base_urls[0]

    #: A 5xx from the management API is retried this often, a second apart: RabbitMQ
    #: 3.10 fails a federation parameter update while one of its links is restarting.
    RETRIES = 3

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        for attempt in range(self.RETRIES + 1):
            try:
                return self.request_with_headers(method, path, {}, body, timeout=timeout)
            except AdminError as e:
                if e.status is None or e.status < 500 or attempt == self.RETRIES:
                    raise
                log.warning("%s %s: %s; retrying", method, path, e)
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def request_with_headers(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Any = None,
        *,
        timeout: float | None = None,
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        unreachable: list[str] = []
        for base in list(self.base_urls):
            req = urllib.request.Request(base + "/api/" + path.lstrip("/"), data=data, method=method)
            req.add_header("Authorization", self._auth)
            for k, v in headers.items():
                req.add_header(k, v)
            if data is not None:
                req.add_header("Content-Type", "application/json")
            try:
                with self._opener.open(req, timeout=timeout or self.timeout) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:300]
                raise AdminError(
                    f"{method} {path}: HTTP {e.code} {detail}", status=e.code, retriable=e.code >= 500
                ) from e
            except (urllib.error.URLError, OSError) as e:
                unreachable.append(f"{base}: {getattr(e, 'reason', e)}")
                continue
            if base != self.base_urls[0]:  # this node answers: ask it first from now on
                self.base_urls = [base, *(u for u in self.base_urls if u != base)]
            return json.loads(raw) if raw else None
        raise AdminError(f"{method} {path}: {'; '.join(unreachable)}", retriable=True)

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    # --- definitions -------------------------------------------------------

    def apply(self, d: NodeDefinitions) -> None:
        """Make the node hold everything in `d` (vhost "/"). Idempotent."""
        v = _q(VHOST)
        self.request("PUT", "cluster-name", {"name": d.cluster_name})
        for u in d.users:
            self.request("PUT", f"users/{_q(u.name)}", _user_body(u))
        for p in d.permissions:
            self.request("PUT", f"permissions/{v}/{_q(p.user)}", _permission_body(p))
        for tp in d.topic_permissions:
            self.request("PUT", f"topic-permissions/{v}/{_q(tp.user)}", _topic_permission_body(tp))
        for x in d.exchanges:
            self.request("PUT", f"exchanges/{v}/{_q(x.name)}", _exchange_body(x))
        for q in d.queues:
            self.request("PUT", f"queues/{v}/{_q(q.name)}", _queue_body(q))
        for b in d.bindings:
            kind = "q" if b.destination_type == "queue" else "e"
            self.request(
                "POST", f"bindings/{v}/e/{_q(b.source)}/{kind}/{_q(b.destination)}", _binding_body(b)
            )
        # Upstreams before the sets and policies that refer to them.
        for prm in sorted(d.parameters, key=lambda p: p.component != "federation-upstream"):
            self.request("PUT", f"parameters/{_q(prm.component)}/{v}/{_q(prm.name)}", _parameter_body(prm))
        for pol in d.policies:
            self.request("PUT", f"policies/{v}/{_q(pol.name)}", _policy_body(pol))
        log.debug("applied %s", json.dumps(asdict(d), default=str)[:200])

    #: Users per definitions import, and how long one may take: RabbitMQ imports a
    #: few hundred users a second here, and 2,000 in one request outlasted 10 s.
    IMPORT_CHUNK = 500
    IMPORT_TIMEOUT_S = 120.0

    def import_users(self, d: NodeDefinitions) -> None:
        """Add or update `d`'s users and their permissions, a few hundred per request (idempotent)."""
        body = definitions_file(d)
        users = body["users"]
        for i in range(0, len(users), self.IMPORT_CHUNK):
            chunk = users[i : i + self.IMPORT_CHUNK]
            names = {u["name"] for u in chunk}
            self.request(
                "POST",
                "definitions",
                {
                    "users": chunk,
                    "permissions": [p for p in body["permissions"] if p["user"] in names],
                    "topic_permissions": [p for p in body["topic_permissions"] if p["user"] in names],
                },
                timeout=self.IMPORT_TIMEOUT_S,
            )

    def users_with_topic_write(self, exchange: str, pattern: str) -> set[str]:
        """Users whose topic permission on `exchange` is `pattern` (how device users are told apart)."""
        return {
            tp["user"]
            for tp in self.get("topic-permissions") or []
            if tp.get("exchange") == exchange and tp.get("write") == pattern
        }

    def remove_user(self, name: str, reason: str) -> int:
        """Delete a user and close its connections; returns how many the node listed as open.

        RabbitMQ closes a deleted user's connections itself; closing the listed
        ones as well does not depend on that.  The listing lags new connections
        by up to the statistics interval (5 s), so the count may miss one
        opened just before.
        """
        listed = [c["name"] for c in self.get("connections?columns=name,user") or [] if c.get("user") == name]
        self.delete(f"users/{_q(name)}")
        for conn in listed:
            try:
                self.request_with_headers("DELETE", f"connections/{_q(conn)}", {"X-Reason": reason})
            except AdminError as e:
                if e.status != 404:  # already closed with the user
                    raise
        return len(listed)

    def delete(self, path: str) -> bool:
        """DELETE; False if it was not there (idempotent removal)."""
        try:
            self.request("DELETE", path)
        except AdminError as e:
            if e.status == 404:
                return False
            raise
        return True

    def remove_gateway(self, region: str, upstream: str) -> None:
        """Undo what backend_definitions declared for one region (its exchange, user, upstream,
        and the federation queue its gateway's downlink link left behind)."""
        from backend import contract as c

        v = _q(VHOST)
        self.delete(f"parameters/federation-upstream/{v}/{_q(upstream)}")
        self.delete(f"exchanges/{v}/{_q(c.downlink_exchange(region))}")
        for q in self.queues():
            if q["name"].startswith(f"federation: {c.downlink_exchange(region)} -> "):
                self.delete(f"queues/{v}/{_q(q['name'])}")
        self.delete(f"users/{_q(c.gateway_link_user(region))}")

    # --- what status and readiness checks read -------------------------------

    def overview(self) -> dict[str, Any]:
        return self.get("overview")  # type: ignore[no-any-return]

    def federation_links(self) -> list[dict[str, Any]]:
        return self.get("federation-links")  # type: ignore[no-any-return]

    def connections(self) -> list[dict[str, Any]]:
        return self.get("connections")  # type: ignore[no-any-return]

    def queues(self) -> list[dict[str, Any]]:
        return self.get("queues")  # type: ignore[no-any-return]


def prometheus_queue_messages(url: str, timeout: float = 5.0) -> dict[str, int]:
    """Messages in each queue of a node, from its Prometheus endpoint (`url`: http://host:port).

    Gateways do not collect management statistics (RabbitMQ 4.0 deprecates
    that), so the management API gives their queues without message counts;
    the Prometheus plugin reads the queues' own metrics.  Raises AdminError.
    """
    path = "/metrics/detailed?family=queue_coarse_metrics&vhost=" + quote(VHOST, safe="")
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as resp:
            body = resp.read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise AdminError(f"GET {url}{path}: {e}", retriable=True) from e
    return {
        sample.labels["queue"]: int(sample.value)
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == "rabbitmq_detailed_queue_messages" and sample.labels.get("vhost") == VHOST
    }
