"""The router's cyclic garbage collector, set for throughput once the router started."""

from __future__ import annotations

import gc

#: Python collects its youngest objects after this many allocations, not 700: a reading
#: bridged allocates a score of short-lived objects, which reference counting frees anyway
GC_YOUNG_THRESHOLD = 20_000


def collect_garbage_for_throughput() -> None:
    """Once started: what the router holds for good (modules, settings, connections) out of
    the cyclic collector's way (`gc.freeze`), and young collections rarer.  Bridging batches,
    the collector took 15 % of the event loop's time, mostly rescanning those long-lived
    objects (docs/benchmarks.md, the router's profile)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
