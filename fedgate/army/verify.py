"""The parent's ledgers: what each device has in Kafka, which commands were confirmed.

A run's counts are checked against these, never assumed: a reading the
gateway acknowledged must be in Kafka (KafkaVerifier), a command the next hop
confirmed must reach its device (CommandSender).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from backend import contract as c


class KafkaVerifier(threading.Thread):
    """Reads the telemetry topic from where it ended before the run: what each army device has there."""

    def __init__(self, bootstrap: str, prefix: str, topic: str = c.KAFKA_TELEMETRY_TOPIC):
        super().__init__(daemon=True, name="army-kafka")
        # imported here: the worker processes import this package and never read Kafka
        from backend import kafka_read

        self.prefix = prefix + "-"
        self.consumer = kafka_read.throwaway_consumer(bootstrap, "army")
        kafka_read.assign_from_end(self.consumer, topic)
        self.seen: dict[str, list[int]] = defaultdict(list)
        self.latency_ms: list[float] = []
        #: the device's send time (ms) of each latency sample, to leave a warm-up out
        self.sent_ms: list[float] = []
        self.total = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def missing(self, acked: dict[str, list[int]]) -> int:
        """How many of these acknowledged readings the consumer has not seen (yet)."""
        with self.lock:
            return sum(len(set(seqs) - set(self.seen.get(d, ()))) for d, seqs in acked.items())

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for msg in self.consumer.consume(1000, 0.2):
                    if msg.error():
                        continue
                    key = (msg.key() or b"").decode(errors="replace")
                    if not key.startswith(self.prefix):
                        continue
                    try:
                        body = json.loads(msg.value())
                        seq, sent_ms = int(body["seq"]), float(body["t"])
                    except (ValueError, KeyError, TypeError):
                        continue
                    with self.lock:
                        self.seen[key].append(seq)
                        self.total += 1
                        self.latency_ms.append(msg.timestamp()[1] - sent_ms)
                        self.sent_ms.append(sent_ms)
        finally:
            self.consumer.close()


class UncheckedVerifier(KafkaVerifier):
    """For a target whose readings never reach Kafka: nothing is read, nothing is checked."""

    def __init__(self) -> None:
        threading.Thread.__init__(self, daemon=True, name="army-unchecked")
        self.seen = defaultdict(list)
        self.latency_ms = []
        self.sent_ms = []
        self.total = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def missing(self, acked: dict[str, list[int]]) -> int:
        return 0

    def run(self) -> None:
        self.stop.wait()


#: Opens a downlink connection in the sender's thread: (send(device, body) -> None, close()).
CommandOpener = Callable[[], tuple[Callable[[str, bytes], None], Callable[[], None]]]


class CommandSender(threading.Thread):
    """Sends numbered commands at a steady rate; counts what the next hop confirmed."""

    def __init__(self, opener: CommandOpener, devices: list[str], per_s: float):
        super().__init__(daemon=True, name="army-commands")
        self.opener, self.devices, self.per_s = opener, devices, per_s
        self.confirmed: dict[str, list[int]] = defaultdict(list)
        #: command number -> wall-clock time it was confirmed (to place a lost one in the run)
        self.sent_at: dict[int, float] = {}
        self.total = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        link: tuple[Callable[[str, bytes], None], Callable[[], None]] | None = None
        try:
            start = time.monotonic()
            n = 0
            while not self.stop.is_set():
                due = int((time.monotonic() - start) * self.per_s)
                while n < due and not self.stop.is_set():
                    device = self.devices[n % len(self.devices)]
                    body = json.dumps({"n": n, "t": round(time.time() * 1000, 1)}).encode()
                    try:
                        # a connection that failed is opened again (to any node of a backend
                        # cluster) for the next command, as a client that outlives a node would
                        link = link or self.opener()
                        link[0](device, body)
                    except Exception as e:  # not confirmed: not promised, and reported
                        if len(self.errors) < 20:
                            self.errors.append(f"command {n} to {device}: {e}")
                        _closed(link)
                        link = None
                    else:
                        self.confirmed[device].append(n)
                        self.sent_at[n] = time.time()
                        self.total += 1
                    n += 1
                time.sleep(0.01)
        finally:
            _closed(link)


def _closed(link: tuple[Callable[[str, bytes], None], Callable[[], None]] | None) -> None:
    """Close a sender's connection, which may have died already (nothing left to close)."""
    if link is not None:
        with contextlib.suppress(Exception):
            link[1]()
