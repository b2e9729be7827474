"""Router benchmark: bridged messages/s per router process, and downlink latency.

Measured side by side in one run, on the benchmarks' federation (bench/suite.py)
with its own routers and Spark job stopped, so that the router measured is alone:

uplink, per router process (AMQP in -> Kafka out -> ack after the delivery report)
  - reference "kafka produce": the same N records produced from Python with the
    router's producer settings (idempotent, acks=all, lz4): Kafka's ceiling here
  - reference "amqp consume+ack": the same N messages consumed from the shard
    queues with aio-pika and acked, nothing else: RabbitMQ's ceiling here
  - fedgate router: N messages preloaded into the shard queues, one router
    process started; time from ready to the last record acknowledged by Kafka
downlink latency (command handed to the backend -> MQTT device receives it)
  - reference "direct": published straight to the region's downlink exchange
  - fedgate router: published to fedgate.commands; the router looks up presence
    and forwards

Ratios (router / reference) are the headline. A second, smaller router run
under cProfile shows where the time goes.
"""

from __future__ import annotations

import asyncio
import json
import os
import pstats
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import aiormq.abc
from confluent_kafka import Producer
from pamqp.commands import Basic

from backend import contract as c
from backend import uplink_batch
from backend.polling import wait_until
from fedgate.devices import SimDevice
from fedgate.stats import percentile
from infra.local import processes
from infra.local.driver import LocalFederation
from infra.local.settings import PROJECT_ROOT
from infra.local.toml_out import to_toml
from router.kafka import ensure_topics, producer_config

PAYLOAD = json.dumps({"seq": 0, "temp_c": 21.5, "humidity": 40.1, "sent_at": 1.0, "pad": "x" * 40}).encode()
DEVICES = 1000
#: The batched run: what a gateway's batcher sends at 8,000 readings/s (the sustained-rate
#: goal): 25 ms of them over its 4 buckets.  A backlog fills batches to 500.
READINGS_PER_BATCH = 50
BATCH_BUCKETS = 4


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- references -------------------------------------------------------------------


def kafka_produce(bootstrap: str, n: int) -> float:
    """Records/s producing n records with the router's producer settings."""
    ensure_topics(bootstrap, ["bench.raw"], 6, 1)
    p = Producer(producer_config(bootstrap))
    delivered = 0

    def report(err: Any, msg: Any) -> None:
        nonlocal delivered
        if err is None:
            delivered += 1

    t0 = time.perf_counter()
    for i in range(n):
        while True:
            try:
                p.produce("bench.raw", PAYLOAD, f"d{i % DEVICES}", on_delivery=report)
                break
            except BufferError:
                p.poll(0.01)
        if i % 1000 == 0:
            p.poll(0)
    p.flush(60)
    elapsed = time.perf_counter() - t0
    assert delivered == n, f"kafka reference: {delivered}/{n} delivered"
    return n / elapsed


