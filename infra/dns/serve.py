"""A DNS server for devices, as one process: PowerDNS answering the zone (infra/dns/powerdns.py)
and the MQTT health checks that decide its answers (infra/dns/health.py).

    python -m infra.dns.serve --config serve.json

At start every gateway address is checked once, then the zone is written and PowerDNS started:
its first answer is already a true one.  From then on each address is checked every interval;
a change of health rewrites the zone and PowerDNS reads it again (`bind-reload-now`); then it
is one line in the log ("local-us 127.170.2.1: down (no CONNACK within 5 s, 2 checks)"), so a
line says what devices are told from then on.  The config
file changed (the local driver sends SIGHUP after a region was added or removed): it is read
again and new addresses are checked at once.  SIGTERM or SIGINT stop PowerDNS and exit 0;
PowerDNS never outlives this process (PR_SET_PDEATHSIG: a SIGKILL of it kills PowerDNS too);
PowerDNS exiting by itself ends this process with exit code 1.

The local federation's `dns` node runs it (infra/local/dns_node.py); outside AWS, run it beside
your regions with a config file of your own (docs/operations.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from infra.dns.health import Change, HealthChecks, Prober
from infra.dns.powerdns import PowerDNS, PowerDNSError
from infra.dns.zone import ZoneSpec
from infra.local.processes import die_with_parent

#: How often the loop looks at PowerDNS and the config file between signals.
TICK_S = 0.5


class ServeError(ValueError):
    """The config file cannot be read or holds a wrong value; the message names it."""


@dataclass(frozen=True)
class ServeConfig:
    """Where PowerDNS keeps its files and answers, what its zone names, how gateways are checked."""

    folder: Path
    address: str
    port: int
    zone: ZoneSpec
    checks: HealthChecks = HealthChecks()
    #: where this process serves its gateways' health for Prometheus (/metrics; 0: not served)
    metrics_port: int = 0
    #: PowerDNS's webserver, its own /metrics (0: none)
    webserver_port: int = 0

    def to_json(self) -> dict[str, Any]:
        z = self.zone
        return {
            "folder": str(self.folder),
            "address": self.address,
            "port": self.port,
            "zone": {
                "domain": z.domain,
                "regions": {r: list(a) for r, a in z.regions.items()},
                "client_networks": [[cidr, list(order)] for cidr, order in z.client_networks],
                "mqtt_port": z.mqtt_port,
                "ttl": z.ttl,
                "nameserver": z.nameserver,
            },
            "checks": dataclasses.asdict(self.checks),
            "metrics_port": self.metrics_port,
            "webserver_port": self.webserver_port,
        }

    def write(self, path: Path) -> None:
        # whole or not at all: the running server may read it at any moment
        tmp = path.with_name(path.name + ".new")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ServeConfig:
        try:
            raw = json.loads(path.read_text())
            z = raw["zone"]
            zone = ZoneSpec(
                domain=z["domain"],
                regions={r: list(a) for r, a in z["regions"].items()},
                client_networks=[(cidr, list(order)) for cidr, order in z["client_networks"]],
                mqtt_port=int(z.get("mqtt_port", 1883)),
                ttl=int(z.get("ttl", 5)),
                nameserver=z.get("nameserver", "127.0.0.1"),
            ).check()
            checks = HealthChecks(**raw.get("checks", {})).check()
            return cls(
                Path(raw["folder"]),
                raw["address"],
                int(raw["port"]),
                zone,
                checks,
                int(raw.get("metrics_port", 0)),
                int(raw.get("webserver_port", 0)),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ServeError(f"{path}: {type(e).__name__}: {e}") from e

    def addresses(self) -> list[str]:
        return [a for addresses in self.zone.regions.values() for a in addresses]


def _say(line: str) -> None:
    print(f"{time.strftime('%b %d %H:%M:%S')} {line}", flush=True)


class GatewayHealth(Collector):
    """fedgate_dns_gateway_up: each gateway address as the checks find it now, by region."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "fedgate_dns_gateway_up",
            "1 while the DNS server's MQTT checks find a gateway address healthy (it is answered), else 0.",
            labels=["region", "address"],
        )
        is_up = self.service.prober.health.is_up
        for region, addresses in self.service.config.zone.regions.items():
            for address in addresses:
                up.add_metric([region, address], 1.0 if is_up(address) else 0.0)
        yield up


