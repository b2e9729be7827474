"""A worker process of the army: thousands of paho clients on one asyncio loop.

paho is driven through its socket callbacks instead of a thread per client,
so one process holds thousands of devices; the parent starts several
(`worker_main`, spawned by fedgate.army.run) to use every core.  A worker
talks to the parent only through the queue and events it is given: counts
("tick") while it runs, every device's acknowledged readings and received
commands ("done") at the end, or why it failed ("failed").
"""

from __future__ import annotations

import asyncio
import random
import resource
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend.polling import await_until
from fedgate.army.device import ArmyDevice
from fedgate.army.plan import ArmyPlan, DeviceSpec
from fedgate.army.resolving import DnsConfig, SiteResolvers
from infra.local.processes import die_with_parent, set_descriptor_limit

REPORT_EVERY_S = 0.5


@dataclass
class WorkerConfig:
    worker: int
    specs: list[DeviceSpec]
    plan: ArmyPlan
    ca_file: str | None
    #: where devices with client networks resolve their gateway
    dns: DnsConfig | None = None


def seconds_into_run(t0: float, now: float) -> float:
    """`now` (wall clock) as seconds into the run, which begins at `t0` once every device is
    connected; 0 before then (t0 unset: 0), not seconds since the epoch."""
    return now - t0 if t0 else 0.0


