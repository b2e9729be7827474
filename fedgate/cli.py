"""`fedgate`: the command line that runs and inspects a fedgate federation.

    fedgate up                 start the local federation (idempotent)
    fedgate down [--purge]     stop it; --purge also deletes its state folder
    fedgate status [--json]    one line per node: role, region, ports, state, load
    fedgate demo               up, then a scripted scene with MQTT devices
    fedgate send DEV TOPIC MSG [--retain]   a message to a device, through the router; prints its id
                               [--wait [--timeout S] [--answer]]: follows it until delivered,
                               acknowledged, answered or dead-lettered
    fedgate command ID [--wait [--timeout S]]   what the router did with that command, step by step
    fedgate presence [DEV]     where devices are connected
    fedgate gateway add|remove REGION [--auto-approve]
                               a region joins or leaves: local-NAME runs here,
                               an AWS region (eu-west-1) is stamped out by Terraform
    fedgate regions            the regions (local and cloud) and their gateways
    fedgate devices add ID... [--rotate] [--json]   issue each device its secret (shown once)
    fedgate devices revoke ID...   the device can no longer connect; its connections close
    fedgate devices list       the registered devices
    fedgate devices sync       make every gateway's devices (local and cloud) the registry's again
    fedgate backend-tls        the cloud backend module's TLS inputs, as a tfvars file
    fedgate army [--devices N --rate R --duration S ...] [--json]
                               simulated devices against the running federation, counted end to end
    fedgate query SQL|NAME     Spark SQL over the analysts' tables (--list: named queries)
    fedgate recompute --since D --until D   rebuild the aggregates from telemetry_raw

Settings come from the environment (FEDGATE_*) and fedgate.toml; see
`fedgate settings` and docs/operations.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import importlib.metadata
import json
import logging
import os
import re
import signal
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backend.devices import DeviceRegistryError
from backend.errors import FedgateError
from fedgate.failures import (
    DEBUG_ENV,
    Exit,
    Refused,
    TimedOut,
    Usage,
    exit_codes_help,
    explain,
    output_closed,
    reaching,
    require_listening,
)
from infra.device_registry import DeviceRegistry
from infra.local.dns_node import DnsNode
from infra.local.driver import LocalFederation, NodeStatus
from infra.local.processes import sigterm_as_interrupt
from infra.local.settings import LocalSettings, describe_settings, load_settings
from infra.local.status import format_clusters
from infra.regions import RegionDriver, RegionRow, all_drivers, driver_for, format_status
from infra.releases import ICEBERG_RELEASE

log = logging.getLogger("fedgate.cli")

__all__ = ["Context", "build_parser", "format_status", "main", "parse_args"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: How long --wait follows a command when no --timeout is given.
DEFAULT_WAIT_S = 30.0
#: `count-now`'s wait: the first count of a job just started reads back the batches its
#: predecessor left uncounted in a cold JVM (28-61 s measured on a loaded 2-core machine)
COUNT_NOW_WAIT_S = 120.0


def _progress(msg: str) -> None:
    print(f"[fedgate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number of seconds")
    return value


def _region_at_seconds(text: str) -> tuple[str, float]:
    region, _, at = text.partition("@")
    try:
        seconds = float(at) if at else 10.0
    except ValueError:
        seconds = -1.0
    if not region or not seconds >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: REGION@SECONDS, e.g. local-eu@10 (seconds into the run)")
    return region, seconds


def _date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a date like 2026-11-22") from None


def _version() -> str:
    try:
        return importlib.metadata.version("fedgate")
    except importlib.metadata.PackageNotFoundError:
        # a checkout never installed: the version its next build carries
        with (PROJECT_ROOT / "pyproject.toml").open("rb") as f:
            return str(tomllib.load(f)["project"]["version"])


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


class _VersionAction(argparse.Action):
    """--version, its line composed only when asked for (it reads files)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(_version_line())
        parser.exit()


def _version_line() -> str:
    """fedgate's version and the engines' it runs and was tested with (the defaults of
    its settings, and the Iceberg runtime `make setup` fetches): what a bug report needs."""
    defaults = {f.name: f.default for f in dataclasses.fields(LocalSettings)}
    engines = [
        f"RabbitMQ {defaults['rabbitmq_release']}",
        f"Kafka {defaults['kafka_version']}",
        f"Spark {_installed('pyspark')}",
        f"Iceberg {ICEBERG_RELEASE}",
    ]
    return f"fedgate {_version()} ({', '.join(engines)}; Python {sys.version.split()[0]})"


