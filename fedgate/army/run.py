"""Running the army: start the workers, drive the run's phases and events, count.

The parent connects every device (through the workers), starts the clock for
all of them at once, sends commands, plays the events (storm, roaming, a
gateway killed), drains, and waits (up to the drain timeout) until Kafka
has every acknowledged reading before it builds the report.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import sys
import time
from collections.abc import Callable
from typing import Any

from backend.polling import wait_until
from fedgate.army.plan import ArmyPlan
from fedgate.army.report import build_report
from fedgate.army.target import Target, federation_target
from fedgate.army.verify import CommandSender, KafkaVerifier, UncheckedVerifier
from fedgate.army.worker import WorkerConfig, worker_main
from fedgate.stats import percentiles


def run_army(
    fed: Any,
    plan: ArmyPlan,
    *,
    progress: Callable[[str], None] | None = None,
    line: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the army against the running federation `fed` (infra.local.driver.LocalFederation)."""
    plan.validate()
    say = progress or (lambda m: print(f"[army] {m}", file=sys.stderr, flush=True))
    return run_fleet(federation_target(fed, plan, say), plan, progress=say, line=line)


def run_fleet(
    target: Target,
    plan: ArmyPlan,
    *,
    progress: Callable[[str], None] | None = None,
    line: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `plan` against `target`: connect, publish and receive, then count against Kafka."""
    plan.validate()
    say = progress or (lambda m: print(f"[army] {m}", file=sys.stderr, flush=True))
    show = line or say
    specs = target.specs
    ids = [s.device_id for s in specs]
    verifier: KafkaVerifier = (
        KafkaVerifier(target.kafka_bootstrap, plan.prefix, target.kafka_topic)
        if target.verify
        else UncheckedVerifier()
    )
    verifier.start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go, stop_publishing, finish = ctx.Event(), ctx.Event(), ctx.Event()
    shared_t0 = ctx.Value("d", 0.0)
    t0 = time.time()  # until the run starts: the clock counts the connecting
    workers = []
    for w in range(min(plan.processes, len(specs))):
        cfg = WorkerConfig(w, specs[w :: plan.processes], plan, target.ca_file, target.dns)
        p = ctx.Process(
            target=worker_main, args=(cfg, out, go, shared_t0, stop_publishing, finish), name=f"army-{w}"
        )
        p.start()
        workers.append(p)
    say(f"{len(workers)} worker processes, {len(specs)} devices over {', '.join(target.regions)}")

    ticks: dict[int, dict[str, int]] = {}
    dl_recent: dict[int, list[float]] = {}
    done: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    peak_inflight = [0]

    def pump(timeout: float) -> None:
        try:
            item = out.get(timeout=timeout)
        except queue_mod.Empty:
            return
        if item[0] == "tick":
            ticks[item[1]] = item[2]
            # readings the gateways have not acknowledged yet: the devices' side of a backlog
            peak_inflight[0] = max(peak_inflight[0], total("inflight"))
            dl_recent[item[1]] = item[3]
        elif item[0] == "done":
            done[item[1]] = item[2]
        elif item[0] == "failed":
            failed[item[1]] = item[2]

    def check_workers() -> None:
        """A worker that reported a failure, or died before it could (an import error in a
        spawned process, the OOM killer), ends the run: its devices would count as silent."""
        if failed:
            raise RuntimeError(f"army worker failed: {failed}")
        dead = {p.name: p.exitcode for p in workers if p.exitcode is not None and p.exitcode != 0}
        if dead:
            raise RuntimeError(f"army worker process exited before the end of the run: {dead}")

    def total(name: str) -> int:
        return sum(t.get(name, 0) for t in ticks.values())

    def status(phase: str) -> str:
        with verifier.lock:
            lat = percentiles(verifier.latency_ms[-5000:])
            in_kafka = verifier.total
        dl = percentiles([x for v in dl_recent.values() for x in v])
        return (
            f"{phase} t={time.time() - t0:5.1f}s connected {total('connected')}/{len(specs)} "
            f"sent {total('sent')} acked {total('acked')} in-kafka {in_kafka} "
            f"cmds {commands.total if commands else 0}/{total('commands')} "
            f"up p50 {lat['p50']} p99 {lat['p99']} ms, down p99 {dl['p99']} ms"
        )

    last_line = 0.0

    def tick_line(phase: str) -> None:
        nonlocal last_line
        if time.monotonic() - last_line > 1:
            show(status(phase))
            last_line = time.monotonic()

    commands: CommandSender | None = None
    killed_at: float | None = None
    restarted = False

    def restart_killed() -> None:
        nonlocal restarted
        if plan.kill_gateway and target.restart is not None and not restarted:
            restarted = True
            say(f"starting the gateway of {plan.kill_gateway[0]} again")
            target.restart(plan.kill_gateway[0])

    try:
        # the run starts when every device is connected and, with command subscriptions, holds
        # them (its SUBACK: a gateway creating a queue per device on a loaded machine answers
        # after the CONNACKs, and a command before it would find no queue); or after two
        # minutes, with those that are
        def held() -> bool:
            if total("connected") < len(specs):
                return False
            answered = total("subscribed") + total("subscribe_refused")
            return plan.command_qos is None or answered >= len(specs)

        deadline = time.monotonic() + 120
        while not held() and time.monotonic() < deadline:
            pump(0.2)
            check_workers()
            tick_line("connecting")
        if not held():
            say(
                f"only {total('connected')} of {len(specs)} devices connected, "
                f"{total('subscribed')} subscribed in 120 s; running with them"
            )
        t0 = shared_t0.value = time.time()
        go.set()
        if plan.commands_per_s > 0 and target.commands is not None:
            commands = CommandSender(target.commands, ids, plan.commands_per_s)
            commands.start()
        end = t0 + plan.duration_s
        while time.time() < end:
            pump(0.2)
            check_workers()
            if plan.kill_gateway and killed_at is None and time.time() - t0 >= plan.kill_gateway[1]:
                if target.kill is None:
                    raise ValueError(f"{target.name}: no gateway to kill")
                say(f"killing the gateway of {plan.kill_gateway[0]} (SIGKILL)")
                target.kill(plan.kill_gateway[0])
                killed_at = time.time() - t0
            tick_line("running")
        stop_publishing.set()
        if killed_at is not None:
            # what the killed gateway acknowledged and had not passed on waits on its disk:
            # back before the drain, it reaches Kafka and counts
            restart_killed()
        if commands is not None:
            commands.stop.set()
            commands.join(30)
        say("draining: waiting for the last acknowledgements and commands")
        deadline = time.monotonic() + plan.drain_timeout_s
        while time.monotonic() < deadline:
            pump(0.2)
            # distinct commands: copies the router sent again (at least once) do not count
            if total("commands_distinct") >= (commands.total if commands else 0) and total("inflight") == 0:
                break
            tick_line("draining")
        time.sleep(plan.settle_s / 3)  # a duplicate command would arrive now
        finish.set()
        deadline = time.monotonic() + 60
        while len(done) + len(failed) < len(workers) and time.monotonic() < deadline:
            pump(0.5)
        # every acknowledged reading must be in Kafka: wait until the consumer has them all
        acked = {d: seqs for w in done.values() for d, seqs in w["acked"].items()}

        def tick_then_sleep(seconds: float) -> None:
            tick_line("draining")
            time.sleep(seconds)

        wait_until(lambda: not verifier.missing(acked), plan.drain_timeout_s, 0.5, sleep=tick_then_sleep)
        time.sleep(plan.settle_s * 2 / 3)  # a duplicate would arrive now
    finally:
        go.set()
        stop_publishing.set()
        finish.set()
        if commands is not None:
            commands.stop.set()
        # a worker exits only once its last report went down the queue's pipe: read them
        # while waiting (a report of 16,000 devices fills the pipe, and a bare join waits for ever)
        deadline = time.monotonic() + 30
        while any(p.is_alive() for p in workers) and time.monotonic() < deadline:
            pump(0.2)
        for p in workers:
            if p.is_alive():
                p.terminate()
            p.join(5)
        verifier.stop.set()
        verifier.join(10)
        if killed_at is not None:
            restart_killed()

    report = build_report(plan, target.regions, done, failed, verifier, commands, ticks, killed_at, t0)
    report["target"] = target.name
    report["uplink"]["inflight_peak"] = peak_inflight[0]
    if not target.verify:
        report["uplink"].update(in_kafka=None, lost=None, duplicated=None)
    return report
