"""What every fault scenario shares: devices publishing numbered readings, and the count afterwards.

A `Fleet` publishes numbered QoS 1 readings from background threads and
keeps, per device, the sequence numbers the gateway acknowledged (PUBACK):
those are the promise.  After the fault, `read_back` reads the telemetry
topic from the start, `spark_rows` reads the analysts' `telemetry_raw` table,
and `check` counts sent, arrived, lost and duplicated, records the counts
for the run's summary, and fails on any loss.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pika.exceptions

from backend import contract as c
from backend.amqp import send_command
from backend.kafka_read import read_records
from backend.polling import wait_until
from fedgate.devices import DeviceError, SimDevice
from tests.helpers import device, record_counts


class Fleet:
    """Devices publishing numbered messages from background threads, one thread each."""

    def __init__(self, devices: Iterable[SimDevice], interval: float = 0.01):
        self.devices = list(devices)
        self.acked: dict[str, list[int]] = {d.device_id: [] for d in self.devices}
        self.stop = threading.Event()
        self.interval = interval
        self.threads = [threading.Thread(target=self._run, args=(d,), daemon=True) for d in self.devices]

    @classmethod
    def on_both_gateways(
        cls, endpoints: dict[str, Any], prefix: str, per_region: int, interval: float = 0.01
    ) -> Fleet:
        # device i on node i of its region's gateway cluster (one node: all on it)
        return cls(
            (
                device(endpoints, region, f"{prefix}-{region}-{i}", node=i)
                for region in ("local-eu", "local-us")
                for i in range(per_region)
            ),
            interval,
        )

    def _run(self, d: SimDevice) -> None:
        seq = 0
        while not self.stop.is_set():
            try:
                d.publish(f"devices/{d.device_id}/telemetry", {"seq": seq}, qos=1, timeout=60)
                self.acked[d.device_id].append(seq)
            except DeviceError:
                pass  # never acknowledged, so never promised
            seq += 1
            time.sleep(self.interval)

    def __enter__(self) -> Fleet:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)
        for d in self.devices:
            d.close()

    @property
    def total_acked(self) -> int:
        return sum(len(v) for v in self.acked.values())


def read_back(
    bootstrap: str, acked: Mapping[str, Iterable[int]], timeout: float = 90.0
) -> dict[str, list[int]]:
    """Every seq of these devices in Kafka in partition order, once each acked (device, seq)
    arrived and 3 s were quiet (a copy would arrive then), or at `timeout`.

    Not "once as many records as were acked": copies count among records, so a count could
    stop before a late record, and report it lost."""
    missing = {(dev, seq) for dev, seqs in acked.items() for seq in seqs}

    def match(msg: Any, _headers: dict[str, str]) -> bool:
        dev = (msg.key() or b"").decode(errors="replace")
        if dev not in acked:
            return False
        missing.discard((dev, json.loads(msg.value())["seq"]))
        return True

    records = read_records(
        bootstrap,
        c.KAFKA_TELEMETRY_TOPIC,
        match,
        len(missing),
        timeout=timeout,
        settle_s=3.0,
        complete=lambda: not missing,
    )
    got: dict[str, list[int]] = {d: [] for d in acked}
    WHERE.clear()  # the last read's: what check() explains
    for msg, headers in records:
        dev = (msg.key() or b"").decode()
        seq = json.loads(msg.value())["seq"]
        got[dev].append(seq)
        WHERE[(dev, seq)].append((msg.offset(), headers.get(c.KAFKA_RECEIVED_AT_HEADER, "?")))
    return got


#: (device, seq) -> [(Kafka offset, the router's receive time in ms)] of every copy read back:
#: what a disorder's message shows, for a failure seen once in a CI log to be explained
WHERE: defaultdict[tuple[str, int], list[tuple[int, str]]] = defaultdict(list)


def disorder(dev: str, seen: list[int]) -> str:
    """Where a device's first-seen sequence first goes backwards, with its neighbours' copies."""
    first_seen = list(dict.fromkeys(seen))
    i = next(i for i in range(1, len(first_seen)) if first_seen[i] < first_seen[i - 1])
    around = first_seen[max(0, i - 3) : i + 3]
    return f"{dev}: out of order in Kafka at " + ", ".join(
        f"seq {s} (offset, received_at_ms: {WHERE.get((dev, s), [])})" for s in around
    )


def spark_rows(federation, device_prefix: str, expect: int, timeout: float = 120.0) -> list[tuple[str, int]]:
    """(device, seq) of every telemetry_raw row of these devices, once `expect` rows landed (or timeout).

    Read as an analyst's notebook reads without Spark (spark/reading.py): pyiceberg through the
    job's catalog, one committed snapshot per read.  A Spark session here would boot a JVM per
    check (~30 CPU s each on a busy machine); Spark's own reads are tests/integration/test_spark.py's."""
    from pyiceberg.expressions import StartsWith
    from sqlalchemy.exc import OperationalError

    from spark.reading import open_catalog
    from spark.tables import RAW

    settings = federation.spark_settings()
    catalog = open_catalog(settings)

    def read() -> list[tuple[str, int]]:
        table = catalog.load_table(f"{settings.namespace}.{RAW.name}")  # its latest snapshot
        arrow = table.scan(
            row_filter=StartsWith("device", device_prefix), selected_fields=("device", "fields")
        )
        rows = arrow.to_arrow()
        seqs = [_as_int(dict(f or ()).get("seq")) for f in rows.column("fields").to_pylist()]
        return list(zip(rows.column("device").to_pylist(), seqs, strict=True))

    def landed() -> bool:
        try:
            return len(read()) >= expect
        except OperationalError:  # SQLite's lock while the job commits: look again
            return False

    wait_until(landed, timeout, 2)
    # a duplicate would land in a later micro-batch: the next starts within the freshness
    # target (the job's pacing) or the trigger, whichever is longer
    s = federation.settings
    time.sleep(max(s.spark_trigger_s, s.spark_freshness_target_s) + 1)
    return read()


def _as_int(value: str | None) -> Any:
    """As Spark's CAST(... AS INT) with ANSI off: None for what is not a whole number."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def resend_bound(fleet: Fleet, *, links: int = 0, routers: int = 0) -> int:
    """The most copies a fault may add to Kafka: what was on its way and unconfirmed when it
    struck, and nothing more.  A federation link that moves to another node resends at most its
    unconfirmed window (`prefetch-count`), a router that dies or loses its connection at most
    its prefetch (`max_inflight`), and each device at most the one QoS 1 publish it was waiting
    on (paho sends it again after a reconnect)."""
    from dataclasses import fields

    from backend.wiring import LINK_SETTINGS
    from router.settings import RouterSettings

    router_prefetch = next(f.default for f in fields(RouterSettings) if f.name == "max_inflight")
    link_prefetch = LINK_SETTINGS["prefetch-count"]
    assert isinstance(link_prefetch, int) and isinstance(router_prefetch, int)
    return len(fleet.devices) + links * link_prefetch + routers * router_prefetch