def _wait_seconds(args: argparse.Namespace) -> float | None:
    """How long --wait follows a command; None: not at all. --timeout and --answer imply it."""
    if args.wait or args.timeout is not None or getattr(args, "answer", False):
        return float(args.timeout or DEFAULT_WAIT_S)
    return None


#: `--wait 30` as it was written before --timeout: seconds right after --wait.
_SECONDS = re.compile(r"-?(\d+\.?\d*|\.\d+)")


def _wait_seconds_as_timeout(argv: Sequence[str]) -> list[str]:
    """`--wait S` and `--wait=S`, the older form, as `--wait --timeout S`.

    --wait took an optional value and so swallowed the device id of `send --wait DEV TOPIC MSG`;
    it is a flag now, and only a number right after it is still read as its seconds."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        if arg.startswith("--wait="):
            out += ["--wait", "--timeout", arg.removeprefix("--wait=")]
        elif arg == "--wait" and i + 1 < len(args) and _SECONDS.fullmatch(args[i + 1]):
            out += ["--wait", "--timeout", args[i + 1]]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def _confirm(prompt: str) -> bool:
    if not sys.stdin.isatty():
        _progress("no terminal to confirm on; pass --auto-approve (make ... AUTO_APPROVE=1)")
        return False
    return input(prompt).strip() == "yes"


class Context:
    """What the commands work with, built once by main.

    The settings are read up front; the local federation, the region drivers
    and the device registry are made on first use, so a command builds only
    what it needs (`query`, `recompute` and `settings` no federation object).
    """

    def __init__(self, settings: LocalSettings):
        self.settings = settings

    @functools.cached_property
    def fed(self) -> LocalFederation:
        return LocalFederation(self.settings, progress=_progress)

    def driver_for(self, region: str) -> RegionDriver:
        """The driver of the region's kind (infra/regions.py); InvalidRegionError for a bad name."""
        return driver_for(region, self.settings, progress=_progress, confirm=_confirm)

    @functools.cached_property
    def drivers(self) -> list[RegionDriver]:
        """One driver of every kind of region, local first."""
        return all_drivers(self.settings, progress=_progress, confirm=_confirm)

    @functools.cached_property
    def device_registry(self) -> DeviceRegistry:
        return DeviceRegistry(self.settings.device_registry_file)

    def spark_settings(self) -> Any:
        """Settings for a Spark session beside the local job's warehouse (infra/local/configs.py)."""
        from infra.local import configs
        from infra.local.layout import StateFiles

        return configs.spark_settings(StateFiles(self.settings.state_dir))


def status_json(fed: LocalFederation, rows: list[NodeStatus]) -> dict[str, Any]:
    return {
        "state_dir": str(fed.state_dir),
        "secrets_file": str(fed.secrets_file),
        "nodes": [r.to_json() for r in rows],
        "clusters": [cl.to_json() for cl in fed.clusters(rows)],
        # what the DNS server answers each region's devices now
        "dns": {n.name: n.answers() for n in fed.nodes() if isinstance(n, DnsNode) and n.is_running()},
    }


def cmd_up(ctx: Context, args: argparse.Namespace) -> int:
    rows = ctx.fed.up()
    print(format_status(rows))
    return 0


def cmd_down(ctx: Context, args: argparse.Namespace) -> int:
    killed = ctx.fed.down(purge=args.purge)
    left = ctx.fed.leftover_pids()
    if left:
        _progress(f"error: processes still running after down: {left}")
        return 1
    if killed:
        _progress(f"warning: had to kill {len(killed)} process(es) that ignored SIGTERM")
    return 0


def cmd_status(ctx: Context, args: argparse.Namespace) -> int:
    rows = ctx.fed.status()
    if args.json:
        print(json.dumps(status_json(ctx.fed, rows), indent=2))
    elif rows:
        print(format_status(rows))
        print()
        print(format_clusters(ctx.fed.clusters(rows)))
        for node in ctx.fed.nodes():
            if isinstance(node, DnsNode):
                print(node.status_line())
    return Exit.OK if all(r.state == "running" for r in rows) else Exit.NOT_RUNNING


def cmd_demo(ctx: Context, args: argparse.Namespace) -> int:
    from fedgate.demo import run_demo

    return run_demo(ctx.fed, progress=_progress)


