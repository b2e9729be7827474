"""Helpers the integration tests share: real MQTT devices, the router's HTTP endpoint, Kafka reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from confluent_kafka import Message, Producer
from prometheus_client.parser import text_string_to_metric_families

from backend import contract as c
from backend.kafka_read import Match, read_records
from backend.polling import wait_until
from fedgate.devices import SimDevice
from fedgate.dns_resolver import resolver_for
from infra.local.driver import LocalFederation

#: What a device that the gateway will not let in is told (fedgate.devices.SimDevice.connect):
#: refused with the CONNACK's code, no CONNACK in time, or -- seen under load in full runs --
#: the socket closed by the gateway before the client read the CONNACK.  Either way it never
#: gets a session.
REFUSED = "refused|no CONNACK|closed before its CONNACK"


class DeviceCredentials:
    """Secrets of the devices the tests use, registered on first use (`fedgate devices add`)."""

    def __init__(self, federation: LocalFederation):
        self.federation = federation
        self._issued: dict[str, str] = {}

    def __call__(self, device_id: str) -> tuple[str, str]:
        if device_id not in self._issued:
            self._issued.update(self.federation.add_devices([device_id], rotate=True))
        return device_id, self._issued[device_id]


def device(endpoints: dict[str, Any], region: str, client_id: str, *, node: int = 0, **kw: Any) -> SimDevice:
    """A connected paho-mqtt device that lives in `region`, logged in with its own secret.

    It finds its gateway as a device does: it asks the federation's DNS server for
    mqtt.<domain> from an address of its region's client network, keeps the answer for its
    TTL, and connects there -- to the answer's address `node` (0-based, of them sorted) when a
    region's gateway is a cluster; when it loses its gateway it dials what DNS answers next."""
    user, secret = endpoints["credentials"](client_id)
    resolver = resolver_for(endpoints, region, client_id, pick=node)
    return SimDevice.nearest(client_id, resolver, user, secret, **kw).connect()


def operator_client(endpoints: dict[str, Any], region: str, client_id: str, **kw: Any) -> SimDevice:
    """An MQTT client with the administrator's login: not bound to one device's topics
    (publishing outside devices/<id>/..., as a line controller or a test of the bridge does)."""
    ep = endpoints
    admin = ep["admin"]
    return SimDevice(
        client_id,
        ep["gateways"][region]["address"],
        ep["gateways"][region]["mqtt"],
        admin["user"],
        admin["password"],
        **kw,
    ).connect()


def _metrics(url: str) -> dict[str, float]:
    """A router's samples by name with their labels as exposed: 'fedgate_router_held_total{region="x"}'."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def devices_in_network(
    federation: LocalFederation, ep: dict[str, Any], region: str, ids: list[str]
) -> list[SimDevice]:
    """Devices `ids`, registered, living in `region`'s client network: each finds its gateway by
    DNS (its region's while healthy, the next region's when not), subscribes to its commands
    and is seen connected there by the router."""
    secrets = federation.add_devices(ids)
    devices = [
        SimDevice.nearest(d, resolver_for(ep, region, d), d, secrets[d], keepalive=5).connect() for d in ids
    ]
    for d in devices:
        d.subscribe(c.device_command_topic(d.device_id, "#"))
        wait_present(ep, d.device_id, region)
    return devices


def firing(federation: LocalFederation, alert: str, **labels: str) -> bool:
    """Whether the federation's Prometheus fires `alert` with `labels` now."""
    return any(
        a["labels"].get("alertname") == alert
        and a["state"] == "firing"
        and all(a["labels"].get(k) == v for k, v in labels.items())
        for a in federation.node("prometheus").alerts()  # type: ignore[attr-defined]
    )


def leader_url(endpoints: dict[str, Any], timeout: float = 15.0) -> str:
    """The metrics URL of the router that routes commands now (router/leadership.py)."""

    def leading() -> str | None:
        for url in endpoints["routers"].values():
            try:
                if _metrics(url).get("fedgate_router_leading") == 1.0:
                    return str(url)
            except OSError:
                continue  # a router being restarted
        return None

    url = wait_until(leading, timeout, 0.2)
    assert url, "no router leads command routing"
    return url


def router_metrics(endpoints: dict[str, Any]) -> dict[str, float]:
    """The Prometheus metrics of the router that routes commands, by name with labels."""
    return _metrics(leader_url(endpoints))


def wait_metric(endpoints: dict[str, Any], name: str, at_least: float, timeout: float = 10.0) -> None:
    """Wait until the leading router's metric `name` (with labels) reaches `at_least`."""
    now = 0.0

    def reached() -> bool:
        nonlocal now
        now = router_metrics(endpoints).get(name, 0.0)
        return now >= at_least

    assert wait_until(reached, timeout, 0.1), f"{name} never reached {at_least} (now {now})"


