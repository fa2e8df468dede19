"""``python -m runner.bench contention``: each store quiet and beside another process's threads
on the same cores (a 2-thread matmul loop, ``Burner``), in alternating rounds: what a
neighbouring job leaves of each store's rate, against ``CONTENTION_TARGET``.
"""

from __future__ import annotations

import argparse
import sys
import time

from runner.bench import MEMMAP, PACKED, loader, runner_rate
from runner.bench.stores import _row
from runner.data.storage import STORAGES, build_storage, resolve_dataset
from runner.job.compose import compose
from runner.measure.stats import median

BURNER = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(384, 384)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:  # bounded: it stops by itself
    a = (a @ a).clamp_(-1, 1)
"""


class Burner:
    """Another job on the same cores: a process running a ``threads``-thread torch matmul
    loop, for ``seconds`` at most (it ends by itself; leaving the block stops it at once)."""

    def __init__(self, threads: int = 2, seconds: float = 120.0):
        self.threads, self.seconds, self.proc = threads, seconds, None

    def __enter__(self) -> Burner:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-c", BURNER, str(self.threads),
                                      str(self.seconds)])
        time.sleep(1.0)  # torch imported, the loop running
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


CONTENTION_TARGET = 0.25  # of the quiet figure: a fair share of two busy cores is 50%


def contention_rows() -> dict[str, list[str]]:
    """What the contention bench measures: the decode-once store (a batched gather, the
    path that collapsed beside another job) with centre and random crops, and the packed
    store (decode threads)."""
    rows = {f"{MEMMAP.value}/center": [loader(MEMMAP)],
            f"{MEMMAP.value}/random": [loader(MEMMAP), "dataset.crop=random"]}
    rows[f"{PACKED.value}/center"] = [loader(PACKED), *STORAGES[PACKED].bench[_row(PACKED)][1:]]
    return rows


def bench_contention(args: argparse.Namespace) -> dict:
    """Each row quiet and beside a ``--burner-threads`` matmul loop in another process, in
    alternating rounds; the busy figure as a share of the quiet one, and the target."""
    base = [*args.overrides, f"dataset.image_size=[{args.size},{args.size}]",
            f"loader.batch_size={args.batch_size}", "model=none", "logger=none",
            "run.progress=false"]
    rows = contention_rows()
    configs = {name: compose([*base, *extra]) for name, extra in rows.items()}
    for config in configs.values():  # build every store first, outside the timing
        build_storage(config.loader, config.dataset, resolve_dataset(config.dataset))
    print(f"contention: {', '.join(rows)}, quiet and beside a {args.burner_threads}-thread "
          f"matmul loop in another process; {args.rounds} alternating rounds", flush=True)
    rounds = []
    for k in range(args.rounds):
        row = {f"{name}/quiet": runner_rate(cfg, args.seconds) for name, cfg in configs.items()}
        with Burner(args.burner_threads, seconds=60 + 3 * args.seconds * len(configs)):
            row.update({f"{name}/busy": runner_rate(cfg, args.seconds)
                        for name, cfg in configs.items()})
        rounds.append(row)
        print(f"  round {k + 1}: " + "; ".join(
            f"{name} {row[f'{name}/quiet']:,.0f} quiet, {row[f'{name}/busy']:,.0f} busy"
            for name in configs), flush=True)
    checks = []
    print(f"\n  {'store / crop':18s} {'quiet':>18s} {'busy':>18s}  busy / quiet (target "
          f">= {CONTENTION_TARGET:.0%})")
    for name in configs:
        quiet = [r[f"{name}/quiet"] for r in rounds]
        busy = [r[f"{name}/busy"] for r in rounds]
        shares = [b / q for b, q in zip(busy, quiet)]
        met = median(shares) >= CONTENTION_TARGET
        print(f"  {name:18s} {median(quiet):>9,.0f} ({min(quiet):,.0f}-{max(quiet):,.0f}) "
              f"{median(busy):>9,.0f} ({min(busy):,.0f}-{max(busy):,.0f})  "
              f"{'PASS' if met else 'FAIL'} {median(shares):.0%} "
              f"({min(shares):.0%}-{max(shares):.0%})")
        checks.append({"what": f"{name} busy / quiet", "ratio": median(shares),
                       "target": CONTENTION_TARGET, "met": met,
                       "spread": f"{min(shares):.2f}-{max(shares):.2f}"})
    return {"rounds": rounds, "targets": checks}