class Worker:
    def __init__(self, cfg: WorkerConfig, out: Any, go: Any, t0: Any, stop_publishing: Any, finish: Any):
        self.cfg = cfg
        self.out = out
        #: set by the parent once every device is connected; t0 holds that moment (wall clock)
        self.go, self.t0 = go, t0
        #: commands sent before this worker started are an earlier run's (sent again to a QoS 0
        #: device whose acknowledgement the router never got): acknowledged, not counted
        self.born_ms = time.time() * 1000
        self.stop_publishing = stop_publishing
        self.finish = finish
        self.finishing = False
        self.loop = asyncio.get_running_loop()
        self.count: dict[str, int] = defaultdict(int)
        self.errors: list[str] = []
        self.connect_ms: list[float] = []
        self.downlink_ms: list[float] = []
        self.sites = SiteResolvers(cfg.dns) if cfg.dns else None
        self.devices = [ArmyDevice(self, s, 0) for s in cfg.specs]
        self.rng = random.Random(cfg.worker)
        #: seconds into the run of the latest connect (how long a gateway's death took to heal)
        self.last_connect_s = 0.0
        #: how long connecting every device of this worker took
        self.connect_all_s = 0.0

    def schedule_reconnect(self, d: ArmyDevice) -> None:
        # jitter so that a storm's reconnects spread over a second, as real devices' do
        delay = self.rng.uniform(0.05, 1.0) * min(8, 2 ** max(0, d.failures - 1))
        self.count["reconnects"] += 1
        self.loop.call_later(delay, d.connect)

    def now(self) -> float:
        return seconds_into_run(self.t0.value, time.time())

    async def run(self) -> None:
        plan = self.cfg.plan
        share = len(self.devices) / max(1, plan.devices)
        misc = asyncio.create_task(self._misc())
        reporter = asyncio.create_task(self._report())
        started = time.monotonic()
        await self._connect_all(plan.connect_rate * share)
        self.connect_all_s = time.monotonic() - started
        self._send_counts()
        while not self.go.is_set():  # the run starts for every worker at once
            await asyncio.sleep(0.02)
        events = asyncio.create_task(self._events())
        await self._publish(plan.rate * share)
        # stop publishing; wait for the gateway's PUBACKs, keep receiving commands until told to finish
        await await_until(lambda: not any(d.inflight for d in self.devices), plan.drain_timeout_s, 0.1)
        while not self.finish.is_set():
            await asyncio.sleep(0.1)
        self.finishing = True
        events.cancel()
        where: dict[str, int] = defaultdict(int)
        for d in self.devices:
            if d.connected:
                where[d.region or "?"] += 1
        for d in self.devices:
            if d.connected:
                d.client.disconnect()
        await asyncio.sleep(0.5)  # let the DISCONNECTs go out
        reporter.cancel()
        misc.cancel()
        self._send_counts()
        self.out.put(
            (
                "done",
                self.cfg.worker,
                {
                    "acked": {d.spec.device_id: d.acked for d in self.devices},
                    "unacked": sum(len(d.inflight) for d in self.devices),
                    "commands": {d.spec.device_id: d.commands for d in self.devices},
                    "connect_ms": self.connect_ms,
                    "connect_all_s": self.connect_all_s,
                    "downlink_ms": self.downlink_ms,
                    "errors": self.errors[:50],
                    "connected_at_end": dict(where),
                    "last_connect_s": self.last_connect_s,
                },
            )
        )

    async def _connect_all(self, per_s: float) -> None:
        interval = 1.0 / per_s if per_s > 0 else 0.0
        for d in self.devices:
            d.connect()
            if interval:
                await asyncio.sleep(interval)
        await await_until(lambda: all(d.connected for d in self.devices), 60, 0.05)

    async def _publish(self, per_s: float) -> None:
        """Publish at `per_s` over the connected devices, round robin, until told to stop."""
        start = time.monotonic()
        done = 0
        i = 0
        n = len(self.devices)
        while not self.stop_publishing.is_set():
            due = int((time.monotonic() - start) * per_s)
            tries = 0
            while done < due and tries < n:
                d = self.devices[i % n]
                i += 1
                if d.connected:
                    d.publish()
                    done += 1
                    tries = 0
                else:
                    tries += 1
            if tries >= n:  # nobody connected right now: those readings are not sent
                self.count["skipped"] += due - done
                done = due
            await asyncio.sleep(0.005)

    async def _events(self) -> None:
        plan = self.cfg.plan
        todo: list[tuple[float, Callable[[], None]]] = []
        if plan.storm_at_s is not None:
            todo.append((plan.storm_at_s, self._storm))
        if plan.roam_at_s is not None:
            todo.append((plan.roam_at_s, self._roam))
        for at, action in sorted(todo, key=lambda x: x[0]):
            await asyncio.sleep(max(0.0, at - self.now()))
            action()

    def _storm(self) -> None:
        self.count["storm_dropped"] += sum(d.connected for d in self.devices)
        for d in self.devices:
            d.drop()

    def _roam(self) -> None:
        movers = self.devices[: int(len(self.devices) * self.cfg.plan.roam_share)]
        for d in movers:
            if d.can_roam:
                d.roam()
                self.count["roamed"] += 1

    async def _misc(self) -> None:
        # keepalive and retransmission timers of every client, once a second
        while True:
            await asyncio.sleep(1.0)
            for d in self.devices:
                if d.connected or d.connecting:
                    d.client.loop_misc()

    def _send_counts(self) -> None:
        counts = dict(self.count)
        counts["connected"] = sum(d.connected for d in self.devices)
        counts["inflight"] = sum(len(d.inflight) for d in self.devices)
        counts["dns_questions"] = self.sites.questions if self.sites else 0
        self.out.put(("tick", self.cfg.worker, counts, self.downlink_ms[-2000:]))

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            self._send_counts()


def _descriptors_for(devices: int) -> None:
    """A socket per device, and some to spare."""
    want = devices + 256
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < want:
        set_descriptor_limit(want)


def worker_main(cfg: WorkerConfig, out: Any, go: Any, t0: Any, stop_publishing: Any, finish: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    die_with_parent()  # however the parent ends: no army left holding connections
    _descriptors_for(len(cfg.specs))

    async def main() -> None:
        await Worker(cfg, out, go, t0, stop_publishing, finish).run()

    try:
        asyncio.run(main())
    except Exception as e:  # reported, never silent: the parent counts this worker's devices as failed
        out.put(("failed", cfg.worker, f"{type(e).__name__}: {e}"))
        raise
