"""Devices pick the nearest healthy gateway and fail over when it dies (a minimal MQTT
broker on loopback stands in for each gateway)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from fedgate.devices import SimDevice
from fedgate.resolver import Endpoint, NearestHealthyResolver, NoHealthyGatewayError, tcp_connect_probe

# A killed gateway leaves paho (2.1) and the stand-in broker's accept thread holding a
# socket that is collected later; that is the failure being simulated, not a leak to fix here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
)


class TinyBroker:
    """Accepts MQTT connections and answers CONNECT with CONNACK and PINGREQ with PINGRESP."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.clients: list[socket.socket] = []
        self.connects = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.clients.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                head = conn.recv(1)
                if not head:
                    return
                length, mult = 0, 1
                while True:
                    b = conn.recv(1)[0]
                    length += (b & 0x7F) * mult
                    mult *= 128
                    if not b & 0x80:
                        break
                while length:
                    length -= len(conn.recv(length))
                kind = head[0] >> 4
                if kind == 1:  # CONNECT
                    self.connects += 1
                    conn.sendall(b"\x20\x02\x00\x00")
                elif kind == 12:  # PINGREQ
                    conn.sendall(b"\xd0\x00")
                elif kind == 14:  # DISCONNECT
                    return
        except (OSError, IndexError):
            return

    def kill(self) -> None:
        """The gateway dies: its port stops answering and every connection drops."""
        self._stop.set()
        self.listener.close()
        for c in self.clients:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass


@pytest.fixture
def brokers() -> Iterator[tuple[TinyBroker, TinyBroker]]:
    a, b = TinyBroker(), TinyBroker()
    yield a, b
    a.kill()
    b.kill()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_nearest_healthy_gateway_wins() -> None:
    near, far, dead = (Endpoint(r, "127.0.0.1", p) for r, p in (("eu", 1), ("us", 2), ("ap", 3)))
    latency = {near: 0.010, far: 0.080, dead: None}
    resolver = NearestHealthyResolver([far, dead, near], probe=latency.__getitem__)
    assert resolver.resolve() == near
    assert [ep for ep, _ in resolver.rank()] == [near, far]
    assert resolver.resolve(exclude=[near]) == far
    with pytest.raises(NoHealthyGatewayError, match="no healthy gateway"):
        resolver.resolve(exclude=[near, far])


def test_the_tcp_probe_measures_a_listening_port_and_fails_a_closed_one(
    brokers: tuple[TinyBroker, TinyBroker],
) -> None:
    probe = tcp_connect_probe(timeout=1.0)
    latency = probe(Endpoint("eu", "127.0.0.1", brokers[0].port))
    assert latency is not None and 0 < latency < 1.0
    assert probe(Endpoint("us", "127.0.0.1", _closed_port())) is None


def test_a_device_fails_over_to_the_next_gateway_when_its_gateway_dies(
    brokers: tuple[TinyBroker, TinyBroker],
) -> None:
    a, b = brokers
    eu, us = Endpoint("eu", "127.0.0.1", a.port), Endpoint("us", "127.0.0.1", b.port)
    real = tcp_connect_probe(timeout=0.5)

    def probe(ep: Endpoint) -> float | None:
        # health is real (the port answers or not); eu is made to look nearer
        lat = real(ep)
        return None if lat is None else lat + (0.0 if ep == eu else 0.05)

    dev = SimDevice.nearest("thermo-1", NearestHealthyResolver([us, eu], probe), "device", "pw", keepalive=5)
    with dev:
        assert dev.region == "eu" and a.connects == 1
        a.kill()
        deadline = time.monotonic() + 15
        while not (dev.connected and dev.region == "us") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dev.region == "us" and dev.connected, "device did not fail over to us"
        assert b.connects == 1
        assert dev.failovers == [eu]
