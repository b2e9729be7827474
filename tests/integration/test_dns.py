"""The zone devices resolve, served by a real PowerDNS Authoritative server with the MQTT health
checks that decide its answers: `python -m infra.dns.serve`, as the local `dns` node runs it.

Each region's "gateway" here is a listener on its own loopback address at the MQTT port that
answers a CONNECT with a CONNACK (a broker refusing the login, as fedgate's gateways refuse the
check's); hung, it accepts and stays silent, as the kernel of a stopped broker does.  Clients
ask from their own source address, in their region's client network, as a device's resolver
would.  Every answer is timed from the change that should move it; each time is printed in the
summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import dns.rcode
import pytest

from backend.polling import wait_until
from infra.dns.health import HealthChecks
from infra.dns.powerdns import PowerDNS
from infra.dns.serve import ServeConfig
from infra.dns.zone import ZoneSpec
from infra.local import processes
from infra.local.dns_node import DnsNode
from infra.local.layout import StateFiles, port_layout
from infra.local.settings import PROJECT_ROOT, load_settings
from tests.conftest import TEST_PORT_BASE
from tests.helpers import record_counts

pytestmark = [pytest.mark.dns]

DNS_PORT = TEST_PORT_BASE + 980
MQTT_PORT = TEST_PORT_BASE + 981
CHECKS = HealthChecks(interval_s=1, timeout_s=1, failure_threshold=2)
INTERVAL = CHECKS.interval_s
TTL = 2
#: the longest a hung gateway is still answered, asked straight at the server (no TTL)
HUNG_ANSWERED_S = CHECKS.worst_case_down_s()
GATEWAY = {"local-eu": "127.0.201.1", "local-us": "127.0.202.1", "local-ap": "127.0.203.1"}
CLIENT = {"local-eu": "127.0.211.5", "local-us": "127.0.212.5", "local-ap": "127.0.213.5"}
NET = {"local-eu": "127.0.211.0/24", "local-us": "127.0.212.0/24", "local-ap": "127.0.213.0/24"}
CONNACK_NOT_AUTHORIZED = bytes([0x20, 0x02, 0x00, 0x05])


def zone(regions: list[str], gateway: dict[str, str] = GATEWAY) -> ZoneSpec:
    """Each region's client network nearest to it, then to the others in the listed order."""
    return ZoneSpec(
        domain="fedgate.test",
        regions={r: [gateway[r]] for r in regions},
        client_networks=[(NET[r], [r, *(o for o in regions if o != r)]) for r in regions],
        mqtt_port=MQTT_PORT,
        ttl=TTL,
    )


class Gateway:
    """A broker's listener on `address` and the MQTT port (start/stop): a CONNACK for each
    CONNECT, or silence while `hung`."""

    def __init__(self, address: str, port: int = MQTT_PORT):
        self.address, self.port = address, port
        self.hung = False
        self.sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._silent: list[socket.socket] = []

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.address, self.port))
        s.listen(64)
        s.settimeout(0.1)
        self.sock = s
        self._thread = threading.Thread(target=self._serve, args=(s,), daemon=True)
        self._thread.start()

    def _serve(self, s: socket.socket) -> None:
        while self.sock is s:
            try:
                conn, _ = s.accept()
            except (TimeoutError, OSError):
                continue
            if self.hung:
                self._silent.append(conn)
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(1)
                if conn.recv(64):
                    conn.sendall(CONNACK_NOT_AUTHORIZED)

    def stop(self) -> None:
        s, self.sock = self.sock, None
        if self._thread is not None:
            self._thread.join(2)
        if s is not None:
            s.close()
        for c in self._silent:
            c.close()
        self._silent.clear()


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


def started(server: Server, gateways: dict[str, Gateway], *regions: str) -> None:
    """These regions' gateways started and counted up by the server (their answer alone cannot
    tell: with every region down a network is answered its own region too)."""
    lines = [f"{r} {GATEWAY[r]}: up" for r in regions]
    seen = [server.log.read_text().count(line) for line in lines]
    for r in regions:
        gateways[r].start()
    # the server logs a change once PowerDNS serves the zone holding it
    for line, before in zip(lines, seen, strict=True):
        server.logged(line, before, timeout=INTERVAL + CHECKS.timeout_s + 2)


class Server:
    """The running `python -m infra.dns.serve` and its config file."""

    def __init__(self, folder: Path, spec: ZoneSpec):
        self.folder = folder
        self.config_path = folder / "serve.json"
        self.log = folder / "serve.log"
        #: in the environment of the server and of PowerDNS, to find them by
        self.marker = processes.marker(folder, "dns")
        self.config(spec).write(self.config_path)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "infra.dns.serve", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT), processes.MARKER_VAR: self.marker},
            )

    def config(self, spec: ZoneSpec) -> ServeConfig:
        return ServeConfig(self.folder / "pdns", "127.0.0.1", DNS_PORT, spec, CHECKS)

    def wait_answering(self) -> None:
        def answering() -> bool:
            try:
                ask("local-eu")
                return True
            except (dns.exception.Timeout, OSError):
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                return False

        assert wait_until(answering, 15, 0.2), f"no answer; {self.log.read_text()[-2000:]}"

    def logged(self, line: str, before: int, timeout: float) -> None:
        """Until the server's log holds `line` more than `before` times."""
        assert wait_until(lambda: self.log.read_text().count(line) > before, timeout, 0.05), (
            f"no {line!r} in {timeout} s; {self.log.read_text()[-2000:]}"
        )

    def reload(self, spec: ZoneSpec) -> None:
        """A region added or removed, as the local driver does it: the config, then SIGHUP."""
        self.config(spec).write(self.config_path)
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(15)


