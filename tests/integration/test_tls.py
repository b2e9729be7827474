"""TLS on the real local federation: MQTT over TLS for devices, AMQPS for the federation links,
HTTPS for the management API.

Tried: a device over TLS checking the gateway against the local CA; a plain
MQTT client at the TLS port; a TLS client that trusts another CA; the
management API over HTTPS, checked for the nodes' name, for another name, and
against another CA.  Checked: every federation link runs over AMQPS with the
peer's certificate verified.
"""

from __future__ import annotations

import ssl

import paho.mqtt.client as mqtt
import pytest

from backend import contract as c
from backend.rabbitmq_admin import AdminError, RabbitAdmin
from fedgate.devices import DeviceError, SimDevice
from infra.local.tls import LocalCA
from tests.helpers import kafka_records

pytestmark = [pytest.mark.integration, pytest.mark.kafka]


def tls_device(endpoints, region: str, dev_id: str, ca: str, **kw) -> SimDevice:
    user, secret = endpoints["credentials"](dev_id)
    ep = endpoints
    return SimDevice(
        dev_id,
        ep["gateways"][region]["address"],
        ep["gateways"][region]["mqtts"],
        user,
        secret,
        tls_ca=ca,
        **kw,
    )


def test_a_device_over_tls_checks_the_gateway_and_its_readings_arrive(endpoints, uid):
    dev_id = f"tls-{uid}"
    with tls_device(endpoints, "local-eu", dev_id, endpoints["tls"]["ca"]).connect() as d:
        sock = d.client.socket()
        assert isinstance(sock, ssl.SSLSocket) and sock.version() in ("TLSv1.3", "TLSv1.2")
        d.publish(c.device_telemetry_topic(dev_id), b'{"over": "tls"}')
    recs = kafka_records(
        endpoints, c.KAFKA_TELEMETRY_TOPIC, lambda m, h: h.get(c.KAFKA_DEVICE_HEADER) == dev_id, expect=1
    )
    assert [m.value() for m, _ in recs] == [b'{"over": "tls"}']
    assert recs[0][1][c.KAFKA_REGION_HEADER] == "local-eu"


def test_plain_mqtt_at_the_tls_port_is_refused(endpoints, uid):
    user, secret = endpoints["credentials"](f"plain-{uid}")
    ep = endpoints
    d = SimDevice(
        user,
        ep["gateways"]["local-eu"]["address"],
        ep["gateways"]["local-eu"]["mqtts"],
        user,
        secret,
        auto_reconnect=False,
    )
    with pytest.raises(DeviceError):
        d.connect(timeout=5)


# paho leaves its socket open when the TLS handshake fails; the warning that
# raises at garbage collection is paho's, not a fedgate leak
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_client_that_trusts_another_ca_does_not_connect(endpoints, tmp_path, uid):
    other_ca = LocalCA(tmp_path / "other-ca").ensure_ca()
    d = tls_device(endpoints, "local-us", f"mitm-{uid}", str(other_ca), auto_reconnect=False)
    with pytest.raises((DeviceError, ssl.SSLError, mqtt.WebsocketConnectionError, OSError)):
        d.connect(timeout=5)


def test_every_federation_link_runs_over_amqps_and_verifies_its_peer(federation):
    nodes = [federation.backend(), *federation.gateways()]
    links = [link for n in nodes for link in n.admin().federation_links()]
    assert len(links) >= 6, "uplink and presence per gateway on the backend, a downlink on each gateway"
    for link in links:
        assert link["status"] == "running" and link["uri"].startswith("amqps://"), link
    # the status hides the URI's options; the upstreams the links come from carry them
    upstreams = [u for n in nodes for u in n.admin().get("parameters/federation-upstream")]
    assert len(upstreams) == 2 * len(federation.gateways()), (
        "one per gateway on the backend, one on each gateway"
    )
    for u in upstreams:
        uri = u["value"]["uri"]
        assert uri.startswith("amqps://") and "verify=verify_peer" in uri and "cacertfile=" in uri, u["name"]


def test_the_management_api_over_https_is_trusted_only_for_the_nodes_name_and_ca(endpoints, tmp_path):
    """What the routers do with a cloud region's management API (gateways/templates/tls.conf):
    the node's HTTPS listener, its certificate checked against the nodes' CA."""
    ep = endpoints
    url = f"https://{ep['host']}:{ep['gateways']['local-us']['management_tls']}"
    user, password = ep["admin"]["user"], ep["admin"]["password"]
    ca, name = ep["tls"]["ca"], ep["tls"]["server_name"]
    overview = RabbitAdmin(url, user, password, ca_file=ca, server_name=name).get("overview")
    assert overview["cluster_name"] == c.gateway_cluster_name("local-us")
    with open(ca) as pem:  # the region registry carries the CA itself
        assert (
            RabbitAdmin(url, user, password, ca_pem=pem.read(), server_name=name).get("whoami")["name"]
            == user
        )
    with pytest.raises(AdminError, match="certificate"):
        RabbitAdmin(url, user, password, ca_file=ca, server_name="gw-elsewhere.example").get("overview")
    other_ca = LocalCA(tmp_path / "other-ca").ensure_ca()
    with pytest.raises(AdminError, match="certificate"):
        RabbitAdmin(url, user, password, ca_file=str(other_ca), server_name=name).get("overview")
