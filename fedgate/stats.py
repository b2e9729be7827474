"""Statistics over latency samples: percentiles and evenly spaced quantiles.

Generic, with no knowledge of the army: the army's report and the router and
Spark benchmarks (bench/) summarise their samples with these, so their
figures are computed the same way (nearest rank, no interpolation).
"""

from __future__ import annotations


def quantiles(values: list[float], points: int = 100) -> list[float]:
    """`points` evenly spaced quantiles (the last is the maximum): enough to draw a CDF."""
    if not values:
        return []
    v = sorted(values)
    return [round(v[min(len(v) - 1, int(len(v) * (i + 1) / points))], 2) for i in range(points)]


def percentile(values: list[float], q: float) -> float | None:
    """The value at quantile q (nearest rank, no interpolation), to 0.1; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 1)


def percentiles(values: list[float]) -> dict[str, float | None]:
    v = sorted(values)
    return {
        "p50": percentile(v, 0.50),
        "p95": percentile(v, 0.95),
        "p99": percentile(v, 0.99),
        "max": round(v[-1], 1) if v else None,
    }
