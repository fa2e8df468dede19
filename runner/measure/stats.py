"""The runner's one median and spread: figures, stage ceilings, reports and benchmarks all
summarize repeated measurements with these (pure Python, no torch: the report imports it)."""

from __future__ import annotations

import math


def quantiles(values: list[float]) -> dict[str, float]:
    """min, q1, median, q3 and max of ``values`` (linear interpolation between ranks)."""
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"min": ordered[0], "q1": at(0.25), "median": at(0.5), "q3": at(0.75),
            "max": ordered[-1]}


def median(values: list[float]) -> float:
    """The median of ``values`` (between the two middle ones for an even count); NaN for
    none."""
    return quantiles(values)["median"] if len(values) else math.nan