def wait_present(endpoints: dict[str, Any], dev_id: str, region: str, timeout: float = 10.0) -> None:
    """Wait until the leading router's presence has the device at `region`."""

    def there() -> bool:
        url = f"{leader_url(endpoints)}/presence?device={dev_id}"
        with urllib.request.urlopen(url, timeout=5) as r:
            devices = json.load(r)["devices"]
        return bool(devices) and devices[0]["region"] == region

    if not wait_until(there, timeout, 0.05):
        raise AssertionError(f"router never saw {dev_id} at {region}")


def kafka_records(
    endpoints: dict[str, Any],
    topic: str,
    match: Match,
    expect: int,
    timeout: float = 20.0,
    settle_s: float = 0.0,
) -> list[tuple[Message, dict[str, str]]]:
    """Records of `topic` (from the start) that `match`, until `expect` of them or `timeout`.

    The read stops at the `expect`-th record: a test that counts copies gives `settle_s`, for
    the read to go on until that long passed without another (a copy would come then)."""
    return read_records(endpoints["kafka"]["bootstrap"], topic, match, expect, timeout, settle_s=settle_s)


def records_from(
    endpoints: dict[str, Any], topic: str, mqtt_topic: str, expect: int, timeout: float = 20.0
) -> list[tuple[Message, dict[str, str]]]:
    """Records of Kafka `topic` that came from MQTT topic `mqtt_topic` (its header)."""
    return kafka_records(
        endpoints, topic, lambda m, h: h.get(c.KAFKA_MQTT_TOPIC_HEADER) == mqtt_topic, expect, timeout
    )


#: the test running now (set by the root conftest): record_counts writes into its report
CURRENT_ITEM: Any = None


def record_counts(**counts: Any) -> None:
    """Keep what a fault scenario sent, received, lost and duplicated, in the test's report; the
    root conftest prints every test's counts at the end of the run."""
    if CURRENT_ITEM is not None:
        # plain values: under pytest-xdist the report crosses a process boundary
        plain = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in counts.items()}
        CURRENT_ITEM.user_properties.append(("chaos", plain))


def produce_bridge_records(
    bootstrap: str,
    records: list[tuple[str, bytes]],
    *,
    with_id: bool = True,
    timestamp_ms: int = 0,
    region: str = "local-eu",
    partition: int = -1,
    kafka_topic: str = "telemetry.telemetry",
) -> None:
    """Records as the bridge writes them: (device, payload) into `kafka_topic` (into
    `partition`, if one is given); a `timestamp_ms` counts only on a topic that keeps
    producers' times (producer_timestamps)."""
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for dev, payload in records:
        topic = c.device_telemetry_topic(dev)
        headers = [
            (c.KAFKA_REGION_HEADER, region.encode()),
            (c.KAFKA_MQTT_TOPIC_HEADER, topic.encode()),
            (c.KAFKA_DEVICE_HEADER, dev.encode()),
            (c.KAFKA_RECEIVED_AT_HEADER, str(int(time.time() * 1000)).encode()),
        ]
        if with_id:
            headers.append((c.KAFKA_MESSAGE_ID_HEADER, c.message_id(topic, payload).encode()))
        p.produce(
            kafka_topic,
            payload,
            dev.encode(),
            headers=headers,
            timestamp=timestamp_ms,
            partition=partition,
        )
        p.poll(0)
    assert p.flush(30) == 0, "Kafka did not confirm every record"


def sasl_security(federation):  # type: ignore[no-untyped-def]
    """How a client logs in at the federation's Kafka SASL_SSL listener (every broker's is the
    same user and CA)."""
    from infra.local.services import KafkaNode

    (security,) = {n.sasl_security() for n in federation.nodes() if isinstance(n, KafkaNode)}
    assert security is not None, "the test federation runs with tls, hence the SASL_SSL listener"
    return security


def run_fedgate(
    state_dir: Path, port_base: int, *args: str, regions: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """`fedgate ARGS` as an operator runs it, on the federation in `state_dir`."""
    env = {**os.environ, "FEDGATE_STATE_DIR": str(state_dir), "FEDGATE_PORT_BASE": str(port_base)}
    if regions is not None:
        env["FEDGATE_REGIONS"] = regions
    return run_to_end([sys.executable, "-m", "fedgate.cli", *args], timeout, env=env)


def run_to_end(
    argv: list[str], timeout: float, *, grace: float = 90, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """Run a command that starts services (`fedgate up`, `fedgate cloud-rehearsal`) to its end;
    its output captured.  Past `timeout` it gets SIGTERM, as an operator's Ctrl-C, and `grace`
    seconds to stop what it started, then the test fails with its output.  (subprocess.run's
    timeout SIGKILLs the command alone: the nodes it started, in sessions of their own, ran on
    beside the rest of the suite -- a rehearsal's whole backend once, for 20 minutes.)"""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=grace)
            ended = f"stopped by SIGTERM (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            ended = f"not stopped {grace:g} s after SIGTERM: SIGKILLed"
        raise AssertionError(
            f"{' '.join(argv[:4])} ... did not end in {timeout:g} s, {ended}; its output:\n{err[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
