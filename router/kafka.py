"""confluent-kafka, made to fit an asyncio service.

confluent-kafka's producer is thread-based: delivery reports arrive from
``poll()``.  AsyncProducer runs ``poll()`` on a thread and hands each report
back to the event loop, so the loop never blocks on Kafka -- not even while
Kafka is down (then reports simply do not come and the bounded AMQP prefetch
pauses intake).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from backend.errors import FedgateError
from router.lifecycle import Lifecycle

log = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, Message], None]

#: How often the poll thread looks for a stall (AsyncProducer `stall_after_s`).
STALL_CHECK_EVERY_S = 1.0
#: How long the stall check waits for Kafka's metadata: no answer means Kafka is away.
METADATA_TIMEOUT_S = 5.0
#: From this wait on, each stall check asks whether Kafka answers, so that a wait counts from
#: Kafka's return to within a check: asked only once a record had waited the whole
#: `stall_after_s`, Kafka back 10 s after the last look that found it away was taken for a
#: stall at the next look (a 30 s outage, 2026-11-30).  A record waits ~5 ms (the linger).
AWAY_PROBE_AFTER_S = 2.0


class KafkaUnavailable(FedgateError):
    """Kafka cannot be reached (retriable)."""

    retriable = True


#: Where Kafka is and how to log in: bootstrap servers alone, or a client's properties
#: (RouterSettings.kafka_client).
KafkaClient = str | Mapping[str, Any]


def client_config(client: KafkaClient) -> dict[str, Any]:
    return {"bootstrap.servers": client} if isinstance(client, str) else dict(client)


def producer_config(client: KafkaClient, **extra: Any) -> dict[str, Any]:
    """The router's producer: `client` and the delivery guarantees."""
    return {
        **client_config(client),
        # Exactly one copy per produce() in the log, in order, across retries.
        "enable.idempotence": True,
        "acks": "all",
        # One request in flight per broker.  With more, librdkafka takes a later request's
        # success as proof that an earlier one which failed in transit was stored, and reports
        # its records delivered ("implicit ack"); but a new partition leader accepts any first
        # sequence from a producer it has no state for, so when the producer's first records
        # to a partition were in flight to a leader that died, they were lost though reported
        # stored: the HA kill-every-engine test lost 1-2 readings in 2 of 20 runs so (the log
        # showed the producer's first batch on the new leader at sequence 4, 0-3 nowhere).
        "max.in.flight.requests.per.connection": 1,
        # Never give up on a record while Kafka is away: the AMQP message it
        # came from stays unacked, and intake pauses at the prefetch bound.
        "message.timeout.ms": 0,
        # A produce request every 5 ms per partition at most (the router's kafka_linger_ms).
        # The gateways' batches arrive as bursts of records that fill a request anyway, and
        # what a longer linger added was latency: 25 -> 5 ms, interleaved A/B with batching,
        # 500 devices (2026-11-30): p50 45 -> 24 ms, p99 65 -> 39 at 500/s and 68 -> 44 at
        # 2,000/s, the CPU of routers and Kafka within the runs' spread.  Unbatched (one
        # message a reading), 25 ms took Kafka 0.228 -> 0.184 cores at 500/s (2026-11-29).
        "linger.ms": 5,
        "compression.type": "lz4",
        # A producer that cached partition leaders while the broker restarted
        # can keep them stale until the next full refresh (5 min by default;
        # librdkafka issue #4976): in one full test run router-1 held 851
        # records for minutes after Kafka was back.  Refresh every 10 s.
        "topic.metadata.refresh.interval.ms": 10_000,
        **extra,
    }


def with_debug_log(config: dict[str, Any], contexts: str) -> dict[str, Any]:
    """The same client, with librdkafka's debug lines for `contexts` in the router's log
    (served by poll(), on the poll thread); unchanged when `contexts` is empty."""
    if not contexts:
        return config
    logger = logging.getLogger("librdkafka")
    logger.setLevel(logging.DEBUG)  # asked for: shown under the router's INFO level too
    return {**config, "debug": contexts, "logger": logger}


#: What only producing needs: a client that only asks for Kafka's metadata leaves them out
#: (with enable.idempotence it would ask Kafka for a producer id of its own).
PRODUCER_ONLY = {
    "enable.idempotence",
    "acks",
    "max.in.flight.requests.per.connection",
    "message.timeout.ms",
    "linger.ms",
    "compression.type",
    "batch.num.messages",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
}