def check(
    fleet: Fleet,
    got: dict[str, list[int]],
    max_duplicates: int,
    *,
    spark_federation: Any = None,
    device_prefix: str = "",
    in_order: bool = True,
    **extra_counts: Any,
) -> None:
    """Count and record; fail on a lost message, disorder (unless `in_order` is False: what a
    dead gateway buffered arrives after what its devices sent elsewhere since), too many
    duplicates in Kafka, or (with `spark_federation`) a row missing from or doubled in telemetry_raw."""
    missing = duplicates = 0
    for dev, acked in fleet.acked.items():
        seen = got[dev]
        missing += len(set(acked) - set(seen))
        duplicates += len(seen) - len(set(seen))
        first_seen = list(dict.fromkeys(seen))  # order of first appearance
        assert first_seen == sorted(first_seen) or not in_order, disorder(dev, seen)
    counts: dict[str, Any] = {
        **extra_counts,
        "acked": fleet.total_acked,
        "in_kafka": sum(len(v) for v in got.values()),
        "lost": missing,
        "duplicated": duplicates,
    }
    in_kafka = {(dev, seq) for dev, seqs in got.items() for seq in seqs}
    rows: list[tuple[str, int]] = []
    if spark_federation is not None:
        # the analysts' table has each message once, duplicates in Kafka or not
        rows = spark_rows(spark_federation, device_prefix, expect=len(in_kafka))
        counts["telemetry_raw_rows"] = len(rows)
        counts["telemetry_raw_duplicated"] = len(rows) - len(set(rows))
    if missing and spark_federation is not None:
        # where the missing ones are, if anywhere: still in the backend's queues, or set aside
        counts["backend_queues_not_empty"] = backend_queue_depths(spark_federation)
    record_counts(**counts)
    assert missing == 0, f"{missing} acknowledged messages never reached Kafka"
    assert duplicates <= max_duplicates
    if spark_federation is not None:
        assert len(rows) == len(set(rows)), "telemetry_raw has a row twice"
        assert set(rows) == in_kafka, (
            f"telemetry_raw differs from Kafka: {len(in_kafka - set(rows))} missing, "
            f"{len(set(rows) - in_kafka)} extra"
        )


