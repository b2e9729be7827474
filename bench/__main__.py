"""`make bench`: every benchmark in turn, each on a federation of its own.

    python -m bench                 # all of them
    BENCH=spark QUICK=1 python -m bench

Each writes bench/results/<name>-<timestamp>.json and .md and prints the table.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import ModuleType

from bench import army_bench, router_bench, spark_bench
from bench.router_bench import progress
from infra.local.settings import PROJECT_ROOT

BENCHMARKS: dict[str, ModuleType] = {"router": router_bench, "spark": spark_bench, "army": army_bench}


def main() -> int:
    quick = os.environ.get("QUICK") not in (None, "", "0")
    chosen = [b.strip() for b in os.environ.get("BENCH", ",".join(BENCHMARKS)).split(",") if b.strip()]
    unknown = set(chosen) - set(BENCHMARKS)
    if unknown:
        print(
            f"bench: unknown benchmark {sorted(unknown)}; choose from {sorted(BENCHMARKS)}", file=sys.stderr
        )
        return 2
    out_dir = PROJECT_ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        started = time.monotonic()
        progress(f"{name} benchmark ({'quick' if quick else 'full'})")
        module = BENCHMARKS[name]
        results = module.run(quick=quick)
        results["duration_s"] = round(time.monotonic() - started, 1)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        md = module.to_markdown(results)
        (out_dir / f"{name}-{stamp}.json").write_text(json.dumps(results, indent=2))
        (out_dir / f"{name}-{stamp}.md").write_text(md)
        print(md, flush=True)
        progress(f"{name}: results in {out_dir}/{name}-{stamp}.json and .md ({results['duration_s']} s)")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
