"""The DNS server's gateway checks (infra/dns/health.py) against real sockets on loopback: a
listener that completes the TCP handshake but never answers -- a hung broker, as the kernel
keeps accepting for it -- fails; one that answers the CONNECT with a CONNACK passes, whatever
its return code; a closed port fails.  And the counting: down after the threshold, up after one.
What PowerDNS then answers is tests/integration/test_dns.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.dns.health import Health, HealthChecks, Prober, connect_packet, probe
from infra.dns.serve import ServeConfig, ServeError
from infra.dns.zone import ZoneSpec

HOST = "127.0.0.1"
#: what RabbitMQ answers a CONNECT without credentials when anonymous logins are off
CONNACK_NOT_AUTHORIZED = bytes([0x20, 0x02, 0x00, 0x05])


class Broker:
    """A listener on loopback: `answer` (bytes) after reading each CONNECT, or nothing while
    `hung` -- the connection accepted and left silent, as a stopped broker's kernel does."""

    def __init__(self, answer: bytes = CONNACK_NOT_AUTHORIZED, address: str = HOST, port: int = 0):
        self.answer = answer
        self.hung = False
        self.connections = 0
        self.sock = socket.socket()
        self.sock.bind((address, port))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self._silent: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            if self.hung:
                self._silent.append(conn)
                continue
            with conn:
                conn.settimeout(2)
                if conn.recv(64):
                    conn.sendall(self.answer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self._silent:
            c.close()
        self.sock.close()


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker()
    yield b
    b.close()


def check(port: int, timeout: float = 0.5) -> str | None:
    return asyncio.run(probe(HOST, port, timeout))


def test_the_connect_is_mqtt_3_1_1_with_a_clean_session_and_no_credentials():
    packet = connect_packet()
    assert packet[0] == 0x10 and packet[1] == len(packet) - 2
    assert packet[2:10] == b"\x00\x04MQTT\x04\x02", "protocol level 4, clean session, no user or password"
    assert packet.endswith(b"\x00\x0efedgate-health")


def test_a_broker_answering_a_connack_is_healthy_even_when_it_refuses_the_login(broker):
    assert check(broker.port) is None


def test_a_listener_that_accepts_but_never_answers_is_down():
    # listen() and never accept: the kernel completes the handshake, as for a SIGSTOPped broker
    hung = socket.socket()
    hung.bind((HOST, 0))
    hung.listen(16)
    try:
        t0 = time.monotonic()
        assert check(hung.getsockname()[1], timeout=0.5) == "no CONNACK within 0.5 s"
        assert 0.45 < time.monotonic() - t0 < 1.5
    finally:
        hung.close()


def test_a_closed_port_is_down():
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    assert check(port) == "Connection refused"


def test_an_answer_that_is_no_connack_is_down():
    b = Broker(answer=b"HTTP/1.1 400 Bad Request\r\n\r\n")
    try:
        assert "not a CONNACK" in (check(b.port) or "")
    finally:
        b.close()


def test_down_after_the_threshold_of_failures_in_a_row_up_after_one_pass():
    h = Health(failure_threshold=2)
    first = h.record("a", None)
    assert first is not None and first.up, "the first check decides"
    assert h.record("a", "no CONNACK within 2 s") is None, "one failure is not enough"
    assert h.record("a", None) is None, "a pass in between starts the count again"
    assert h.record("a", "no CONNACK within 2 s") is None
    down = h.record("a", "no CONNACK within 2 s")
    assert down is not None and not down.up and not h.is_up("a")
    assert down.text(2) == "a: down (no CONNACK within 2 s, 2 checks)"
    assert h.record("a", "Connection refused") is None, "down stays down"
    up = h.record("a", None)
    assert up is not None and up.up and up.text(2) == "a: up (CONNACK within 2 s)"


def test_an_address_whose_first_check_fails_starts_down():
    h = Health(failure_threshold=3)
    change = h.record("a", "Connection refused")
    assert change is not None and not change.up and change.text(2) == "a: down (Connection refused, 1 check)"


def test_worst_case_down_time_counts_the_checks_of_the_threshold():
    assert HealthChecks(2, 2, 2).worst_case_down_s() == 6
    assert HealthChecks(1, 2, 2).worst_case_down_s() == 5, "a check longer than the interval"


def test_a_hung_gateway_neither_delays_the_others_checks_nor_stays_up(broker):
    hung = Broker(address="127.0.0.2", port=broker.port)  # another gateway, the same MQTT port
    changes = []

    async def scenario() -> None:
        checks = HealthChecks(interval_s=0.1, timeout_s=0.6, failure_threshold=2)
        prober = Prober(broker.port, checks, changes.append)
        await prober.check_all([HOST, "127.0.0.2"])
        assert prober.health.is_up(HOST) and prober.health.is_up("127.0.0.2")
        hung.hung = True
        before = broker.connections
        prober.watch([HOST, "127.0.0.2"])
        await asyncio.sleep(2.0)
        assert broker.connections - before >= 10, "the answering gateway was checked every 0.1 s"
        assert not prober.health.is_up("127.0.0.2"), "the hung one down after two checks of 0.6 s"
        assert prober.health.is_up(HOST)
        await prober.stop()

    try:
        asyncio.run(scenario())
    finally:
        hung.close()
    assert [c.text(0.6) for c in changes if c.address == "127.0.0.2"] == [
        "127.0.0.2: up (CONNACK within 0.6 s)",
        "127.0.0.2: down (no CONNACK within 0.6 s, 2 checks)",
    ]


def test_stop_ends_the_checks_even_when_a_check_loses_its_cancel(broker, monkeypatch):
    """Python 3.11's wait_for returns a wait that ends as it is cancelled and drops the
    cancel: a check in that state went on checking, and stop() (the DNS server's SIGTERM)
    waited for it forever -- the suite saw it hang for 300 s.  Here each check task swallows
    the first cancel it gets, as such a library wait does."""
    lost: list[asyncio.Task[Any]] = []

    async def check(self: Prober, address: str) -> str | None:
        task = asyncio.current_task()
        try:
            await asyncio.sleep(10)  # where every cancel comes: the watch waits 0.01 s between checks
        except asyncio.CancelledError:
            if task in lost:
                raise
            lost.append(task)  # swallowed, once
        return None

    monkeypatch.setattr(Prober, "_check", check)

    async def ends(stopping: Awaitable[None]) -> bool:
        done, _ = await asyncio.wait({asyncio.ensure_future(stopping)}, timeout=5)
        return bool(done)

    async def scenario() -> None:
        prober = Prober(broker.port, HealthChecks(interval_s=0.01, timeout_s=0.5), lambda _: None)
        prober.watch([HOST, "127.0.0.2"])
        await asyncio.sleep(0.3)
        assert await ends(prober.stop()), "stop() waited for a check that lost its cancel"
        prober.watch([HOST, "127.0.0.2"])
        await asyncio.sleep(0.3)
        prober.watch([HOST])  # an address dropped from the watch is no longer checked
        dropped = [t for t in asyncio.all_tasks() if t.get_name() == "check 127.0.0.2"]
        assert await ends(asyncio.gather(*dropped)), "the dropped address was still checked"
        assert await ends(prober.stop())

    asyncio.run(scenario())
    assert len(lost) == 4, "each check task lost its first cancel"


def test_the_servers_config_round_trips_and_a_wrong_one_is_named(tmp_path: Path):
    zone = ZoneSpec(
        domain="fedgate.test",
        regions={"local-eu": ["127.0.1.1"]},
        client_networks=[("127.10.1.0/24", ["local-eu"])],
        mqtt_port=1884,
    )
    cfg = ServeConfig(tmp_path / "pdns", HOST, 5353, zone, HealthChecks(1, 0.5, 3))
    cfg.write(tmp_path / "serve.json")
    assert ServeConfig.load(tmp_path / "serve.json") == cfg
    (tmp_path / "bad.json").write_text('{"folder": "x", "address": "127.0.0.1", "port": 1, "zone": {}}')
    with pytest.raises(ServeError, match="bad.json: KeyError"):
        ServeConfig.load(tmp_path / "bad.json")
