"""The price of no single point of failure: the army against the single and the HA profile.

One run, one machine, the same devices and offered load for both:

single  the benchmarks' federation: one gateway node, one backend node, one Kafka broker
ha      a federation of the HA profile booted for this benchmark (FEDGATE_PROFILE=ha): the
        region's gateway a cluster of 3 RabbitMQ nodes (devices spread over them), the
        backend a cluster of 3, Kafka 3 brokers with replication 3 and min.insync.replicas 2

Each runs, after an unmeasured warm-up, the uplink in steps of offered QoS 1 load (the
army counts every reading in Kafka) and a downlink of commands; the profiles run one
after the other, never side by side, since they share the two cores.  Reported per
profile: the sustained rate (the highest step carried with nothing lost,
bench/army_bench.carried), the latency at the first step, commands delivered, and the
resident memory of all the engines' processes, idle and holding the devices; then HA /
single as ratios.  Last, on the HA profile only, the fault sequence (bench/ha_faults.py): a
node of each engine SIGKILLed in turn under readings and commands, nothing to be lost and
the commands' p99 within FAULT_COMMAND_P99_MS.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench import ha_faults
from bench.army_bench import _brief, _plan, _ratio, _subset, carried, sustained
from bench.router_bench import cpu_seconds, progress
from fedgate import army
from infra.local import processes
from infra.local.driver import LocalFederation
from infra.local.settings import load_settings

#: The HA federation's ports: beside the benchmarks' block (FEDGATE_BENCH_PORT_BASE).
HA_PORT_OFFSET = 2000
SERVICES = {"routers": True, "spark": False}
#: Seconds of unmeasured traffic before the steps (by quick).  The Kafka brokers of a
#: federation just booted take a minute or two to reach their steady cost: by hand
#: (2026-12-06, HA profile), three brokers restarted 30 s before used 0.52 cores at 500
#: readings/s, 0.36 at 1,000 and 0.30 at 2,000 in the minute after; warm, 0.31, 0.33 and
#: 0.29.  With 20 s the first steps measured the warm-up (0.67 cores at 250/s, 0.36 at 3,000).
WARMUP_S = {True: 3, False: 90}
#: The goals of the HA profile (a production fleet's shape) on this machine: its sustained
#: rate with p99 under SUSTAINED_P99_MS, its engines' CPU at a step both profiles carried
#: against the single profile's, and commands beside readings (MIXED) delivered within
#: COMMAND_P99_MS at p99, none twice when nothing failed.
SUSTAINED_PER_S = 2_000
SUSTAINED_P99_MS = 250.0
CPU_VS_SINGLE = 1.5
COMMAND_P99_MS = 500.0
#: ... and through a node of each engine SIGKILLed in turn (bench/ha_faults.py), nothing lost
FAULT_COMMAND_P99_MS = 5_000.0
#: readings/s, commands/s and seconds of the commands-beside-readings phase (by quick)
MIXED = {True: (200, 10, 3), False: (1_000, 20, 30)}


def sustained_text(per_s: float | None) -> str:
    """A sustained rate as the reports print it; "no step" when none met the p99."""
    return f"{per_s:,.0f}/s" if per_s else "no step"


def ha_federation(fed: LocalFederation, workdir: Path) -> LocalFederation:
    """A federation of the HA profile with the regions and routers of `fed`."""
    s = fed.settings
    settings = load_settings(
        env={},
        state_dir=workdir / "ha-state",
        port_base=s.port_base + HA_PORT_OFFSET,
        regions=",".join(s.regions),
        routers=s.routers,
        spark=0,
        kafka_opts=s.kafka_opts,
        profile="ha",
        # 16 processes booting at once on two cores: a JVM took over 90 s beside the test suite
        boot_timeout=max(s.boot_timeout, 180.0),
    )
    return LocalFederation(settings, progress=progress)


def roles_pids(fed: LocalFederation) -> dict[str, list[int]]:
    """The processes of each kind of node (gateway, backend, kafka, router), all of its nodes."""
    out: dict[str, list[int]] = {}
    for n in fed.nodes():
        if n.spec.role != "epmd":
            out.setdefault(n.spec.role, []).extend(processes.marked_pids(n.marker))
    return out


def engines_rss_mb(fed: LocalFederation) -> float:
    """Resident memory of every process of the federation (brokers, Kafka, routers), MB."""
    return round(processes.rss_bytes(fed.leftover_pids()) / 2**20, 1)


def measure(fed: LocalFederation, name: str, quick: bool) -> dict[str, Any]:
    """The same steps and commands as army_bench's, on one profile."""
    devices = 100 if quick else 500
    # from below the HA profile's ceiling on two cores up to the single profile's
    rates = [200, 400] if quick else [250, 500, 1000, 2000, 3000]
    step_s = 3 if quick else 15
    out: dict[str, Any] = {"nodes": len(fed.specs()), "steps": []}
    time.sleep(2.0)  # the nodes settle after their boot
    out["rss_idle_mb"] = engines_rss_mb(fed)
    target = army.federation_target(fed, _plan(devices, quick, prefix=f"ha-bench-{name}"), progress)
    # not measured: the first seconds of traffic after a boot are slow on either profile (the
    # devices' first connects, presence, the producers' first batches; ~12 s on the HA one)
    progress(f"{name}: warming up, {devices} devices offering {rates[0]} readings/s for {WARMUP_S[quick]} s")
    army.run_fleet(
        _subset(target, devices),
        _plan(devices, quick, rate=rates[0], duration_s=WARMUP_S[quick], prefix=f"ha-bench-{name}"),
    )
    pids = roles_pids(fed)
    for rate in rates:
        progress(f"{name}: {devices} devices offering {rate} readings/s for {step_s} s")
        cpu0, t0 = {role: cpu_seconds(p) for role, p in pids.items()}, time.monotonic()
        r = army.run_fleet(
            _subset(target, devices),
            _plan(devices, quick, rate=rate, duration_s=step_s, prefix=f"ha-bench-{name}"),
        )
        wall = time.monotonic() - t0
        cores = {role: round((cpu_seconds(p) - cpu0[role]) / wall, 2) for role, p in pids.items()}
        out["steps"].append({"offered": rate, **_brief(r), "cpu_cores": cores})
        out["rss_busy_mb"] = max(out.get("rss_busy_mb", 0.0), engines_rss_mb(fed))
        if not carried(out["steps"][-1]) and not quick:
            break  # past its ceiling: the next step says nothing more
    readings, commands, seconds = MIXED[quick]
    progress(f"{name}: {commands} commands/s beside {readings} readings/s for {seconds} s, {devices} devices")
    r = army.run_fleet(
        _subset(target, devices),
        _plan(
            devices,
            quick,
            rate=readings,
            duration_s=seconds,
            commands_per_s=commands,
            prefix=f"ha-bench-{name}",
        ),
    )
    # `duplicated`: deliveries of a command beyond its first (the router sent it again, its
    # acknowledgement having come after the router's ack timeout): none when nothing failed
    out["downlink"] = {k: r["downlink"][k] for k in ("sent", "received", "lost", "duplicated", "latency_ms")}
    out["mixed"] = {"readings_per_s": readings, "commands_per_s": commands, **_brief(r)}
    if name == "ha":
        progress(f"{name}: the fault sequence, {devices} devices")
        out["faults"] = ha_faults.run(
            fed,
            _subset(target, devices),
            lambda **kw: _plan(devices, quick, prefix=f"ha-bench-{name}", **kw),
            quick,
            progress,
        )
    out["sustained_per_s"] = sustained(out["steps"])
    out["sustained_fast_per_s"] = sustained(out["steps"], SUSTAINED_P99_MS)
    out["latency_at_moderate_ms"] = out["steps"][0]["latency_ms"]
    return out