@contextlib.contextmanager
def serving(folder: Path, spec: ZoneSpec) -> Iterator[Server]:
    srv = Server(folder, spec)
    try:
        srv.wait_answering()
        yield srv
    finally:
        code = srv.stop()
        log = srv.log.read_text()
        assert code == 0, f"SIGTERM: exit code {code}; {log[-2000:]}"
        assert wait_until(lambda: not processes.marked_pids(srv.marker), 5, 0.1), (
            "PowerDNS outlived the server"
        )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with serving(tmp_path, zone(["local-eu", "local-us"])) as srv:
        yield srv


@pytest.fixture
def gateways() -> Iterator[dict[str, Gateway]]:
    gws = {r: Gateway(a) for r, a in GATEWAY.items()}
    try:
        yield gws
    finally:
        for g in gws.values():
            g.stop()


def test_each_client_network_is_answered_with_its_own_regions_gateway_and_the_ttl(server, gateways):
    started(server, gateways, "local-eu", "local-us")
    for region in ("local-eu", "local-us"):
        assert ask(region) == ([GATEWAY[region]], TTL)
    assert "local-eu 127.0.201.1: up (CONNACK within 1 s)" in server.log.read_text()


def test_a_regions_gateway_down_its_clients_get_the_next_then_the_nearest_again(server, gateways):
    started(server, gateways, "local-eu", "local-us")
    gateways["local-eu"].stop()
    moved = until("local-eu", GATEWAY["local-us"], timeout=HUNG_ANSWERED_S + 2)
    assert ask("local-us")[0] == [GATEWAY["local-us"]], "the other region's clients keep theirs"
    gateways["local-eu"].start()
    back = until("local-eu", GATEWAY["local-eu"], timeout=INTERVAL + CHECKS.timeout_s + 2)
    # a device's resolver keeps an answer for the TTL: what it meets is the answer's move plus that
    record_counts(health_check_interval_s=INTERVAL, ttl_s=TTL, moved_after_s=moved, back_after_s=back)


def test_a_hung_gateway_that_keeps_its_listener_is_no_longer_answered_and_is_again_once_it_answers(
    server, gateways
):
    started(server, gateways, "local-eu", "local-us")
    gateways["local-eu"].hung = True  # its kernel still completes every handshake
    moved = until("local-eu", GATEWAY["local-us"], timeout=HUNG_ANSWERED_S + TTL)
    assert ask("local-us")[0] == [GATEWAY["local-us"]], "the other region's clients keep theirs"
    # the server says a change once the zone holding it is served: the answer moves a moment
    # before the line is written (r22 read the log between the two)
    said = "local-eu 127.0.201.1: down (no CONNACK within 1 s, 2 checks)"
    assert wait_until(lambda: said in server.log.read_text(), 5, 0.05), server.log.read_text()[-2000:]
    gateways["local-eu"].hung = False
    back = until("local-eu", GATEWAY["local-eu"], timeout=INTERVAL + CHECKS.timeout_s + 2)
    record_counts(
        health_check_interval_s=INTERVAL,
        health_check_timeout_s=CHECKS.timeout_s,
        failure_threshold=CHECKS.failure_threshold,
        ttl_s=TTL,
        hung_answered_at_most_s=HUNG_ANSWERED_S,
        hung_moved_after_s=moved,
        answering_again_back_after_s=back,
    )
    assert moved <= HUNG_ANSWERED_S + 0.5


def test_no_region_healthy_answers_the_nearest_as_route53_does(server, gateways):
    # the server checked every gateway before its first answer: nothing answered, from the start
    assert ask("local-eu")[0] == [GATEWAY["local-eu"]]
    assert ask("local-us")[0] == [GATEWAY["local-us"]]
    time.sleep(INTERVAL * 2 + 0.5)
    assert ask("local-eu")[0] == [GATEWAY["local-eu"]]
    assert ask("local-us")[0] == [GATEWAY["local-us"]]


def test_a_broker_on_every_address_of_the_dns_host_is_never_answered_to_devices(tmp_path):
    # the gateways elsewhere (TEST-NET-1, on no interface here), all down; a broker on this
    # host answers CONNACK on every address of it: devices still get their nearest region's
    elsewhere = {"local-eu": "192.0.2.201", "local-us": "192.0.2.202"}
    broker = Gateway("0.0.0.0")
    broker.start()
    try:
        with serving(tmp_path, zone(["local-eu", "local-us"], elsewhere)):
            deadline = time.monotonic() + HUNG_ANSWERED_S + 1
            while time.monotonic() < deadline:
                for region in ("local-eu", "local-us"):
                    assert ask(region)[0] == [elsewhere[region]]
                time.sleep(0.2)
    finally:
        broker.stop()


