"""``python -m runner.bench overhead``: section 5 of ``bench loaders`` alone (every loop's
table), the same measurement (``overhead_figure``): the runner's own cost per batch against
a DataLoader's, in rounds, the median ratio and its range, PASS/FAIL.
"""

from __future__ import annotations

import argparse

from runner.bench.loaders import overhead_figure, print_overhead


def bench_overhead(args: argparse.Namespace) -> dict:
    """Section 5 of ``loaders`` alone: the one figure both benches print, and its target."""
    figure = overhead_figure(args.items, args.batch_size, args.rounds, args.workers)
    print_overhead(figure)
    r = figure["ratio"]
    return {**figure, "targets": [{
        "what": "runner batched / DataLoader, per-batch overhead", "median": r["median"],
        "min": r["min"], "max": r["max"], "target": figure["target"], "met": figure["met"]}]}