def probe_config(config: dict[str, Any]) -> dict[str, Any]:
    """The producer's client settings (where Kafka is, how to log in) for a client that only
    asks whether Kafka answers."""
    return {k: v for k, v in config.items() if k not in PRODUCER_ONLY and k not in ("debug", "logger")}


def one_record_per_batch(config: dict[str, Any]) -> dict[str, Any]:
    """The same producer, but each record in a batch of its own: Kafka's verdict on a batch
    (too large, invalid) is then a verdict on that record."""
    return {**config, "batch.num.messages": 1, "linger.ms": 0}


class AsyncProducer(Lifecycle):
    """The producer, its poll thread and, with `stall_after_s`, a guard against a stall.

    A stall: a record has waited `stall_after_s` for its delivery report (delivered or
    failed), and yet Kafka answers a metadata request.  Kafka away is not one -- the
    producer rides that out, and a record's wait counts from when Kafka last was away.  A
    stalled producer stores nothing however long it waits (seen once after a Kafka restart:
    2.5 min, until the test gave up), or nothing for the partitions of one frozen broker
    while the others' records flow -- so it is the oldest record's wait that counts, not
    the time since the last report.  Then `on_stall(why)` is called, once: the router fails
    /health and exits, its shards go to the other routers, its supervisor starts a new one.
    """

    def __init__(
        self,
        config: dict[str, Any],
        on_fatal: Callable[[KafkaError], None] | None = None,
        *,
        stall_after_s: float = 0.0,
        on_stall: Callable[[str], None] | None = None,
    ):
        super().__init__()
        #: a fatal error (the idempotent producer lost its guarantees): every later record fails
        self.fatal_error: KafkaError | None = None
        self._on_fatal = on_fatal
        self._stall_after_s = stall_after_s
        self._on_stall = on_stall
        #: why the producer is taken as stalled (set once)
        self.stalled: str | None = None
        #: produce number -> when it was produced (monotonic) of the records not reported yet,
        #: kept with a guard only; the first is the oldest (a dict keeps insertion order)
        self._waiting: dict[int, float] = {}
        self._produced = 0
        #: when Kafka last left its metadata unanswered (monotonic)
        self._away_at = 0.0
        self._guard: asyncio.Task[None] | None = None
        self._producer = Producer({**config, "error_cb": self._on_error})
        self._config = config
        #: the stall guard's own client, made the first time a record waits (_brokers_answering)
        self._prober: AdminClient | None = None
        self._stop_polling = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="kafka-poll", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Reports collected during one poll() and handed to the loop in one
        # call: waking the event loop once per record would cost more than
        # the record itself.
        self._reports: list[tuple[DeliveryCallback, KafkaError | None, Message, int]] = []
        self._reports_lock = threading.Lock()

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        if self._stall_after_s:
            self._guard = self.spawn(self._watch_for_stall(), "kafka-stall-guard")

    def _on_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (on the poll thread).  Most errors are Kafka being away,
        which the producer rides out; a fatal one it cannot: the router must be restarted."""
        if not err.fatal():
            log.debug("Kafka producer: %s", err)
            return
        log.critical("Kafka producer failed for good: %s", err)
        self.fatal_error = err
        if self._on_fatal is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_fatal, err)

    def _poll_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stop_polling.is_set():
            self._producer.poll(0.05)
            if self._reports:
                with self._reports_lock:
                    batch, self._reports = self._reports, []
                loop.call_soon_threadsafe(self._dispatch, batch)

    def _dispatch(self, batch: list[tuple[DeliveryCallback, KafkaError | None, Message, int]]) -> None:
        waiting = self._waiting
        for callback, err, msg, number in batch:
            waiting.pop(number, None)
            try:
                callback(err, msg)
            except Exception:  # one bad callback must not drop the others' reports
                log.exception("delivery callback failed")

    async def _watch_for_stall(self) -> None:
        while self.stalled is None:
            await asyncio.sleep(STALL_CHECK_EVERY_S)
            await self.check_stall()

    def _oldest_produced(self) -> float | None:
        """When the oldest record not reported yet was produced (monotonic), or None."""
        return next(iter(self._waiting.values()), None)

    def oldest_wait(self) -> float:
        """Seconds the oldest record not reported yet has waited since Kafka last was away."""
        produced = self._oldest_produced()
        if produced is None:
            return 0.0
        return time.monotonic() - max(produced, self._away_at)

    async def check_stall(self) -> str | None:
        """Why the producer is stalled, or None."""
        if self.stalled is not None:
            return self.stalled
        produced = self._oldest_produced()
        if produced is None or time.monotonic() - produced < min(AWAY_PROBE_AFTER_S, self._stall_after_s):
            return None
        brokers = await asyncio.get_running_loop().run_in_executor(None, self._brokers_answering)
        if not brokers:  # Kafka away: waited out, and the wait counts from when it is back
            self._away_at = time.monotonic()
            return None
        waited = self.oldest_wait()
        if waited < self._stall_after_s:
            return None
        self.stalled = (
            f"stalled: a record has waited {waited:.0f} s for its delivery report ({len(self._waiting)} "
            f"in flight) while Kafka answers ({brokers} brokers)"
        )
        log.critical("Kafka producer %s", self.stalled)
        if self._on_stall is not None:
            self._on_stall(self.stalled)
        return self.stalled

    def _brokers_answering(self) -> int:
        """How many brokers answer a client of the guard's own.  Not the producer's handle: a
        wedged handle does not answer either, and was taken for Kafka away -- so the guard
        never fired (a suite run, 2026-11-30: after Kafka's restart one router's producer
        logged nothing more, not even a refused connect, and held two shards for minutes)."""
        if self._prober is None:
            self._prober = AdminClient(probe_config(self._config))
        try:
            return len(self._prober.list_topics(timeout=METADATA_TIMEOUT_S).brokers)
        except KafkaException:
            return 0

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None,
        headers: list[tuple[str, bytes]] | None,
        on_delivery: DeliveryCallback,
    ) -> None:
        """Queue a record; `on_delivery(err, msg)` runs on the event loop when Kafka answered."""
        assert self._loop is not None, "start() first"
        number = -1
        if self._stall_after_s:
            number = self._produced = self._produced + 1
            self._waiting[number] = time.monotonic()

        def report(err: KafkaError | None, msg: Message) -> None:
            # runs inside poll() on the poll thread, or inside flush() on another
            with self._reports_lock:
                self._reports.append((on_delivery, err, msg, number))

        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=report)
                return
            except BufferError:
                # local queue full: only possible if prefetch exceeds queue.buffering.max.messages
                self._producer.poll(0.05)

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> Message:
        """Produce and wait for the delivery report."""
        return await self.send_soon(topic, value, key, headers)

    def send_soon(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | str | None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Message]:
        """Produce now, so records keep the order of these calls; the future is the delivery report."""
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()

        def done(err: KafkaError | None, msg: Message) -> None:
            if fut.done():
                return
            if err is not None:
                fut.set_exception(KafkaException(err))
            else:
                fut.set_result(msg)

        self.produce(topic, value, key, headers, done)
        return fut

    async def flush(self, timeout: float) -> int:
        """Wait until every queued record was delivered; returns how many are still queued."""
        return await asyncio.get_running_loop().run_in_executor(None, self._producer.flush, timeout)

    def __len__(self) -> int:
        return len(self._producer)

    async def _stop(self) -> None:
        """Stop polling; flush first (see Router.stop) -- what is still queued then is lost
        to this process, and its inputs, never acked, are redelivered."""
        if self._guard is not None:
            self._guard.cancel()
        self._stop_polling.set()
        self._prober = None  # librdkafka's client ends with its last reference
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5)


def ensure_topics(
    client: KafkaClient,
    topics: list[str],
    partitions: int,
    replication: int,
    timeout: float = 30.0,
    configs: dict[str, dict[str, str]] | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; returns those created.

    Fails fast with KafkaUnavailable when Kafka cannot be reached.
    """
    config = client_config(client)
    refused: list[KafkaError] = []  # librdkafka tells a failed login only to error_cb
    admin = AdminClient(
        {
            **config,
            "error_cb": lambda err: refused.append(err) if err.code() == KafkaError._AUTHENTICATION else None,
        }
    )
    try:
        existing = set(admin.list_topics(timeout=timeout).topics)
    except KafkaException as e:
        where = config["bootstrap.servers"]
        admin.poll(0)  # serves error_cb
        if refused:
            raise KafkaUnavailable(f"Kafka at {where} refused the login: {refused[-1].str()}") from e
        raise KafkaUnavailable(f"Kafka at {where} unreachable: {e}") from e
    missing = [t for t in topics if t not in existing]
    if not missing:
        return []
    futures = admin.create_topics(
        [
            NewTopic(
                t,
                num_partitions=partitions,
                replication_factor=replication,
                config=(configs or {}).get(t, {}),
            )
            for t in missing
        ]
    )
    for _topic, fut in futures.items():
        try:
            fut.result(timeout=timeout)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    log.info("created Kafka topics %s", missing)
    return missing