class Service:
    """The running pair; `run()` returns the exit code."""

    def __init__(self, config_path: Path, say: Callable[[str], None] = _say):
        self.config_path = config_path
        self.say = say
        self.config = ServeConfig.load(config_path)
        c = self.config
        self.server = PowerDNS(c.folder, c.zone, c.address, c.port, c.webserver_port)
        self.prober = Prober(self.config.zone.mqtt_port, self.config.checks, self._changed)
        self._serial = int(time.time())
        self._config_mtime = self._mtime()
        self._dirty = asyncio.Event()
        #: health changes not in the served zone yet
        self._unsaid: list[str] = []

    def _mtime(self) -> int:
        try:
            return self.config_path.stat().st_mtime_ns
        except OSError:
            return 0

    def _next_serial(self) -> int:
        self._serial = max(self._serial + 1, int(time.time()))
        return self._serial

    def zone(self) -> ZoneSpec:
        """The configured zone with the health the checks found."""
        z, up = self.config.zone, self.prober.health.is_up
        return dataclasses.replace(z, healthy={r: [a for a in ads if up(a)] for r, ads in z.regions.items()})

    def _changed(self, change: Change) -> None:
        regions = [r for r, addresses in self.config.zone.regions.items() if change.address in addresses]
        self._unsaid.append(f"{'/'.join(regions) or '?'} {change.text(self.config.checks.timeout_s)}")
        self._dirty.set()

    def _say_served(self, lines: list[str]) -> None:
        # said once the zone holding them is served: a line in the log is what devices are told
        for line in lines:
            self.say(line)

    async def _write_zone_on_change(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            lines, self._unsaid = self._unsaid, []
            try:
                await asyncio.to_thread(self.server.reload, self.zone(), self._next_serial())
            except (PowerDNSError, OSError, subprocess.SubprocessError) as e:
                # PowerDNS still starting, or busy: the zone is written again shortly
                self.say(f"zone not reloaded ({e}); trying again in 1 s")
                self._unsaid = lines + self._unsaid
                await asyncio.sleep(1)
                self._dirty.set()
            else:
                self._say_served(lines)

    async def _reread_config(self) -> None:
        self._config_mtime = self._mtime()
        try:
            new = ServeConfig.load(self.config_path)
        except ServeError as e:
            self.say(f"config not read again, keeping the zone served: {e}")
            return
        old = self.config
        if (new.folder, new.address, new.port) != (old.folder, old.address, old.port):
            self.say("config: the server's folder, address or port changed; a restart applies them")
            new = dataclasses.replace(new, folder=old.folder, address=old.address, port=old.port)
        old_addresses = set(self.config.addresses())
        self.config = new
        self.prober.checks = new.checks
        self.prober.health.failure_threshold = new.checks.failure_threshold
        self.say(f"zone: regions {', '.join(new.zone.regions) or '(none)'}")
        await self.prober.check_all(a for a in new.addresses() if a not in old_addresses)
        self.prober.watch(new.addresses())
        self._dirty.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop, reread = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reread.set)
        c = self.config
        checks = c.checks
        self.say(
            f"checking {len(c.addresses())} gateway address(es) at MQTT port {c.zone.mqtt_port}: every "
            f"{checks.interval_s:g} s, CONNACK within {checks.timeout_s:g} s, down after "
            f"{checks.failure_threshold} failed check(s)"
        )
        if c.metrics_port:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(GatewayHealth(self))
            start_http_server(c.metrics_port, addr=c.address, registry=registry)
        await self.prober.check_all(c.addresses())
        self.server.spec = self.zone()
        self.server.write(self._next_serial())
        self._dirty.clear()  # the zone just written holds every change so far
        lines, self._unsaid = self._unsaid, []
        self._say_served(lines)
        if stop.is_set():
            return 0
        pdns = subprocess.Popen(self.server.argv(), preexec_fn=die_with_parent)
        self.prober.watch(c.addresses())
        writer = loop.create_task(self._write_zone_on_change())
        try:
            while not stop.is_set():
                waits = [loop.create_task(stop.wait()), loop.create_task(reread.wait())]
                await asyncio.wait(waits, timeout=TICK_S, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                if (code := pdns.poll()) is not None:
                    self.say(f"PowerDNS exited (exit code {code}); stopping")
                    return 1
                if reread.is_set() or self._mtime() != self._config_mtime:
                    reread.clear()
                    await self._reread_config()
            return 0
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await self.prober.stop()
            if pdns.poll() is None:
                pdns.terminate()
                try:
                    pdns.wait(10)
                except subprocess.TimeoutExpired:
                    pdns.kill()
                    pdns.wait()
            self.server.remove_socket_dir()


def main(argv: list[str] | None = None) -> int:
    # a SIGHUP before the loop listens for it must not end the process: the loop sees the
    # changed config file anyway
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    p = argparse.ArgumentParser(prog="python -m infra.dns.serve", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the JSON file ServeConfig.write writes")
    args = p.parse_args(argv)
    try:
        service = Service(args.config)
    except ServeError as e:
        print(f"infra.dns.serve: {e}", file=sys.stderr)
        return 2
    return asyncio.run(service.run())


if __name__ == "__main__":
    sys.exit(main())
