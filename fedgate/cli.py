"""`fedgate`: the command line that runs and inspects a fedgate federation.

    fedgate up                 start the local federation (idempotent)
    fedgate down [--purge]     stop it; --purge also deletes its state folder
    fedgate status [--json]    one line per node: role, region, ports, state, load
    fedgate demo               up, then a scripted scene with MQTT devices

Settings come from the environment (FEDGATE_*) and fedgate.toml; see
`fedgate settings` and docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from typing import Any

from infra.local.driver import FederationError, LocalFederation, NodeStatus
from infra.local.settings import SettingsError, describe_settings, load_settings


def _progress(msg: str) -> None:
    print(f"[fedgate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def format_status(rows: list[NodeStatus]) -> str:
    header = ("NODE", "ROLE", "REGION", "PORTS", "STATE", "CONNS", "MSGS", "RSS_MB")
    lines = [header]
    for r in rows:
        ports = " ".join(f"{k}={v}" for k, v in r.ports.items() if k not in ("dist", "controller"))
        lines.append(
            (
                r.name,
                r.role,
                r.region or "-",
                ports,
                r.state,
                "-" if r.connections is None else str(r.connections),
                "-" if r.messages is None else str(r.messages),
                "-" if r.rss_mb is None else str(r.rss_mb),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(col.ljust(w) for col, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def status_json(fed: LocalFederation, rows: list[NodeStatus]) -> dict[str, Any]:
    return {
        "state_dir": str(fed.state_dir),
        "secrets_file": str(fed.secrets_file),
        "nodes": [r.to_json() for r in rows],
    }


def cmd_up(fed: LocalFederation, args: argparse.Namespace) -> int:
    rows = fed.up()
    print(format_status(rows))
    return 0


def cmd_down(fed: LocalFederation, args: argparse.Namespace) -> int:
    killed = fed.down(purge=args.purge)
    left = fed.leftover_pids()
    if left:
        _progress(f"error: processes still running after down: {left}")
        return 1
    if killed:
        _progress(f"warning: had to kill {len(killed)} process(es) that ignored SIGTERM")
    return 0


def cmd_status(fed: LocalFederation, args: argparse.Namespace) -> int:
    rows = fed.status()
    if args.json:
        print(json.dumps(status_json(fed, rows), indent=2))
    else:
        print(format_status(rows))
    return 0 if all(r.state == "running" for r in rows) else 3


def cmd_demo(fed: LocalFederation, args: argparse.Namespace) -> int:
    from fedgate.demo import run_demo

    return run_demo(fed, progress=_progress)


def cmd_settings(fed: LocalFederation, args: argparse.Namespace) -> int:
    for env, default, doc in describe_settings():
        print(f"{env:28} {default:34} {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedgate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the local federation (idempotent)").set_defaults(fn=cmd_up)
    down = sub.add_parser("down", help="stop the local federation, leaving no process behind")
    down.add_argument("--purge", action="store_true", help="also delete the state folder (all data)")
    down.set_defaults(fn=cmd_down)
    st = sub.add_parser("status", help="the nodes, their ports and state")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(fn=cmd_status)
    sub.add_parser("demo", help="up, then a scripted scene with MQTT devices").set_defaults(fn=cmd_demo)
    sub.add_parser("settings", help="list settings and their env vars").set_defaults(fn=cmd_settings)
    return p


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    # SIGTERM gets the same clean-up as Ctrl-C: a half-done `up` stops what it started.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = load_settings()
    except SettingsError as e:
        print(f"fedgate: settings: {e}", file=sys.stderr)
        return 2
    fed = LocalFederation(settings, progress=_progress)
    try:
        return int(args.fn(fed, args))
    except FederationError as e:
        print(f"fedgate: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fedgate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