def cpu_ratio(single: dict[str, Any], ha: dict[str, Any]) -> dict[str, Any]:
    """The engines' cores (every kind of node) at the highest offered step both profiles
    carried, HA / single: what the same load costs in the HA shape."""
    both = [
        (a, b)
        for a in single["steps"]
        for b in ha["steps"]
        if a["offered"] == b["offered"] and carried(a) and carried(b)
    ]
    if not both:
        return {"offered": None, "single_cores": None, "ha_cores": None, "ha_vs_single": None}
    a, b = max(both, key=lambda ab: ab[0]["offered"])
    single_cores = round(sum(a["cpu_cores"].values()), 2)
    ha_cores = round(sum(b["cpu_cores"].values()), 2)
    return {
        "offered": a["offered"],
        "single_cores": single_cores,
        "ha_cores": ha_cores,
        "ha_vs_single": _ratio(ha_cores, single_cores),
    }


def run(
    fed: LocalFederation, workdir: Path, quick: bool = False, ha: LocalFederation | None = None
) -> dict[str, Any]:
    """`ha`: a federation of the HA profile already up to measure (the tests' own, shared with
    their HA scenarios: booting a second one costs two cores a minute); None boots one."""
    results: dict[str, Any] = {"quick": quick, "machine": {"cpus": os.cpu_count()}}
    results["single"] = measure(fed, "single", quick)
    # the single profile's routers and brokers stay up but idle while the HA profile runs
    if ha is not None:
        results["ha_boot_s"] = None
        results["ha"] = measure(ha, "ha", quick)
    else:
        ha = ha_federation(fed, workdir)
        t0 = time.monotonic()
        try:
            ha.up()
            results["ha_boot_s"] = round(time.monotonic() - t0, 1)
            results["ha"] = measure(ha, "ha", quick)
        finally:
            ha.down()
    s, h = results["single"], results["ha"]
    results["ratios"] = {
        "sustained_ha_vs_single": _ratio(h["sustained_per_s"], s["sustained_per_s"]),
        "p99_ha_vs_single": _ratio(h["latency_at_moderate_ms"]["p99"], s["latency_at_moderate_ms"]["p99"]),
        "rss_idle_ha_vs_single": _ratio(h["rss_idle_mb"], s["rss_idle_mb"]),
        "rss_busy_ha_vs_single": _ratio(h["rss_busy_mb"], s["rss_busy_mb"]),
        "command_p99_ha_vs_single": _ratio(
            h["downlink"]["latency_ms"]["p99"], s["downlink"]["latency_ms"]["p99"]
        ),
    }
    results["cpu"] = cpu_ratio(s, h)
    return results


