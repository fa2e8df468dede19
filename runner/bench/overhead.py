"""``python -m runner.bench overhead``: section 5 alone (every loop's table), in ``--rounds``
rounds: the runner's own cost per batch against a DataLoader's, the median ratio and its
range, PASS/FAIL.
"""

from __future__ import annotations

import argparse

from runner.bench.loaders import OVERHEAD_TARGET, per_batch_overhead, print_loops
from runner.measure.stats import median


def bench_overhead(args: argparse.Namespace) -> dict:
    """Section 5 of ``loaders`` alone, in rounds: each round's three epochs, the ratio's
    median and range, the target."""
    print(f"per-batch overhead: {args.items:,} in-memory items, batch {args.batch_size}, one "
          f"epoch (the best of 3), {args.rounds} rounds", flush=True)
    rounds = []
    for k in range(args.rounds):
        o = per_batch_overhead(args.items, args.batch_size, workers=args.workers)
        rounds.append(o)
        print_loops(o)
        print(f"  round {k + 1}: DataLoader {o['dataloader_s']:.3f} s, runner "
              f"{o['runner_s']:.3f} s, numpy loop {o['numpy_s']:.3f} s per epoch; runner "
              f"{o['dataloader_s'] / o['runner_s']:.1f}x DataLoader", flush=True)
    ratios = [o["dataloader_s"] / o["runner_s"] for o in rounds]
    numpy = [o["dataloader_s"] / o["numpy_s"] for o in rounds]
    met = median(ratios) >= OVERHEAD_TARGET
    print(f"\n  numpy loop / DataLoader: {median(numpy):.1f}x ({min(numpy):.1f}-{max(numpy):.1f})")
    print(f"  {'PASS' if met else 'FAIL'}  runner batched / DataLoader, per-batch overhead: "
          f"{median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f}; target >= "
          f"{OVERHEAD_TARGET:g}x)")
    return {"rounds": rounds, "targets": [{
        "what": "runner batched / DataLoader, per-batch overhead", "median": median(ratios),
        "min": min(ratios), "max": max(ratios), "target": OVERHEAD_TARGET, "met": met}]}
