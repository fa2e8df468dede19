"""``python -m runner.bench infer``'s ablation: which change bought an inference job's speed.

Starting from the naive script (bench_infer.py's ``naive_rate``: per image, batch 1, the
logits reduced on the host, each line written at once), the runner's job is run with the
script's choices (``loader.batch_size=1``, ``loader.num_workers=0`` decoding in the main
thread, ``task.reduce_on=host``, ``task.writer_threads=0``, ``compile=eager``), then with
each change added in turn: batching, parallel loader workers, reducing on the device,
threaded writes, compiling. Each row is measured in every round (rows alternate within a
round, so a neighbour's load falls on all of them alike): its images/s is the median over
the rounds, with their spread, and its share of the total gain is its gain over the row
before divided by the last row's rate minus the naive script's (the shares add up to 1).

The models are the stand-ins (three ``mobilenet_v3_small``) unless the overrides name the
user's own (``model=...``/``model.*`` or ``models=[...]``, as in a run): then those, the
naive script loading each as the runner does (its weights, mean and std).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.bench.infer import bench_infer, make_weights, naive_rate, runner_job, stand_ins
from runner.config.rules import model_configs
from runner.data.sources.listing import list_images
from runner.data.storage import resolve_dataset
from runner.job.compose import compose
from runner.measure.stats import median

NAIVE = "naive script"
WARMUP = 3  # steps of each job before its timed ones


@dataclass
class Row:
    """One step of the ablation: its name and the overrides it adds to the row before."""

    name: str
    adds: list[str]
    rates: list[float] = field(default_factory=list)


def chain(batch_size: int, workers: int, writer_threads: int, compile_name: str) -> list[Row]:
    """The rows, in the order the changes are added."""
    return [Row(NAIVE, []),
            Row("runner as the script (batch 1, main thread, host reduce, sync writes)",
                ["loader.batch_size=1", "loader.num_workers=0", "loader.decode_threads=0",
                 "task.reduce_on=host", "task.writer_threads=0", "compile=eager"]),
            Row(f"+ batching (batch {batch_size})", [f"loader.batch_size={batch_size}"]),
            Row(f"+ parallel loader workers ({workers})", [f"loader.num_workers={workers}"]),
            Row("+ reduce on the device", ["task.reduce_on=device"]),
            Row(f"+ threaded writes ({writer_threads} threads)",
                [f"task.writer_threads={writer_threads}"]),
            Row(f"+ compile ({compile_name})", [f"compile={compile_name}"])]


def user_models(overrides: list[str]) -> bool:
    """Whether the overrides name the user's own models (``model=``, ``model.*``,
    ``models=``), as a run takes them."""
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    return any(k in ("model", "models") or k.startswith("model.") for k in keys)


def shares(rows: list[Row]) -> list[dict[str, Any]]:
    """Each row's median images/s, spread, gain over the row before and share of the total
    gain (None when the rows gained nothing in all); ``within_noise`` where its rounds'
    range overlaps the row before's (its gain is not told from the machine's drift)."""
    medians = [median(r.rates) for r in rows]
    total = medians[-1] - medians[0]
    out = []
    for k, (row, mid) in enumerate(zip(rows, medians)):
        gain = mid - medians[k - 1] if k else 0.0
        out.append({"row": row.name, "overrides": row.adds, "images_per_sec": mid,
                    "min": min(row.rates), "max": max(row.rates), "rounds": row.rates,
                    "gain": gain, "share": gain / total if k and total else None,
                    "within_noise": bool(k) and min(row.rates) <= max(rows[k - 1].rates)
                    and max(row.rates) >= min(rows[k - 1].rates)})
    return out


def bench_ablation(args: argparse.Namespace) -> dict[str, Any]:
    """Every row in each of ``args.rounds`` rounds; the table printed and returned."""
    work = Path(args.out) / "infer"
    work.mkdir(parents=True, exist_ok=True)
    base = [*args.overrides, "task=infer", f"dataset.image_size=[{args.size},{args.size}]",
            f"run.warmup_steps={WARMUP}", "logger=none", "diagnose=false", "run.timeline=false",
            "run.progress=false", f"task.outputs=[{args.outputs}]"]
    if not user_models(args.overrides):
        weights = make_weights(work / "weights")
        entries = ",".join(f"{{name:{m.name},weights:{m.weights},alias:{m.alias}}}"
                           for m in stand_ins(weights))
        base.append(f"+models=[{entries}]")
    config = compose(base)
    models = model_configs(config)
    listing = list_images(config.dataset, resolve_dataset(config.dataset))
    files = [p for p, _ in listing.samples]
    rows = chain(args.batch_size, args.workers, args.writer_threads, args.compile)
    print(f"\nablation: {', '.join(m.label for m in models)}, outputs [{args.outputs}], "
          f"{args.size}x{args.size}, {args.images} timed images a job, {args.rounds} rounds",
          flush=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            rows[0].rates.append(naive_rate(files, models, args.size, tmp / "naive.csv",
                                            args.seconds, len(listing.classes)))
            overrides = list(base)
            for k, row in enumerate(rows[1:], start=1):
                overrides += row.adds
                batch = int(next(o for o in reversed(overrides)
                                 if o.startswith("loader.batch_size=")).split("=")[1])
                steps = WARMUP + max(math.ceil(args.images / batch), 2)  # timed after
                m = runner_job([*overrides, f"run.steps={steps}"], tmp / f"r{r}-{k}")
                row.rates.append(m["images_per_sec"])
            print(f"  round {r + 1}: " + ", ".join(f"{row.rates[-1]:,.1f}" for row in rows),
                  flush=True)
    table = shares(rows)
    width = max(len(t["row"]) for t in table)
    print(f"\n  {'step (each adds to the one above)':{width}s} {'images/s':>9s}  "
          f"{'spread':>15s}  {'share of gain':>13s}")
    for t in table:
        share = "" if t["share"] is None else f"{t['share']:.0%}"
        share += " ~" if t["within_noise"] else ""
        print(f"  {t['row']:{width}s} {t['images_per_sec']:9,.1f}  "
              f"{t['min']:>7,.1f}-{t['max']:<7,.1f}  {share:>13s}")
    print(f"  total: {table[-1]['images_per_sec'] / table[0]['images_per_sec']:.2f}x the "
          "naive script")
    if any(t["within_noise"] for t in table):
        print("  ~: its rounds' range overlaps the row above's: that gain is within this "
              "machine's noise (more --rounds and --images, or a quieter machine)")
    return {"models": [m.label for m in models], "rows": table}


def bench_infer_parts(args: argparse.Namespace) -> dict[str, Any]:
    """``bench infer``: the comparison against its targets (bench_infer.py), the ablation,
    or both (``args.part``)."""
    out: dict[str, Any] = {"targets": []}
    if args.part in ("all", "compare") and user_models(args.overrides):
        print("the comparison and its targets are the stand-ins' (three weights of "
              "one model): with your models, only the ablation runs", flush=True)
    elif args.part in ("all", "compare"):
        out = bench_infer(args)
    if args.part in ("all", "ablation"):
        out["ablation"] = bench_ablation(args)
    return out