def to_markdown(r: dict[str, Any]) -> str:
    s, h, q = r["single"], r["ha"], r["ratios"]
    lines = [
        f"# The HA profile's cost ({'quick' if r['quick'] else 'full'}, {r['machine']['cpus']} cores)",
        "",
        "| | single | ha | ha / single |",
        "|---|---:|---:|---:|",
        f"| nodes (brokers, Kafka, routers, epmd) | {s['nodes']} | {h['nodes']} | |",
        f"| sustained QoS 1 readings/s, nothing lost | {s['sustained_per_s']} | {h['sustained_per_s']} | "
        f"{q['sustained_ha_vs_single']} |",
        f"| p99 ms at {s['steps'][0]['offered']}/s | {s['latency_at_moderate_ms']['p99']} | "
        f"{h['latency_at_moderate_ms']['p99']} | {q['p99_ha_vs_single']} |",
        f"| resident memory, idle (MB) | {s['rss_idle_mb']} | {h['rss_idle_mb']} | "
        f"{q['rss_idle_ha_vs_single']} |",
        f"| resident memory, busy (MB) | {s['rss_busy_mb']} | {h['rss_busy_mb']} | "
        f"{q['rss_busy_ha_vs_single']} |",
        f"| sustained with p99 under {SUSTAINED_P99_MS:g} ms | {sustained_text(s['sustained_fast_per_s'])} | "
        f"{sustained_text(h['sustained_fast_per_s'])} | |",
        f"| engines' cores at {r['cpu']['offered']}/s (both carried) | {r['cpu']['single_cores']} | "
        f"{r['cpu']['ha_cores']} | {r['cpu']['ha_vs_single']} |",
        f"| commands ({s['mixed']['commands_per_s']}/s beside {s['mixed']['readings_per_s']} "
        f"readings/s): delivered of sent, sent twice | {_commands(s)} | {_commands(h)} | |",
        f"| the same, p50 / p99 ms from send to device | {_command_latency(s)} | {_command_latency(h)} | "
        f"{q['command_p99_ha_vs_single']} |",
        *_fault_rows(h),
        "",
        (
            f"The HA federation booted in {r['ha_boot_s']} s."
            if r["ha_boot_s"] is not None
            else "The HA federation was up before the benchmark."
        )
        + " Per step (acknowledged/s, lost, p99 ms; the CPU each kind of node used, all its nodes "
        "together, in cores):",
        "",
        "| offered/s | single | ha |",
        "|---:|---|---|",
    ]
    by_rate = {x["offered"]: x for x in s["steps"]}
    ha_by_rate = {x["offered"]: x for x in h["steps"]}

    def cell(x: dict[str, Any] | None) -> str:
        if x is None:
            return "-"
        cores = ", ".join(f"{k} {v}" for k, v in x.get("cpu_cores", {}).items())
        return f"{x['acked_per_s']}/s, {x['lost']} lost, p99 {x['latency_ms']['p99']}; cores: {cores}"

    for rate in sorted(set(by_rate) | set(ha_by_rate)):
        lines.append(f"| {rate} | {cell(by_rate.get(rate))} | {cell(ha_by_rate.get(rate))} |")
    return "\n".join(lines) + "\n"


def _commands(p: dict[str, Any]) -> str:
    d = p["downlink"]
    return f"{d['received'] - d['duplicated']}/{d['sent']}, {d['duplicated']}"


def _command_latency(p: dict[str, Any]) -> str:
    lat = p["downlink"]["latency_ms"]
    return f"{lat['p50']} / {lat['p99']}"


def _fault_rows(h: dict[str, Any]) -> list[str]:
    f = h.get("faults")
    if f is None:
        return []
    d, lat = f["commands"], f["commands"]["latency_ms"]
    killed = ", ".join(f"{k['node']} at {k['at_s']:g} s" for k in f["killed"]) or "none"
    return [
        f"| through faults ({f['commands_per_s']} commands/s beside {f['readings_per_s']} readings/s, "
        f"SIGKILLed and left down: {killed}): readings lost; commands delivered of sent, lost, "
        f"sent twice | - | {f['lost']} of {f['acked']:,}; {d['received'] - d['duplicated']}/{d['sent']}, "
        f"{d['lost']}, {d['duplicated']} | |",
        f"| the same, command p50 / p99 / max ms from send to device | - | "
        f"{lat['p50']} / {lat['p99']} / {lat['max']} | |",
    ]