async def preload(url: str, n: int, per_batch: int = 1) -> None:
    """Publish n device readings into the backend's telemetry exchange as federation would:
    one a message, or `per_batch` a message packed as a gateway's batcher packs them
    (backend/uplink_batch.py; a device's readings always in its bucket's batch)."""
    conn = await aio_pika.connect(url)
    ch = await conn.channel(publisher_confirms=True)
    ex = await ch.get_exchange(c.TELEMETRY_EXCHANGE)
    hop = c.UPLINK_BATCHES_EXCHANGE if per_batch > 1 else "amq.topic"
    headers = {c.RECEIVED_FROM_HEADER: [{"cluster-name": "local-eu", "exchange": hop}]}
    props = Basic.Properties(delivery_mode=2, headers={"x-mqtt-publish-qos": 1})
    buckets: dict[int, list[uplink_batch.Reading]] = {}
    pending: list[Any] = []

    def batch_of(bucket: int, readings: list[uplink_batch.Reading]) -> Any:
        msg = aio_pika.Message(
            uplink_batch.encode(readings),
            headers=headers,
            content_type=uplink_batch.BATCH_CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        return ex.publish(msg, routing_key=f"{c.UPLINK_BATCH_KEY_PREFIX}.local-eu.{bucket}")

    for i in range(n):
        device = i % DEVICES
        if per_batch == 1:
            msg = aio_pika.Message(PAYLOAD, headers=headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            pending.append(ex.publish(msg, routing_key=f"devices.d{device}.telemetry"))
        else:
            bucket = device % BATCH_BUCKETS
            readings = buckets.setdefault(bucket, [])
            readings.append(uplink_batch.Reading(f"devices.d{device}.telemetry", PAYLOAD, props))
            if len(readings) >= per_batch:
                pending.append(batch_of(bucket, readings))
                buckets[bucket] = []
        if len(pending) >= 2000:
            await asyncio.gather(*pending)
            pending = []
    pending += [batch_of(b, readings) for b, readings in buckets.items() if readings]
    await asyncio.gather(*pending)
    await conn.close()


async def amqp_consume(url: str, n: int, shards: int, prefetch: int) -> float:
    """Messages/s consuming and acking n messages from the shard queues, nothing else.

    Acks are coalesced (one multiple-ack per 256 messages), as the router does.
    """
    conn = await aio_pika.connect(url)
    ch = await conn.channel()
    await ch.set_qos(prefetch_count=prefetch // shards)
    done = asyncio.Event()
    count = 0

    async def on_message(m: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal count
        count += 1
        if count % 256 == 0 or count >= n:
            await m.ack(multiple=True)
        if count >= n:
            done.set()

    t0 = time.perf_counter()
    for s in range(shards):
        q = await ch.get_queue(c.uplink_shard_queue(s))
        await q.consume(on_message)
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - t0
    await conn.close()
    return n / elapsed


async def aiormq_consume(url: str, n: int, shards: int, prefetch: int) -> float:
    """As amqp_consume, with aiormq alone (the protocol layer under aio-pika)."""
    conn = await aiormq.connect(url)
    ch = await conn.channel()
    await ch.basic_qos(prefetch_count=prefetch // shards)
    done = asyncio.Event()
    count = 0

    async def on_message(m: aiormq.abc.DeliveredMessage) -> None:
        nonlocal count
        count += 1
        if count % 256 == 0 or count >= n:
            await ch.basic_ack(m.delivery.delivery_tag, multiple=True)  # type: ignore[union-attr]
        if count >= n:
            done.set()

    t0 = time.perf_counter()
    for s in range(shards):
        await ch.basic_consume(c.uplink_shard_queue(s), on_message)
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - t0
    await conn.close()
    return n / elapsed


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (FileNotFoundError, IndexError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def consume_with_cpu(fed: LocalFederation, fn: Any, n: int) -> dict[str, float]:
    """Rate of a consume reference, and the CPU it cost in Python and in RabbitMQ, per message."""
    url = fed.endpoints()["backend"]["url"]
    asyncio.run(preload(url, n))
    broker = processes.marked_pids(processes.marker(fed.state_dir, "backend"))
    b0, p0 = cpu_seconds(broker), cpu_seconds([os.getpid()])
    rate = asyncio.run(fn(url, n, fed.settings.uplink_shards, 2000))
    b1, p1 = cpu_seconds(broker), cpu_seconds([os.getpid()])
    return {
        "per_s": round(rate),
        "python_us_per_msg": round((p1 - p0) / n * 1e6, 1),
        "rabbitmq_us_per_msg": round((b1 - b0) / n * 1e6, 1),
    }


# --- the router ---------------------------------------------------------------------


def write_router_config(fed: LocalFederation, path: Path, port: int, *, downlink: bool) -> None:
    ep, sec = fed.endpoints(), fed.secrets()
    host = ep["host"]
    cfg: dict[str, Any] = {
        "amqp_url": f"amqp://{c.ROUTER_USER}:{sec['router']}@{host}:{ep['backend']['amqp']}/%2F",
        "kafka_bootstrap": ep["kafka"]["bootstrap"],
        "metrics_host": host,
        "metrics_port": port,
        "router_id": "bench-router",
        "uplink_shards": fed.settings.uplink_shards,
        "downlink": downlink,
        "uplink": not downlink,
    }
    lines = [f"{k} = {to_toml(v)}" for k, v in cfg.items()]
    for region, g in ep["gateways"].items():
        lines += [
            f"[gateways.{region}]",
            f'management_url = "http://{host}:{g["management"]}"',
            f'user = "{c.ADMIN_USER}"',
            f'password = "{sec["admin"]}"',
        ]
    path.write_text("\n".join(lines) + "\n")


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in r.read().decode().splitlines()
            if line.startswith(name) and not line.startswith("#")
        )


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    if not wait_until(healthy, timeout, 0.05):
        raise TimeoutError("router not ready")


def start_router(config: Path, log: Path, profile: Path | None = None) -> subprocess.Popen[bytes]:
    argv = [sys.executable]
    if profile is not None:
        argv += ["-m", "cProfile", "-o", str(profile)]
    argv += ["-m", "router", "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    with open(log, "ab") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    processes.stop_child(proc, grace=60)


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent busy so far (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def router_bridge(
    fed: LocalFederation,
    workdir: Path,
    n: int,
    port: int,
    profile: Path | None = None,
    *,
    per_batch: int = 1,
) -> dict[str, float]:
    """Bridged readings/s of one router process draining n preloaded readings (one a message,
    or `per_batch` a message as gateways batch them), and the CPU µs a reading each part spent
    meanwhile: the router process (its librdkafka threads included), the backend's RabbitMQ,
    Kafka, and the whole machine -- whether the router is held back by its own CPU or by the
    cores the brokers beside it take."""
    config = workdir / "router-uplink.toml"
    write_router_config(fed, config, port, downlink=False)
    url = fed.endpoints()["backend"]["url"]
    asyncio.run(preload(url, n, per_batch))
    started = time.perf_counter()
    proc = start_router(config, workdir / "router.log", profile)
    parts = {
        "rabbitmq": processes.marked_pids(processes.marker(fed.state_dir, "backend")),
        "kafka": processes.marked_pids(fed.kafka().marker),
    }
    try:
        wait_ready(port, proc)
        parts["router"] = [proc.pid]
        cpu0 = {name: cpu_seconds(pids) for name, pids in parts.items()}
        busy0 = machine_busy_seconds()
        t0 = time.perf_counter()
        # what it bridged before it answered ready is not on the clock: a batched run lasts
        # seconds, and the router starts reading before its first health check passes
        before = metric(port, "fedgate_router_bridged_total")
        while True:
            done = metric(port, "fedgate_router_bridged_total")
            if done >= n:
                break
            if time.perf_counter() - t0 > 600:
                raise TimeoutError(f"router bridged only {done}/{n} in 600 s")
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        timed = n - before
        if timed < n / 2:  # most of it went before ready (a short run, a slow machine):
            elapsed, timed = time.perf_counter() - started, n  # the clock from the start
        out = {"per_s": round(timed / elapsed), "bridged_before_ready": before}
        for name, pids in parts.items():
            out[f"{name}_us_per_msg"] = round((cpu_seconds(pids) - cpu0[name]) / timed * 1e6, 1)
        out["machine_cores_busy"] = round((machine_busy_seconds() - busy0) / elapsed, 2)
        return out
    finally:
        stop_router(proc)


# --- downlink latency ------------------------------------------------------------------


def downlink_latency(fed: LocalFederation, workdir: Path, n: int, rate: float, port: int) -> dict[str, Any]:
    ep = fed.endpoints()
    config = workdir / "router-downlink.toml"
    write_router_config(fed, config, port, downlink=True)
    proc = start_router(config, workdir / "router.log")
    secret = fed.add_devices(["bench-dev"], rotate=True)["bench-dev"]
    topic = c.device_command_topic("bench-dev", "ping")
    dev: SimDevice | None = None
    try:
        wait_ready(port, proc)
        # connected once the router is ready: it learns of the device from the connect event
        dev = SimDevice(
            "bench-dev",
            ep["gateways"]["local-eu"]["address"],
            ep["gateways"]["local-eu"]["mqtt"],
            "bench-dev",
            secret,
        )
        dev.connect().subscribe(c.device_command_topic("bench-dev", "#"))
        if not wait_until(lambda: _present(port, "bench-dev"), 15, 0.05):
            raise TimeoutError("downlink: the router did not see bench-dev connect within 15 s")
        out = {}
        for mode in ("direct", "router"):
            dev.received.clear()
            asyncio.run(_send_commands(ep["backend"]["url"], mode, topic, n, rate))
            got = dev.wait_for(n, timeout=60)
            lat = [(r.at - json.loads(r.payload)["t"]) * 1000 for r in got]
            out[mode] = {
                "sent": n,
                "received": len(got),
                "p50_ms": percentile(lat, 0.50),
                "p99_ms": percentile(lat, 0.99),
            }
        return out
    finally:
        if dev is not None:
            dev.close()
        stop_router(proc)


def _present(port: int, device: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/presence?device={device}", timeout=5) as r:
        return bool(json.load(r)["devices"])


async def _send_commands(url: str, mode: str, topic: str, n: int, rate: float) -> None:
    conn = await aio_pika.connect(url)
    ch = await conn.channel(publisher_confirms=True)
    if mode == "direct":
        ex = await ch.get_exchange(c.downlink_exchange("local-eu"))
        key = c.mqtt_topic_to_routing_key(topic)
    else:
        ex = await ch.get_exchange(c.COMMANDS_EXCHANGE)
        key = "bench-dev"
    interval = 1.0 / rate
    start = time.perf_counter()
    for i in range(n):
        body = json.dumps({"i": i, "t": time.time()}).encode()
        headers = {} if mode == "direct" else {c.DEVICE_HEADER: "bench-dev", c.TOPIC_HEADER: topic}
        await ex.publish(aio_pika.Message(body, headers=headers), routing_key=key)
        delay = start + (i + 1) * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await conn.close()


# --- the run ---------------------------------------------------------------------------


def top_functions(profile: Path, limit: int = 12) -> list[dict[str, Any]]:
    stats = pstats.Stats(str(profile))
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in sorted(
        stats.stats.items(),
        key=lambda kv: kv[1][2],
        reverse=True,  # type: ignore[attr-defined]
    )[:limit]:
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})",
                "calls": ncalls,
                "self_s": round(tottime, 3),
                "self_pct": round(100 * tottime / total, 1),
                "cum_s": round(cumtime, 3),
            }
        )
    return rows


#: The federation's own routers would drain the shard queues beside the one measured.
SERVICES = {"routers": False, "spark": False}
BENCH_ROUTER_PORT_OFFSET = 50


def run(fed: LocalFederation, workdir: Path, quick: bool = False) -> dict[str, Any]:
    n = 10_000 if quick else 100_000
    n_profile = 5_000 if quick else 30_000
    n_cmd, rate = (100, 100.0) if quick else (2000, 200.0)
    base = fed.settings.port_base
    results: dict[str, Any] = {
        "quick": quick,
        "messages": n,
        "payload_bytes": len(PAYLOAD),
        "machine": {"cpus": os.cpu_count()},
    }
    ep = fed.endpoints()
    # clear of the federation's routers (+30...) and Spark ports (+40, +41)
    router_port = base + BENCH_ROUTER_PORT_OFFSET
    progress(f"reference: Kafka produce of {n} records")
    results["kafka_produce_raw_per_s"] = round(kafka_produce(ep["kafka"]["bootstrap"], n))
    progress(f"reference: AMQP consume+ack of {n} messages (aio-pika, then aiormq alone)")
    pika_ref = consume_with_cpu(fed, amqp_consume, n)
    results["amqp_consume_raw_per_s"] = pika_ref["per_s"]
    results["amqp_consume_cpu"] = {
        "aio-pika": pika_ref,
        "aiormq": consume_with_cpu(fed, aiormq_consume, n),
    }
    progress(f"fedgate router: bridging {n} messages with one process")
    bridged = router_bridge(fed, workdir, n, router_port)
    results["router_bridged_per_s"] = bridged["per_s"]
    results["router_bridge_cpu"] = bridged
    ref = min(results["kafka_produce_raw_per_s"], results["amqp_consume_raw_per_s"])
    results["router_vs_slowest_reference"] = round(results["router_bridged_per_s"] / ref, 3)
    results["router_vs_kafka_produce"] = round(
        results["router_bridged_per_s"] / results["kafka_produce_raw_per_s"], 3
    )
    results["router_vs_amqp_consume"] = round(
        results["router_bridged_per_s"] / results["amqp_consume_raw_per_s"], 3
    )
    progress(f"fedgate router: bridging {5 * n} readings in batches of {READINGS_PER_BATCH} with one process")
    # five times the readings: a tenth of the messages, and seconds enough to time
    batched = router_bridge(fed, workdir, 5 * n, router_port, per_batch=READINGS_PER_BATCH)
    results["router_batched"] = {"readings_per_batch": READINGS_PER_BATCH, **batched}
    # the path the federation takes by default: readings in batches
    progress(f"profiling the router on {5 * n_profile} readings in batches of {READINGS_PER_BATCH}")
    prof = workdir / "router.prof"
    router_bridge(fed, workdir, 5 * n_profile, router_port, profile=prof, per_batch=READINGS_PER_BATCH)
    results["router_profile_top"] = top_functions(prof) if prof.exists() else []
    progress(f"downlink latency: {n_cmd} commands at {rate:g}/s, direct and through the router")
    results["downlink"] = downlink_latency(fed, workdir, n_cmd, rate, router_port)
    d = results["downlink"]
    if d["direct"]["p99_ms"] and d["router"]["p99_ms"]:
        results["downlink_p99_router_vs_direct"] = round(d["router"]["p99_ms"] / d["direct"]["p99_ms"], 2)
    return results


def to_markdown(r: dict[str, Any]) -> str:
    d = r.get("downlink", {})
    lines = [
        f"# Router benchmark ({'quick' if r['quick'] else 'full'}: {r['messages']} messages of "
        f"{r['payload_bytes']} B, {r['machine']['cpus']} cores)",
        "",
        "| uplink, one process | msgs/s | router / this |",
        "|---|---:|---:|",
        "| reference: Kafka produce from Python (router's producer settings) | "
        f"{r['kafka_produce_raw_per_s']:,} | {r['router_vs_kafka_produce']} |",
        f"| reference: AMQP consume + ack, aio-pika | {r['amqp_consume_raw_per_s']:,} | "
        f"{r['router_vs_amqp_consume']} |",
        "| reference: AMQP consume + ack, aiormq alone (the layer under aio-pika) | "
        f"{r['amqp_consume_cpu']['aiormq']['per_s']:,} | "
        f"{round(r['router_bridged_per_s'] / r['amqp_consume_cpu']['aiormq']['per_s'], 3)} |",
        "| **fedgate router** (AMQP in -> Kafka out -> ack after delivery) | "
        f"**{r['router_bridged_per_s']:,}** | 1 |",
    ]
    bt = r.get("router_batched")
    if bt:
        lines.append(
            f"| **fedgate router, the readings in the gateways' batches** ({bt['readings_per_batch']} a "
            f"message), readings/s | **{bt['per_s']:,}** | |"
        )
    lines += [
        "",
        "| downlink (command -> device) | sent | received | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in ("direct", "router"):
        if mode in d:
            x = d[mode]
            lines.append(f"| {mode} | {x['sent']} | {x['received']} | {x['p50_ms']} | {x['p99_ms']} |")
    cpu = r.get("amqp_consume_cpu", {})
    lines += [
        "",
        "CPU per message while only consuming (Python client vs RabbitMQ):",
        "",
        "| client | Python µs/msg | RabbitMQ µs/msg |",
        "|---|---:|---:|",
    ]
    for name, x in cpu.items():
        lines.append(f"| {name} | {x['python_us_per_msg']} | {x['rabbitmq_us_per_msg']} |")
    b = r.get("router_bridge_cpu")
    if b:
        lines += [
            "",
            f"CPU per message while the router bridged ({b['machine_cores_busy']} of the machine's "
            f"{r['machine']['cpus']} cores busy):",
            "",
            "| router process | RabbitMQ | Kafka |",
            "|---:|---:|---:|",
            f"| {b['router_us_per_msg']} µs | {b['rabbitmq_us_per_msg']} µs | {b['kafka_us_per_msg']} µs |",
        ]
    if bt:
        lines += [
            "",
            f"CPU per reading while the router bridged batches ({bt['machine_cores_busy']} cores busy):",
            "",
            "| router process | RabbitMQ | Kafka |",
            "|---:|---:|---:|",
            f"| {bt['router_us_per_msg']} µs | {bt['rabbitmq_us_per_msg']} µs "
            f"| {bt['kafka_us_per_msg']} µs |",
        ]
    lines += [
        "",
        "Where the router's time goes, bridging batches (cProfile, self time, its main thread):",
        "",
        "| function | calls | self s | self % |",
        "|---|---:|---:|---:|",
    ]
    for row in r.get("router_profile_top", []):
        lines.append(f"| `{row['function']}` | {row['calls']} | {row['self_s']} | {row['self_pct']} |")
    return "\n".join(lines) + "\n"