def cmd_send(ctx: Context, args: argparse.Namespace) -> int:
    from backend import contract as c
    from backend.amqp import check_command_size, send_command
    from backend.command_outcomes import follow

    if args.device not in ctx.fed.device_registry.devices():
        # the router would dead-letter it: no device of that id can ever take it
        raise Refused(
            f"device {args.device!r} is not registered (fedgate devices add {args.device})",
            "the router would dead-letter a command to it",
        )
    try:
        check_command_size(args.payload)
    except FedgateError as e:
        raise Refused(str(e)) from e
    wait_s = _wait_seconds(args)
    if wait_s is not None and args.retain:
        raise Usage(
            "--wait follows one command to one device, and desired state (--retain) is kept, not followed",
            "leave out one of them",
        )
    ep = ctx.fed.endpoints()
    url = ep["backend"]["url"]
    if wait_s is None:
        with reaching("the backend", url):
            send_command(
                url, args.device, args.topic, args.payload, retain=args.retain, expires_in_s=args.expires_in
            )
        command_id = c.message_id(args.topic, args.payload.encode())
        print(
            f"command {command_id} handed to the router: {args.device} {args.topic}"
            + (" (desired state)" if args.retain else "")
        )
        print(f"follow it: fedgate command {command_id}")
        return Exit.OK
    require_listening("Kafka", ep["kafka"]["bootstrap"])
    wanted = "its answer" if args.answer else "its outcome"
    print(f"handed to the router: {args.device} {args.topic}; following {wanted} for up to {wait_s:g} s")
    with reaching("the backend", url):
        end = follow(
            url,
            ep["kafka"]["bootstrap"],
            args.device,
            args.topic,
            args.payload,
            timeout_s=wait_s,
            expires_in_s=args.expires_in,
            want_answer=args.answer,
            on_step=lambda s: print(f"  {s.line()}", flush=True),
        )
    cid = end.command_id
    if end.reply is not None:
        r = end.reply
        print(f"command {cid}: answered by {args.device} via {r.region} after {r.after_s:.2f} s:")
        print(r.payload.decode("utf-8", "replace"))
        return Exit.OK
    last = end.steps[-1] if end.steps else None
    if end.ended == "delivered" and last is not None:
        print(
            f"command {cid}: delivered to {args.device}'s session at {last.region} "
            "(a QoS 1 subscription: MQTT delivers it at least once)"
        )
        return Exit.OK
    if end.ended == "acknowledged":
        print(f"command {cid}: acknowledged by {args.device}")
        return Exit.OK
    if end.ended == "deadlettered" and last is not None:
        print(f"fedgate: command {cid} was dead-lettered: {last.reason}", file=sys.stderr)
        return Exit.FAILED
    where = f"its last step: {last.line()}" if last else "nothing on record for it yet"
    raise TimedOut(
        f"command {cid}: no {'answer' if args.answer else 'outcome'} within {wait_s:g} s ({where})",
        "the router still holds it and delivers it when the device connects and subscribes"
        + (f", until it expires ({args.expires_in:g} s after sending)" if args.expires_in else "")
        + f"; follow it: fedgate command {cid} --wait",
    )


def cmd_command(ctx: Context, args: argparse.Namespace) -> int:
    """What the router did with one command, step by step (router/outcomes.py)."""
    from backend.command_outcomes import final_outcome, read_outcomes

    bootstrap = ctx.fed.endpoints()["kafka"]["bootstrap"]
    require_listening("Kafka", bootstrap)
    wait_s = _wait_seconds(args)
    steps = read_outcomes(bootstrap, args.command_id, wait_s=wait_s or 0.0)
    if args.json:
        print(json.dumps([vars(s) for s in steps], indent=2))
    else:
        for s in steps:
            print(s.line())
    if not steps:
        print(f"fedgate: nothing on record for command {args.command_id}", file=sys.stderr)
        return Exit.FAILED
    ended = final_outcome(steps, int(time.time() * 1000))
    if ended is not None and not args.json:
        print(f"{args.command_id}: {ended}")
    elif wait_s is not None and ended is None:
        raise TimedOut(
            f"command {args.command_id}: no final outcome within {wait_s:g} s",
            "the router still holds it; follow it longer: "
            f"fedgate command {args.command_id} --wait --timeout S",
        )
    return Exit.OK


