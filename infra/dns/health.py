"""Whether a gateway answers MQTT: the health checks behind the zone's answers (infra/dns/zone.py).

A check opens a TCP connection to the gateway's MQTT port, sends an MQTT 3.1.1 CONNECT (clean
session, client id `fedgate-health`, no credentials) and counts the gateway healthy if and
only if a CONNACK comes back within the timeout -- whatever its return code: "not authorized"
is a broker that reads and answers.  A TCP handshake alone proves nothing: the kernel of a
hung broker (SIGSTOPped, stuck in a collection, a wedged Erlang VM) still completes it from its
listen queue.  Fedgate's gateways refuse anonymous logins, so each check is one refused login
in the gateway's log, and never a session: no presence event, no client id taken from a device.

An address counts down after `failure_threshold` checks in a row failed, and up again after
one that passed (as Route53 counts); its first check decides where it starts.  Every address
is checked on its own schedule, concurrently, so a hung gateway's timeout delays no other's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: The CONNACK of MQTT 3.1.1: packet type 2, remaining length 2 (flags, return code).
CONNACK = 0x20
CLIENT_ID = "fedgate-health"


def connect_packet(client_id: str = CLIENT_ID, keepalive_s: int = 10) -> bytes:
    """An MQTT 3.1.1 CONNECT with a clean session and no credentials."""
    ident = client_id.encode()
    variable = b"\x00\x04MQTT" + bytes([4, 0x02]) + keepalive_s.to_bytes(2, "big")
    rest = variable + len(ident).to_bytes(2, "big") + ident
    if len(rest) > 127:
        raise ValueError(f"client id {client_id!r} is too long for a one-byte length")
    return bytes([0x10, len(rest)]) + rest


#: The client ends a session the broker accepted (an anonymous broker): no "closed
#: abruptly" in its log.
DISCONNECT = b"\xe0\x00"


@dataclass(frozen=True)
class HealthChecks:
    """How gateways are checked: every `interval_s`, a CONNACK within `timeout_s`, down after
    `failure_threshold` failures in a row."""

    interval_s: float = 2.0
    #: RabbitMQ answers a refused login's CONNACK only after 3 s (measured on 4.0.5, with any
    #: credentials or none): a shorter timeout finds every live gateway down
    timeout_s: float = 5.0
    failure_threshold: int = 2

    def check(self) -> HealthChecks:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"health checks: interval {self.interval_s} s, timeout {self.timeout_s} s")
        if self.failure_threshold < 1:
            raise ValueError(f"health checks: failure_threshold {self.failure_threshold} < 1")
        return self

    def worst_case_down_s(self) -> float:
        """The longest a hung gateway stays healthy here: it hangs just after a check passed;
        then `failure_threshold` checks time out, one every max(interval, timeout)."""
        every = max(self.interval_s, self.timeout_s)
        return self.interval_s + (self.failure_threshold - 1) * every + self.timeout_s


async def probe(address: str, port: int, timeout_s: float) -> str | None:
    """None if a CONNACK came back within `timeout_s`, else why not (one line)."""
    stage = "no TCP connection"
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(address, port)
            stage = "no CONNACK"
            writer.write(connect_packet())
            await writer.drain()
            head = await reader.readexactly(4)
            if head[0] != CONNACK or head[1] != 2:
                return f"answered {head.hex()}, not a CONNACK"
            if head[3] == 0:
                writer.write(DISCONNECT)
                await writer.drain()
            return None
    except TimeoutError:
        return f"{stage} within {timeout_s:g} s"
    except asyncio.IncompleteReadError:
        return "closed the connection without a CONNACK"
    except OSError as e:
        # asyncio's strerror is "Connect call failed (address)": the errno says more, shorter
        return os.strerror(e.errno) if e.errno else str(e)
    finally:
        if writer is not None:
            writer.close()
            # the check's outcome is known: a close that fails or hangs is not its failure (a
            # TimeoutError out of here ended the address's watch for good).  asyncio.timeout,
            # not wait_for: Python 3.11's wait_for loses a cancel that comes as the wait ends
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(1):
                    await writer.wait_closed()


@dataclass(frozen=True)
class Change:
    """An address that went up or down, and why (the failure of its last check)."""

    address: str
    up: bool
    reason: str | None
    failures: int

    def text(self, timeout_s: float) -> str:
        if self.up:
            return f"{self.address}: up (CONNACK within {timeout_s:g} s)"
        checks = f"{self.failures} check{'s' if self.failures != 1 else ''}"
        return f"{self.address}: down ({self.reason}, {checks})"


class Health:
    """Each address's state from its checks' outcomes (no I/O here)."""

    def __init__(self, failure_threshold: int):
        self.failure_threshold = failure_threshold
        self._up: dict[str, bool] = {}
        self._failures: dict[str, int] = {}

    def record(self, address: str, failure: str | None) -> Change | None:
        """One check's outcome (None: passed); the change it makes, if any."""
        first = address not in self._up
        failures = 0 if failure is None else self._failures.get(address, 0) + 1
        self._failures[address] = failures
        was = self._up.get(address)
        if failure is None:
            now = True
        elif first:
            now = False  # the first check decides: a gateway not answering is not answered
        else:
            now = bool(was) and failures < self.failure_threshold
        self._up[address] = now
        if first or now != was:
            return Change(address, now, failure, failures)
        return None

    def is_up(self, address: str) -> bool:
        return self._up.get(address, False)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop every address but `keep` (a region removed)."""
        keep = set(keep)
        for table in (self._up, self._failures):
            for a in [a for a in table if a not in keep]:
                del table[a]


class Prober:
    """Checks `addresses` at `port` as HealthChecks say and records them in `health`;
    `on_change` is called (in the event loop) with each change."""

    def __init__(self, port: int, checks: HealthChecks, on_change: Callable[[Change], None]):
        self.port = port
        self.checks = checks.check()
        self.health = Health(checks.failure_threshold)
        self.on_change = on_change
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def check_all(self, addresses: Iterable[str]) -> None:
        """One check of each address, at once; returns when all have an outcome."""
        addresses = list(dict.fromkeys(addresses))
        outcomes = await asyncio.gather(*(self._check(a) for a in addresses))
        for a, failure in zip(addresses, outcomes, strict=True):
            self._record(a, failure)

    def watch(self, addresses: Iterable[str]) -> None:
        """Check these addresses from now on (each an interval after its last check), and no
        other."""
        want = set(addresses)
        for a in [a for a in self._tasks if a not in want]:
            self._tasks.pop(a).cancel()
        self.health.forget(want)
        for a in want - set(self._tasks):
            self._tasks[a] = asyncio.get_running_loop().create_task(self._watch(a), name=f"check {a}")

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _check(self, address: str) -> str | None:
        return await probe(address, self.port, self.checks.timeout_s)

    def _record(self, address: str, failure: str | None) -> None:
        if (change := self.health.record(address, failure)) is not None:
            self.on_change(change)

    async def _watch(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.checks.interval_s
        # while it is the address's watch: a cancel from stop() or watch() can be lost (a
        # library's wait that swallows it), and stop() would then wait for this loop forever
        while self._tasks.get(address) is asyncio.current_task():
            await asyncio.sleep(max(0.0, due - loop.time()))
            started = loop.time()
            self._record(address, await self._check(address))
            # a check that used its whole timeout (longer than the interval) is followed at once
            due = started + self.checks.interval_s
