"""The zone devices resolve, served by a real PowerDNS Authoritative server (infra/dns).

Each region's "gateway" here is a TCP listener on its own loopback address at the MQTT port:
what PowerDNS's health check connects to.  Clients ask from their own source address, in
their region's client network, as a device's resolver would.  Every answer is timed from the
change that should move it; each time is printed in the summary.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rcode
import pytest

from infra.dns.powerdns import PowerDNS
from infra.dns.zone import ZoneSpec
from tests.conftest import TEST_PORT_BASE
from tests.helpers import record_counts

pytestmark = [pytest.mark.dns]

DNS_PORT = TEST_PORT_BASE + 980
MQTT_PORT = TEST_PORT_BASE + 981
INTERVAL = 1  # lua-health-checks-interval (s)
TTL = 2
GATEWAY = {"local-eu": "127.0.201.1", "local-us": "127.0.202.1", "local-ap": "127.0.203.1"}
CLIENT = {"local-eu": "127.0.211.5", "local-us": "127.0.212.5", "local-ap": "127.0.213.5"}
NET = {"local-eu": "127.0.211.0/24", "local-us": "127.0.212.0/24", "local-ap": "127.0.213.0/24"}


def zone(regions: list[str]) -> ZoneSpec:
    """Each region's client network nearest to it, then to the others in the listed order."""
    return ZoneSpec(
        domain="fedgate.test",
        regions={r: [GATEWAY[r]] for r in regions},
        client_networks=[(NET[r], [r, *(o for o in regions if o != r)]) for r in regions],
        mqtt_port=MQTT_PORT,
        ttl=TTL,
    )


class Gateway:
    """A listener on a region's gateway address and the MQTT port (start/stop)."""

    def __init__(self, address: str):
        self.address = address
        self.sock: socket.socket | None = None

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.address, MQTT_PORT))
        s.listen(64)
        self.sock = s

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def ask(region_of_client: str) -> tuple[list[str], int]:
    """(addresses, TTL) PowerDNS answers a client of that region's network."""
    query = dns.message.make_query("mqtt.fedgate.test", "A")
    r = dns.query.udp(query, "127.0.0.1", port=DNS_PORT, source=CLIENT[region_of_client], timeout=3)
    assert r.rcode() == dns.rcode.NOERROR, dns.rcode.to_text(r.rcode())
    return sorted(rr.address for rrset in r.answer for rr in rrset), min(rrset.ttl for rrset in r.answer)


def until(region_of_client: str, want: str, timeout: float) -> float:
    """Seconds until a client of that region is answered `want`."""
    t0 = time.monotonic()
    while True:
        got, _ = ask(region_of_client)
        if got == [want]:
            return round(time.monotonic() - t0, 1)
        assert time.monotonic() - t0 < timeout, f"still answered {got}, not {want}, after {timeout} s"
        time.sleep(0.1)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PowerDNS]:
    srv = PowerDNS(
        tmp_path / "dns", zone(["local-eu", "local-us"]), port=DNS_PORT, health_check_interval=INTERVAL
    )
    srv.write()
    with open(tmp_path / "pdns.log", "w") as log:
        proc = subprocess.Popen(srv.argv(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                ask("local-eu")  # registers the health checks too: the first answer treats all as down
                break
            except (dns.exception.Timeout, OSError):
                assert proc.poll() is None, (tmp_path / "pdns.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "PowerDNS did not answer"
                time.sleep(0.2)
        yield srv
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def gateways() -> Iterator[dict[str, Gateway]]:
    gws = {r: Gateway(a) for r, a in GATEWAY.items()}
    try:
        yield gws
    finally:
        for g in gws.values():
            g.stop()


def test_each_client_network_is_answered_with_its_own_regions_gateway_and_the_ttl(server, gateways):
    gateways["local-eu"].start()
    gateways["local-us"].start()
    for region in ("local-eu", "local-us"):
        until(region, GATEWAY[region], timeout=INTERVAL * 3 + 1)
        assert ask(region) == ([GATEWAY[region]], TTL)


def test_a_regions_gateway_down_its_clients_get_the_next_then_the_nearest_again(server, gateways):
    gateways["local-eu"].start()
    gateways["local-us"].start()
    until("local-eu", GATEWAY["local-eu"], timeout=INTERVAL * 3 + 1)
    gateways["local-eu"].stop()
    moved = until("local-eu", GATEWAY["local-us"], timeout=INTERVAL * 3 + 2)
    assert ask("local-us")[0] == [GATEWAY["local-us"]], "the other region's clients keep theirs"
    gateways["local-eu"].start()
    back = until("local-eu", GATEWAY["local-eu"], timeout=INTERVAL * 3 + 2)
    # a device's resolver keeps an answer for the TTL: what it meets is the answer's move plus that
    record_counts(health_check_interval_s=INTERVAL, ttl_s=TTL, moved_after_s=moved, back_after_s=back)


def test_no_region_healthy_answers_the_nearest_as_route53_does(server, gateways):
    time.sleep(INTERVAL * 2 + 0.5)  # every check has run and found nothing
    assert ask("local-eu")[0] == [GATEWAY["local-eu"]]
    assert ask("local-us")[0] == [GATEWAY["local-us"]]


def test_a_region_added_is_answered_to_its_network_within_one_health_check_interval(server, gateways):
    for g in gateways.values():
        g.start()
    until("local-us", GATEWAY["local-us"], timeout=INTERVAL * 3 + 1)
    server.reload(zone(["local-eu", "local-us", "local-ap"]), serial=2)
    ask("local-ap")  # its check starts with the first question, as after a real `make gateway`
    answered = until("local-ap", GATEWAY["local-ap"], timeout=INTERVAL * 2 + 1)
    record_counts(health_check_interval_s=INTERVAL, new_region_answered_after_s=answered)
    assert ask("local-eu")[0] == [GATEWAY["local-eu"]], "the others keep theirs"


def test_a_devices_resolver_gets_its_regions_gateway_from_its_own_address_and_keeps_it_for_the_ttl(
    server, gateways
):
    from fedgate.dns_resolver import DnsResolver
    from infra.dns.query import DnsServer

    gateways["local-eu"].start()
    gateways["local-us"].start()
    until("local-us", GATEWAY["local-us"], timeout=INTERVAL * 3 + 1)
    until("local-eu", GATEWAY["local-eu"], timeout=INTERVAL * 3 + 1)
    regions = {a: r for r, a in GATEWAY.items()}
    device = DnsResolver(
        DnsServer("127.0.0.1", DNS_PORT),
        "mqtt.fedgate.test",
        MQTT_PORT,
        source=CLIENT["local-us"],
        regions=regions,
    )
    assert device.resolve().region == "local-us"
    gateways["local-us"].stop()
    time.sleep(INTERVAL + 0.5)
    assert device.resolve().region == "local-us" and device.questions == 1, "kept for the TTL"
    time.sleep(TTL)
    assert device.resolve().region == "local-eu", "asked again once the TTL ran out: the next region"
    assert device.questions == 2