def cmd_presence(ctx: Context, args: argparse.Namespace) -> int:
    import urllib.parse
    import urllib.request

    url = ctx.fed.endpoints()["router"]["metrics"]
    if url is None:
        print("fedgate: no router in this federation", file=sys.stderr)
        return Exit.FAILED
    query = f"?device={urllib.parse.quote(args.device)}" if args.device else ""
    with reaching("the router", url), urllib.request.urlopen(f"{url}/presence{query}", timeout=5) as r:
        data = json.load(r)
    if args.json:
        print(json.dumps(data, indent=2))
        return Exit.OK
    if args.device and not data["devices"]:
        print(f"{args.device}: not connected")
        return Exit.FAILED
    for d in data["devices"]:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["connected_at"]))
        print(f"{d['device']:30} {d['region']:12} since {since}")
    if not args.device:
        counts = ", ".join(f"{r}: {n}" for r, n in sorted(data["per_region"].items())) or "none"
        print(f"{data['total']} devices connected ({counts})")
    return Exit.OK


def cmd_console(ctx: Context, args: argparse.Namespace) -> int:
    """The fleet console in the browser (fedgate/console), until SIGTERM or Ctrl-C."""
    import signal
    import threading

    from fedgate.console.server import CONSOLE_OFFSET, Console

    ep = ctx.fed.endpoints()
    port = args.port if args.port is not None else ctx.settings.port_base + CONSOLE_OFFSET
    try:
        console = Console(ep, ep["admin"]["user"], ep["admin"]["password"], args.host, port).start()
    except OSError as e:
        print(f"fedgate: the console cannot listen on {args.host}:{port}: {e}", file=sys.stderr)
        return Exit.FAILED
    user = ep["admin"]["user"]
    print(f"fleet console: {console.url}  (user {user}, its password: 'admin' in {ctx.fed.secrets_file})")
    if not ep.get("prometheus"):
        print("fedgate: this federation runs no Prometheus: the console shows little", file=sys.stderr)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    console.stop()
    return Exit.OK


def cmd_gateway(ctx: Context, args: argparse.Namespace) -> int:
    driver = ctx.driver_for(args.region)
    if args.action == "add":
        print(driver.add(args.region, auto_approve=args.auto_approve).summary())
    else:
        driver.remove(args.region, auto_approve=args.auto_approve)
    return 0


def region_rows(ctx: Context) -> list[RegionRow]:
    """Local gateways as they run now, then cloud regions as last recorded by Terraform."""
    return [row for driver in ctx.drivers for row in driver.regions()]


def cmd_regions(ctx: Context, args: argparse.Namespace) -> int:
    rows = region_rows(ctx)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
        return 0
    print(f"{'REGION':14} {'KIND':6} {'GATEWAY':26} {'STATE':26} {'MQTT':28} CONNECTIONS")
    for r in rows:
        conns = "-" if r.connections is None else str(r.connections)
        print(f"{r.region:14} {r.kind:6} {r.gateway:26} {r.state:26} {r.mqtt:28} {conns}")
    return 0


def cmd_settings(ctx: Context, args: argparse.Namespace) -> int:
    from spark.settings import describe as describe_spark

    for env, default, doc in describe_settings():
        print(f"{env:28} {default:34} {doc}")
    print("\nThe Spark job and `fedgate query` (the local federation sets the first ones itself):")
    for env, default, doc in describe_spark():
        print(f"{env:34} {default:28} {doc}")
    return 0


def _not_updated(driver: RegionDriver, failed: dict[str, str]) -> bool:
    """One line per region whose gateways did not take a device change; True if any."""
    for region, why in failed.items():
        print(
            f"fedgate: devices: {driver.kind} region {region} not updated ({' '.join(why.split())}); "
            "run `fedgate devices sync` once it is reachable",
            file=sys.stderr,
        )
    return bool(failed)