def backend_queue_depths(federation: Any) -> dict[str, int]:
    """The backend's queues that hold messages (uplink shards, commands, fedgate.poison)."""
    from backend.rabbitmq_admin import AdminError, prometheus_queue_messages

    node = federation.backend()
    try:
        depths = prometheus_queue_messages(f"http://{node.host}:{node.spec.ports['prometheus']}", timeout=5)
    except AdminError as e:
        return {"unknown": 0, str(e): 0}
    return {q: n for q, n in sorted(depths.items()) if n}


@dataclass(frozen=True)
class DeliveredCommands:
    """The count of a CommandSender's commands at their devices; `missing` names each lost
    one as (device, its number)."""

    received: int
    lost: int
    twice: int
    missing: tuple[tuple[str, int], ...] = ()

    def story(self, bootstrap: str, sent_at: dict[tuple[str, int], float] | None = None) -> str:
        """What the router did with each lost command, step by step, as `fedgate command <id>`
        shows it: the line a failure prints, for a loss seen once in CI to be explained."""
        from backend.command_outcomes import read_outcomes

        lines = []
        for dev, n in self.missing[:5]:
            cid = c.message_id(c.device_command_topic(dev, "set"), command_payload(n))
            when = (sent_at or {}).get((dev, n))
            sent = time.strftime(" sent %H:%M:%S", time.localtime(when)) + f".{int(when * 1000) % 1000:03d}"
            steps = read_outcomes(bootstrap, cid, wait_s=2.0)
            lines.append(
                f"{dev} command {n} (id {cid}{sent if when else ''}): "
                + ("; ".join(s.line() for s in steps) or "no step on record")
            )
        return "\n".join(lines)


def command_payload(n: int) -> bytes:
    """The payload of a CommandSender's command number `n` (its id is a hash of it)."""
    return json.dumps({"n": n}).encode()


def _command_numbers(d: SimDevice) -> list[int]:
    return [json.loads(r.payload)["n"] for r in list(d.received)]


class CommandSender(threading.Thread):
    """A backend service sending each device a numbered command, round after round."""

    def __init__(self, url: str | list[str], devices: list[str], every: float = 0.25):
        super().__init__(daemon=True)
        self.url, self.devices, self.every = url, devices, every
        self.sent: dict[str, list[int]] = {d: [] for d in devices}
        #: (device, number) -> when the backend confirmed it (epoch s)
        self.sent_at: dict[tuple[str, int], float] = {}
        #: sends the backend refused (never promised)
        self.refused = 0
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            for d in self.devices:
                # returns once the backend confirmed it: from here on it is promised.  Refused
                # (its node died, a queue's leader moves: nack) it was never promised: the
                # sender tries the next number, as a service would retry.
                try:
                    send_command(self.url, d, c.device_command_topic(d, "set"), command_payload(n))
                except (pika.exceptions.AMQPError, OSError):
                    self.refused += 1
                    continue
                self.sent[d].append(n)
                self.sent_at[(d, n)] = time.time()
            n += 1
            time.sleep(self.every)

    def delivered(self, devices: Iterable[SimDevice], timeout: float = 60.0) -> DeliveredCommands:
        """What each device received, once every confirmed command is there (or `timeout`
        passed) and a second more, for a copy to arrive."""
        devices = list(devices)
        wait_until(
            lambda: all(set(self.sent[d.device_id]) <= set(_command_numbers(d)) for d in devices),
            timeout,
            0.5,
        )
        time.sleep(1.0)  # a duplicate would arrive now
        got = {d.device_id: _command_numbers(d) for d in devices}
        missing = tuple((d, n) for d, v in got.items() for n in sorted(set(self.sent[d]) - set(v)))
        return DeliveredCommands(
            received=sum(len(v) for v in got.values()),
            lost=len(missing),
            twice=sum(len(v) - len(set(v)) for v in got.values()),
            missing=missing,
        )

    def lost_story(self, delivered: DeliveredCommands, bootstrap: str) -> str:
        """`delivered.story`, with when each lost command was confirmed by the backend."""
        return delivered.story(bootstrap, self.sent_at)

    def __enter__(self) -> CommandSender:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(30)