def test_a_region_added_is_answered_to_its_network_at_once(server, gateways):
    started(server, gateways, "local-eu", "local-us")
    gateways["local-ap"].start()
    t0 = time.monotonic()
    server.reload(zone(["local-eu", "local-us", "local-ap"]))
    answered = until("local-ap", GATEWAY["local-ap"], timeout=CHECKS.timeout_s + 2)
    record_counts(
        health_check_interval_s=INTERVAL, new_region_answered_after_s=round(time.monotonic() - t0, 1)
    )
    assert answered <= CHECKS.timeout_s + 1, "checked as the config was read, not an interval later"
    assert ask("local-eu")[0] == [GATEWAY["local-eu"]], "the others keep theirs"


def test_a_devices_resolver_gets_its_regions_gateway_from_its_own_address_and_keeps_it_for_the_ttl(
    server, gateways
):
    from fedgate.dns_resolver import DnsResolver
    from infra.dns.query import DnsServer

    started(server, gateways, "local-eu", "local-us")
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
    time.sleep(max(TTL, HUNG_ANSWERED_S - INTERVAL))
    assert device.resolve().region == "local-eu", "asked again once the TTL ran out: the next region"
    assert device.questions == 2


def test_powerdns_dies_with_the_server_even_when_it_is_killed(tmp_path):
    srv = Server(tmp_path, zone(["local-eu", "local-us"]))
    try:
        srv.wait_answering()
        (pdns,) = Path(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read_text().split()
        assert processes.pid_alive(int(pdns), srv.marker), "that is PowerDNS, the server's child"
        srv.proc.kill()
        srv.proc.wait(5)
        assert wait_until(lambda: not processes.pid_alive(int(pdns), srv.marker), 5, 0.1), (
            "PowerDNS outlived its server's SIGKILL"
        )
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def test_the_federations_dns_node_answers_after_checking_settles_reloads_and_stops_leaving_nothing(tmp_path):
    """The local `dns` node as `make up` and `make gateway` drive it, its gateways listeners;
    its state dir deeper than a Unix socket's path may be (107 bytes), as under pytest-xdist's
    tmp_path: PowerDNS's control socket goes to a short folder of its own, gone after the stop."""
    settings = load_settings(
        env={},
        state_dir=tmp_path / ("deep-" * 6) / "state",
        port_base=TEST_PORT_BASE + 2800,
        regions=("local-eu", "local-us"),
        health_check_interval=1,
        dns_ttl=2,
    )
    specs = port_layout(settings)
    files = StateFiles(settings.state_dir)
    files.write_record(specs, settings.host)
    node = DnsNode(next(s for s in specs if s.role == "dns"), settings, secrets={}, epmd_port=0)
    pdns = PowerDNS(node.config().folder, node.config().zone)
    assert len(str(pdns.folder / "pdns.controlsocket")) > 107, "the case tried: too long a path"
    assert len(str(pdns.socket_dir / "pdns.controlsocket")) <= 107
    listeners: list[Gateway] = []

    def gateways_of(specs: list) -> dict[str, str]:
        return {s.region: s.bind_address("mqtt", settings.host) for s in specs if s.role == "gateway"}

    try:
        for address in gateways_of(specs).values():
            listeners.append(Gateway(address, settings.mqtt_port))
            listeners[-1].start()
        node.preflight()
        node.start()

        def ready() -> bool:
            if node.ready():
                return True
            assert node.exited() is None, node.stdout_log.read_text()[-2000:]
            return False

        assert wait_until(ready, 15, 0.2), node.stdout_log.read_text()[-2000:]
        assert node.settle()
        assert node.answers() == gateways_of(specs), "each network is answered its own gateway"
        assert node.status_line().startswith("dns: mqtt.fedgate.test at ")

        # `make gateway REGION=local-ap`: its gateway up, the record written, the node reloaded
        settings = dataclasses.replace(settings, regions=(*settings.regions, "local-ap"))
        specs = port_layout(settings, files.recorded())
        files.write_record(specs, settings.host)
        listeners.append(Gateway(gateways_of(specs)["local-ap"], settings.mqtt_port))
        listeners[-1].start()
        node.settings = settings
        t0 = time.monotonic()
        node.reload()
        record_counts(dns_node_reloaded_and_settled_s=round(time.monotonic() - t0, 1))
        assert node.answers() == gateways_of(specs)
        assert "zone: regions local-eu, local-us, local-ap" in node.stdout_log.read_text()
    finally:
        killed = node.stop(grace=15)
        for g in listeners:
            g.stop()
    assert killed == [], "SIGTERM stopped the server and PowerDNS: nothing had to be killed"
    assert processes.marked_pids(node.marker) == [], "no process of the node is left"
    assert not pdns.socket_dir.exists(), "the control socket's own folder is removed at the stop"