def cmd_devices(ctx: Context, args: argparse.Namespace) -> int:
    """The registry is the truth: a device is registered (its secret shown once) even if a
    gateway cannot take it now; that gateway is named and `devices sync` repairs it."""
    from backend.devices import device_users

    registry = ctx.device_registry
    try:
        if args.action == "add":
            issued = registry.add(args.ids, rotate=args.rotate)
            if args.json:
                print(json.dumps({"devices": [{"id": d, "secret": s} for d, s in issued.items()]}, indent=2))
            else:
                print("DEVICE  SECRET (shown once: fedgate keeps only its hash)")
                for d, secret in issued.items():
                    print(f"{d}  {secret}")
            sys.stdout.flush()  # the secrets are out before any gateway is tried
            hashes = registry.hashes()
            fleet = device_users({d: hashes[d] for d in issued})
            failed = [_not_updated(drv, drv.push_devices(fleet, []).failed) for drv in ctx.drivers]
            return 1 if any(failed) else 0
        if args.action == "revoke":
            gone = registry.revoke(args.ids)
            closed = dict.fromkeys(gone, 0)
            failed = []
            for drv in ctx.drivers:
                update = drv.push_devices(None, sorted(gone))
                for d, n in update.closed.items():
                    closed[d] += n
                failed.append(_not_updated(drv, update.failed))
            for d in args.ids:
                if d in closed:
                    print(f"{d}: revoked, {closed[d]} connection(s) closed")
                else:
                    print(f"{d}: not registered", file=sys.stderr)
            return 0 if len(closed) == len(args.ids) and not any(failed) else 1
        if args.action == "sync":
            hashes = registry.hashes()
            failed = []
            for drv in ctx.drivers:
                update = drv.sync_devices(hashes)
                for region, removed in update.removed.items():
                    print(f"{region}: {len(hashes)} devices, removed {removed or 'none'}")
                failed.append(_not_updated(drv, update.failed))
            return 1 if any(failed) else 0
        devices = registry.devices()
        if args.json:
            print(json.dumps({"devices": [{"id": d, "added_ms": e["added_ms"]} for d, e in devices.items()]}))
        else:
            for d, e in devices.items():
                print(
                    f"{d}  added {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(e['added_ms'] / 1000))} UTC"
                )
            print(f"{len(devices)} device(s)", file=sys.stderr)
        return 0
    except DeviceRegistryError as e:
        print(f"fedgate: devices: {e}", file=sys.stderr)
        return 2


def cmd_army(ctx: Context, args: argparse.Namespace) -> int:
    from fedgate import army

    plan = army.ArmyPlan(
        devices=args.devices,
        rate=args.rate,
        duration_s=args.duration,
        processes=args.processes,
        regions=[r for r in (args.regions or "").split(",") if r],
        commands_per_s=args.commands,
        qos=args.qos,
        command_qos=args.command_qos,
        tls=args.tls,
        persistent_sessions=args.persistent_sessions,
        prefix=args.prefix,
        connect_rate=args.connect_rate,
        storm_at_s=args.storm_at,
        roam_at_s=args.roam_at,
        roam_share=args.roam_share,
        kill_gateway=args.kill_gateway,
    )
    tty = sys.stderr.isatty()

    def line(text: str) -> None:
        # one live line on a terminal; one line per second in a log
        print(("\r\x1b[K" + text) if tty else text, end="" if tty else "\n", file=sys.stderr, flush=True)

    try:
        report = army.run_army(ctx.fed, plan, progress=_progress, line=line)
    except ValueError as e:
        print(f"fedgate: army: {e}", file=sys.stderr)
        return Exit.USAGE
    if tty:
        print(file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else army.to_text(report))
    return Exit.OK if army.ok(report) else Exit.FAILED


def cmd_backend_tls(ctx: Context, args: argparse.Namespace) -> int:
    from infra.cloud.driver import CloudDriver, CloudError

    try:
        driver = CloudDriver(ctx.settings, progress=_progress, confirm=_confirm)
        path = driver.write_backend_tls()
        secrets = driver.write_backend_secrets()
    except CloudError as e:
        print(f"fedgate: backend-tls: {e}", file=sys.stderr)
        return 2
    print(f"{path}  (node_tls, node_tls_key_pem: copy it beside the backend module's root module)")
    print(f"{secrets}  (router_password, kafka_sasl_password: copy it there too)")
    return 0


