"""The benchmarks of `make bench`, run in turn on one federation.

Booting a federation takes 15-25 s and stopping it another 15, so the
benchmarks share one (state in a temporary folder, ports from
FEDGATE_BENCH_PORT_BASE, default 19000: clear of `make up`'s and the tests').
Each benchmark says which of the federation's services it wants running
(`services`), so one benchmark's leftovers never run beside another's
measurement: the router benchmark runs its own router process with the
federation's routers and Spark job stopped; the army wants the routers and
not the Spark job.  The order is fixed, cheapest restarts first: the Spark
job boots once, for the Spark benchmark, and is then stopped for good.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench import army_bench, cost_bench, goals, ha_bench, router_bench, scale_bench, spark_bench
from bench.router_bench import progress
from infra.local.driver import LocalFederation
from infra.local.nodes import ROLE_ROUTER, ROLE_SPARK
from infra.local.settings import PROJECT_ROOT, load_settings

#: In the order they run.
BENCHMARKS: dict[str, ModuleType] = {
    "spark": spark_bench,
    "router": router_bench,
    "cost": cost_bench,
    "army": army_bench,
    # it boots a federation of the HA profile of its own beside this one
    "ha": ha_bench,
    # last: a federation of its own, with a gateway cluster, in this one's place
    "scale": scale_bench,
}
#: The army runs two routers, as a production backend would.
ROUTERS = 2
RESULTS_DIR = PROJECT_ROOT / "bench" / "results"


def bench_federation(
    workdir: Path, *, spark: bool, gateway_nodes: int = 1, quick: bool = False
) -> LocalFederation:
    """One gateway (or a cluster of them), two routers, Kafka, and the Spark job when the Spark
    benchmark runs; its state in workdir/state."""
    base = int(os.environ.get("FEDGATE_BENCH_PORT_BASE", "19000"))
    # the JVMs' options as the defaults, unless told (the tests' quick run: C1 only)
    jvm = os.environ.get("FEDGATE_BENCH_JVM_OPTIONS", "")
    settings = load_settings(
        env={},
        kafka_opts=jvm,
        spark_java_options=jvm,
        state_dir=workdir / "state",
        port_base=base,
        regions="local-eu",
        gateway_cluster_nodes=gateway_nodes,
        routers=ROUTERS,
        spark=1 if spark else 0,
        spark_aggregate_after_rows=spark_bench.AGGREGATE_AFTER_ROWS["quick" if quick else "full"],
        # the scale benchmark's devices: a descriptor each, up to ~3 GB of memory a node (below
        # the watermark, which would block them; the other benchmarks stay far below either)
        gateway_max_fds=scale_bench.GATEWAY_MAX_FDS,
        rabbitmq_memory_mb=scale_bench.GATEWAY_MEMORY_MB,
    )
    return LocalFederation(settings, progress=progress)


def scale_federation(shared: LocalFederation, workdir: Path, quick: bool) -> LocalFederation:
    """The scale benchmark's federation: its region a gateway cluster of as many nodes as its
    devices need here (scale_bench.cluster_plan), booted in the shared one's place (stopped
    first: its ports, and the machine to itself; no benchmark after it needs the shared one)."""
    nodes = scale_bench.cluster_plan("quick" if quick else "full").nodes
    shared.down()
    fed = bench_federation(workdir / "scale-federation", spark=False, gateway_nodes=nodes)
    fed.up()
    return fed


def set_services(fed: LocalFederation, *, routers: bool, spark: bool) -> None:
    """Every broker running (a benchmark may have stopped one to measure a reference), and
    the federation's routers and Spark job started or stopped as the next benchmark wants."""
    services = {ROLE_ROUTER: routers, ROLE_SPARK: spark}
    broker_started = False
    for spec in fed.specs():
        running = fed.node(spec.name).is_running()
        want = services.get(spec.role, True)  # a broker is always wanted
        if want and not running:
            fed.start_node(spec.name)
            broker_started = broker_started or spec.role not in services
        elif running and not want:
            fed.stop_node(spec.name)
    if broker_started:
        fed.wait_for_links()


def choose(names: Iterable[str] | None) -> list[str]:
    """The named benchmarks in run order (all of them for None); ValueError for an unknown name."""
    wanted = set(BENCHMARKS) if names is None else {n.strip() for n in names if n.strip()}
    unknown = wanted - set(BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown benchmark {sorted(unknown)}; choose from {list(BENCHMARKS)}")
    return [n for n in BENCHMARKS if n in wanted]


def result_files(name: str) -> list[Path]:
    """results/<name>-<stamp>.json and .md."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return [RESULTS_DIR / f"{name}-{stamp}.{ext}" for ext in ("json", "md")]


def write_results(files: list[Path], data: Any, md: str) -> None:
    """The figures as JSON and the table as Markdown into `files`; the table printed."""
    files[0].write_text(json.dumps(data, indent=2))
    files[1].write_text(md)
    print(md, flush=True)


def write_goals(out: dict[str, dict[str, Any]], quick: bool) -> None:
    """results/goals-<stamp>.json and .md: each performance goal the run measured, with its ratio."""
    rows = goals.goals(out)
    if rows:
        files = result_files("goals")
        write_results(files, rows, goals.to_markdown(rows, quick))
        progress(f"goals: {files[1]}")


def run_suite(
    names: Iterable[str] | None = None, *, quick: bool = False, ha_federation: LocalFederation | None = None
) -> dict[str, dict[str, Any]]:
    """Run the benchmarks on one federation; write each one's results/<name>-<stamp>.json and .md.

    `ha_federation`: one of the HA profile already up, for the HA benchmark to measure rather
    than boot its own (bench/ha_bench.run)."""
    chosen = choose(names)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="fedgate-bench-"))
    fed = bench_federation(workdir, spark="spark" in chosen, quick=quick)
    out: dict[str, dict[str, Any]] = {}
    t_suite = time.monotonic()
    try:
        if chosen != ["scale"]:  # the scale benchmark alone needs only its own
            fed.up()
        for name in chosen:
            started = time.monotonic()
            module = BENCHMARKS[name]
            progress(f"{name} benchmark ({'quick' if quick else 'full'})")
            if module is scale_bench:
                fed = scale_federation(fed, workdir, quick)
            set_services(fed, **module.SERVICES)
            (workdir / name).mkdir()
            extra = {"ha": ha_federation} if module is ha_bench else {}
            results = module.run(fed, workdir / name, quick=quick, **extra)
            results["duration_s"] = round(time.monotonic() - started, 1)
            files = result_files(name)
            results["files"] = [str(f) for f in files]
            write_results(files, results, module.to_markdown(results))
            progress(f"{name}: results in {results['files'][0]} and .md ({results['duration_s']} s)")
            out[name] = results
        write_goals(out, quick)
    except BaseException:
        fed.down()
        progress(f"benchmark failed; the federation's logs are kept in {workdir}/state")
        raise
    fed.down()
    if os.environ.get("BENCH_KEEP") not in (None, "", "0"):
        # to study a run afterwards: the job's log and progress, the nodes' logs
        progress(f"the federation's state and logs are kept in {workdir}/state (BENCH_KEEP)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    progress(f"benchmarks done in {time.monotonic() - t_suite:.0f} s: {', '.join(chosen)}")
    return out