def cmd_cloud_rehearsal(ctx: Context, args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from infra.cloud.rehearsal.run import CLUSTERS, RehearsalOptions, rehearse

    options = RehearsalOptions(
        work_dir=args.work_dir or ctx.settings.state_dir / "cloud-rehearsal",
        subnet=args.subnet,
        prefix=args.prefix,
        clusters=tuple(args.cluster or CLUSTERS),
        routers=not args.no_routers,
    )
    try:
        reports = rehearse(ctx.settings, options, _progress)
    except FedgateError as e:
        print(f"fedgate: cloud-rehearsal: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({name: asdict(r) for name, r in reports.items()}, indent=2, sort_keys=True))
        return 0
    for name, r in reports.items():
        print(
            f"{name}: one cluster of {len(r.node_names)} nodes formed in {r.formed_in_s} s, quorum queue on "
            f"{len(r.queue_members)} nodes, {r.consumed} of "
            f"{r.confirmed_before_kill + r.confirmed_after_kill} confirmed messages kept "
            f"with {r.killed} killed"
            + (f", MQTT answering on {len(r.mqtt_after_kill)} nodes" if r.mqtt_after_kill else "")
        )
        if r.routers:
            print(
                f"{name}: {len(r.routers_healthy)} routers installed from the release and healthy, "
                f"{r.kafka_readings} readings in Kafka with {r.router_killed} killed, the other stopped with "
                f"exit {', '.join(str(v) for v in r.router_exit_codes.values())}"
            )
        if r.spark_code:
            print(
                f"{name}: the Spark job installed from the release, {r.spark_rows} rows in telemetry_raw "
                f"{r.spark_rows_in_s} s after its install began, exit {r.spark_exit_code} on SIGTERM"
            )
    return 0


def cmd_query(ctx: Context, args: argparse.Namespace) -> int:
    from spark import query

    if args.list or not args.sql:
        print("Named queries (fedgate query NAME):\n" + query.describe_named())
        print("\nTables: telemetry_raw, device_minute, region_minute, rejects (docs/analysts.md)")
        return 0 if args.list else 2
    settings = ctx.spark_settings()
    _progress(f"asking the Spark job's session, or starting Spark over {settings.warehouse} (~10 s)")
    with query.session(settings) as spark:
        try:
            columns, rows = query.run_sql(spark, args.sql, limit=args.limit)
            _progress(
                "answered by "
                + ("the Spark job's session" if query.is_remote(spark) else "a Spark of its own")
            )
        except Exception as e:  # Spark's analysis errors: show the message, not a JVM trace
            print(f"fedgate: query failed: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
    print(query.to_json(columns, rows) if args.json else query.format_table(columns, rows))
    return 0


def cmd_count_now(ctx: Context, args: argparse.Namespace) -> int:
    _progress("asking the Spark job to count what it landed in the aggregates")
    t0 = time.monotonic()
    timeout = args.timeout or COUNT_NOW_WAIT_S
    through = ctx.fed.count_aggregates_now(timeout=timeout)
    if through is None:
        raise TimedOut(
            f"the Spark job did not answer in {timeout:g} s",
            "a count of a large backlog takes longer: --timeout; its log says what it does",
        )
    print(f"the aggregates count the micro-batches through {through} ({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_recompute(ctx: Context, args: argparse.Namespace) -> int:
    from spark import query

    since, until = args.since, args.until
    if until < since:
        raise Usage("--until is before --since", "give the first date, then the last")
    settings = ctx.spark_settings()
    _progress(f"recomputing the aggregates of {since}..{until} from telemetry_raw")
    with query.session(settings, remote=False) as spark:  # heavy: not in the job's driver
        counts = query.recompute(spark, settings, since, until)
    for table, n in counts.items():
        print(f"{table}: {n} rows for {since}..{until}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedgate",
        description=__doc__,
        epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-v",
        "--verbose",
        "--debug",
        action="store_true",
        help=f"debug logging, and a failure's traceback ({DEBUG_ENV}=1 does the same)",
    )
    p.add_argument(
        "--version", action=_VersionAction, help="fedgate's version and the engines' it runs, then exit"
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the local federation (idempotent)").set_defaults(fn=cmd_up)
    down = sub.add_parser("down", help="stop the local federation, leaving no process behind")
    down.add_argument("--purge", action="store_true", help="also delete the state folder (all data)")
    down.set_defaults(fn=cmd_down)
    st = sub.add_parser("status", help="the nodes, their ports and state")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(fn=cmd_status)
    sub.add_parser("demo", help="up, then a scripted scene with MQTT devices").set_defaults(fn=cmd_demo)
    send = sub.add_parser("send", help="send a message to a device through the router")
    send.add_argument("device")
    send.add_argument("topic", help="MQTT topic, conventionally devices/<device>/commands/<name>")
    send.add_argument("payload")
    send.add_argument(
        "--retain", action="store_true", help="keep it as the device's desired state for the topic"
    )
    send.add_argument(
        "--expires-in",
        type=_positive_seconds,
        metavar="S",
        help="not delivered after S seconds (dead-lettered with the reason); an MQTT 5 device sees the "
        "deadline in the user property x-fedgate-expires-at",
    )
    send.add_argument(
        "--wait",
        action="store_true",
        help="follow the command, printing each step, until it ends: delivered to a QoS 1 session, "
        "acknowledged by the device, answered (an MQTT 5 device, through the response topic "
        "devices/<device>/replies it is given) or dead-lettered",
    )
    _timeout_option(send)
    send.add_argument(
        "--answer",
        action="store_true",
        help="--wait, and end only at the device's MQTT 5 answer (or the command's dead-lettering)",
    )
    send.set_defaults(fn=cmd_send)
    cmd = sub.add_parser("command", help="what the router did with a command, step by step (its id)")
    cmd.add_argument("command_id", help="the id `fedgate send` printed (the device acknowledges it)")
    cmd.add_argument(
        "--wait",
        action="store_true",
        help="follow it until delivered to a QoS 1 session, acknowledged or dead-lettered",
    )
    _timeout_option(cmd)
    cmd.add_argument("--json", action="store_true")
    cmd.set_defaults(fn=cmd_command)
    pres = sub.add_parser("presence", help="where devices are connected, since when; counts per region")
    pres.add_argument("device", nargs="?")
    pres.add_argument("--json", action="store_true")
    pres.set_defaults(fn=cmd_presence)
    gw = sub.add_parser(
        "gateway", help="add or remove a region: local-<name> here, an AWS region by Terraform"
    )
    gw.add_argument("action", choices=("add", "remove"))
    gw.add_argument("region", help="local-<name> (e.g. local-ap) or an AWS region (e.g. eu-west-1)")
    gw.add_argument(
        "--auto-approve", action="store_true", help="cloud: apply or destroy the plan without asking"
    )
    gw.set_defaults(fn=cmd_gateway)
    con = sub.add_parser("console", help="the fleet console in the browser (admin credentials)")
    con.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    con.add_argument("--port", type=int, default=None, help="port (default: the port base + 7)")
    con.set_defaults(fn=cmd_console)
    rg = sub.add_parser("regions", help="the regions, their gateways and state")
    rg.add_argument("--json", action="store_true")
    rg.set_defaults(fn=cmd_regions)
    sub.add_parser("settings", help="list settings and their env vars").set_defaults(fn=cmd_settings)
    dv = sub.add_parser("devices", help="issue and revoke device credentials")
    dv_sub = dv.add_subparsers(dest="action", required=True)
    dv_add = dv_sub.add_parser("add", help="register devices; prints each one's secret once")
    dv_add.add_argument("ids", nargs="+", metavar="ID")
    dv_add.add_argument("--rotate", action="store_true", help="issue a new secret to a registered device")
    dv_add.add_argument("--json", action="store_true")
    dv_rev = dv_sub.add_parser("revoke", help="remove devices from every gateway and close their connections")
    dv_rev.add_argument("ids", nargs="+", metavar="ID")
    dv_list = dv_sub.add_parser("list", help="the registered devices")
    dv_list.add_argument("--json", action="store_true")
    dv_sub.add_parser(
        "sync", help="make every running gateway's devices the registry's (after a gateway was unreachable)"
    )
    dv.set_defaults(fn=cmd_devices)
    sub.add_parser(
        "backend-tls",
        help="write the cloud backend module's inputs fedgate generates: TLS (certificate from fedgate's CA) "
        "and the routers' and Kafka user's passwords, as tfvars files",
    ).set_defaults(fn=cmd_backend_tls)
    rh = sub.add_parser(
        "cloud-rehearsal",
        help="boot the backend's and a gateway region's RabbitMQ nodes as EC2 would (cloud-init rendered by "
        "Terraform against moto) on 3 network namespaces of this machine, and check each forms one cluster; "
        "the backend's routers installed from a release carry readings into Kafka",
    )
    rh.add_argument(
        "--subnet", default="10.254.80.0/24", help="the instances' subnet (namespaces of this machine)"
    )
    rh.add_argument("--prefix", default="fgrh", help="names of the namespaces and the bridge")
    rh.add_argument(
        "--work-dir", type=Path, help="the instances' folders (default: <state_dir>/cloud-rehearsal)"
    )
    rh.add_argument(
        "--cluster",
        action="append",
        choices=("backend", "gateway"),
        help="only this cluster (repeatable; default both)",
    )
    rh.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    rh.add_argument(
        "--no-routers", action="store_true", help="the backend's nodes only (a plan, no release, no Kafka)"
    )
    rh.set_defaults(fn=cmd_cloud_rehearsal)
    ar = sub.add_parser(
        "army",
        help="simulated devices (asyncio, several processes) against the running federation; "
        "exit 1 if anything acknowledged was lost",
    )
    ar.add_argument("--devices", type=int, default=1000)
    ar.add_argument("--rate", type=float, default=1000.0, help="telemetry readings/s, all devices together")
    ar.add_argument("--duration", type=float, default=30.0, help="seconds of traffic after connecting")
    ar.add_argument("--processes", type=int, default=max(1, os.cpu_count() or 1))
    ar.add_argument("--regions", help="home regions, comma-separated (default: every gateway)")
    ar.add_argument("--commands", type=float, default=0.0, help="commands/s through the router")
    ar.add_argument("--qos", type=int, default=1, choices=(0, 1), help="QoS of the readings")
    ar.add_argument(
        "--command-qos",
        type=int,
        default=0,
        choices=(0, 1),
        help="QoS of the devices' command subscriptions; at 0 they acknowledge each command",
    )
    ar.add_argument("--tls", action="store_true", help="MQTT over TLS (checks the gateways' certificates)")
    ar.add_argument(
        "--persistent-sessions", action="store_true", help="clean_session=false: gateways keep subscriptions"
    )
    ar.add_argument("--prefix", default="army", help="device ids are <prefix>-00000, …")
    ar.add_argument("--connect-rate", type=float, default=1000.0, help="new connections/s (0: no pacing)")
    ar.add_argument("--storm-at", type=float, help="seconds in: every device's connection drops at once")
    ar.add_argument("--roam-at", type=float, help="seconds in: --roam-share of the devices move region")
    ar.add_argument("--roam-share", type=float, default=0.2)
    ar.add_argument(
        "--kill-gateway",
        type=_region_at_seconds,
        metavar="REGION@SECONDS",
        help="SIGKILL that region's gateway SECONDS into the run (default 10); started again after",
    )
    ar.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    ar.set_defaults(fn=cmd_army)
    q = sub.add_parser("query", help="Spark SQL over telemetry_raw, device_minute, region_minute, rejects")
    q.add_argument("sql", nargs="?", help="a SQL statement or a named query (see --list)")
    q.add_argument("--list", action="store_true", help="list the named queries")
    q.add_argument("--json", action="store_true", help="rows as JSON")
    q.add_argument("--limit", type=int, default=100, help="at most this many rows (default 100)")
    q.set_defaults(fn=cmd_query)
    cn = sub.add_parser(
        "count-now",
        help="count the readings landed so far in device_minute and region_minute now, not at the "
        "Spark job's next aggregate_interval_s",
    )
    cn.add_argument(
        "--timeout",
        type=_positive_seconds,
        metavar="S",
        help=f"wait at most S seconds for the job's answer (default {COUNT_NOW_WAIT_S:g}); "
        "then exit 6 (timed out)",
    )
    cn.set_defaults(fn=cmd_count_now)
    rc = sub.add_parser("recompute", help="rebuild device_minute/region_minute from telemetry_raw for dates")
    rc.add_argument("--since", required=True, type=_date, help="first date, YYYY-MM-DD")
    rc.add_argument("--until", required=True, type=_date, help="last date, YYYY-MM-DD")
    rc.set_defaults(fn=cmd_recompute)
    return p


def _timeout_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        metavar="S",
        help=f"--wait, for at most S seconds (default {DEFAULT_WAIT_S:g}); then exit 6 (timed out)",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, read as main reads it: `--wait 30` still means `--wait --timeout 30`."""
    return build_parser().parse_args(_wait_seconds_as_timeout(sys.argv[1:] if argv is None else argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM gets the same clean-up as Ctrl-C: a half-done `up` stops what it started.
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    debug = args.verbose or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # pika logs each failed connection attempt at ERROR, traceback and all: the one line below says it
    logging.getLogger("pika").setLevel(logging.NOTSET if debug else logging.CRITICAL)
    try:
        ctx = Context(load_settings())
        return int(args.fn(ctx, args))
    except KeyboardInterrupt:
        print("fedgate: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except Exception as e:
        if output_closed(e):
            # what is still buffered would fail again as the interpreter exits, with a message
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return Exit.OUTPUT_CLOSED
        # every failure, expected or not, is one line a person can act on; the traceback only
        # when debugging
        code, line = explain(e, args.command)
        log.debug("%s failed", args.command, exc_info=True)
        print(f"fedgate: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
