"""The command line of ``python -m runner.bench``: one sub-command per bench (the package's
docstring lists them), a refused override in one line before any work.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

import runner.bench
from runner.bench import run_with_targets
from runner.bench.contention import bench_contention
from runner.bench.gil import bench_gil
from runner.bench.loaders import (
    OVERHEAD_BATCH,
    OVERHEAD_ITEMS,
    OVERHEAD_ROUNDS,
    OVERHEAD_WORKERS,
    bench_loaders,
    loader_targets,
    print_report,
)
from runner.bench.overhead import bench_overhead
from runner.bench.stores import bench_stores, print_store_targets
from runner.common.atomic import dumps
from runner.common.errors import EXIT_USER_ERROR, ConfigError
from runner.job.compose import job_refusal


def command_line() -> argparse.ArgumentParser:
    """``python -m runner.bench``'s parser: one sub-command per bench."""
    parser = argparse.ArgumentParser(prog="python -m runner.bench", description=runner.bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    # the options most benches share, each written once (argparse's parents)
    sized, written, overridden = (argparse.ArgumentParser(add_help=False) for _ in range(3))
    sized.add_argument("--size", type=int, default=224, help="images are SIZE x SIZE")
    written.add_argument("--out", type=Path, default=Path("outputs/bench"))
    overridden.add_argument("overrides", nargs="*",
                            help="runner overrides, e.g. dataset.path=/data")
    every = [sized, written, overridden]
    p = sub.add_parser("loaders", help="every loader against the memory-copy limit",
                       parents=every)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternating folder/naive rounds")
    t = sub.add_parser("stores", help="folder, packed, memmap and ram: center/random, warm/cold",
                       parents=every)
    t.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    t.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    g = sub.add_parser("gil", help="does each decoder release the GIL (1 thread vs one per core)",
                       parents=[sized, overridden])
    g.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    c = sub.add_parser("contention", help="each store quiet and beside another job's "
                                          "threads on the same cores", parents=every)
    c.add_argument("--batch-size", type=int, default=64)
    c.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    c.add_argument("--rounds", type=int, default=3, help="alternating quiet/busy rounds")
    c.add_argument("--burner-threads", type=int, default=2)
    v = sub.add_parser("overhead", help="the loop's own cost per batch against a DataLoader's "
                                        "(section 5 of loaders, in rounds)", parents=[written])
    # the defaults are section 5's of ``bench loaders``: one measurement, one figure
    v.add_argument("--items", type=int, default=OVERHEAD_ITEMS)
    v.add_argument("--batch-size", type=int, default=OVERHEAD_BATCH)
    v.add_argument("--rounds", type=int, default=OVERHEAD_ROUNDS)
    v.add_argument("--workers", type=int, default=OVERHEAD_WORKERS,
                   help="of the DataLoader as scripts set it")
    v.add_argument("overrides", nargs="*", help="(none used)")
    i = sub.add_parser("infer", help="an inference job with three models: the runner's one "
                                     "pass against the naive script and three separate runs",
                       parents=every)
    i.add_argument("--batch-size", type=int, default=32)
    i.add_argument("--steps", type=int, default=25, help="steps of each runner job")
    i.add_argument("--seconds", type=float, default=8.0, help="of the naive script a round")
    i.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    i.add_argument("--part", choices=("all", "compare", "ablation"), default="all",
                   help="the comparison against the targets, the ablation, or both")
    i.add_argument("--images", type=int, default=800, help="timed images of each ablation job")
    i.add_argument("--workers", type=int, default=2, help="ablation: loader workers added")
    i.add_argument("--writer-threads", type=int, default=2, help="ablation: writers added")
    i.add_argument("--compile", default="inductor", help="ablation: the backend added")
    i.add_argument("--outputs", default="topk,embeddings", help="task.outputs of the jobs")
    d = sub.add_parser("gpudecode", help="the GPU decoder against the best CPU decoder: "
                                         "the three GPU-decode targets (CUDA)",
                       parents=[written, overridden])
    d.add_argument("--batch-size", type=int, default=128)
    d.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    d.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    d.add_argument("--workers", type=int, default=0, help="loader workers (0: one per core)")
    from runner.bench.remote import add_parser as add_remote

    add_remote(sub, [sized, written])
    from runner.bench.pairs import add_parser as add_pairs

    add_pairs(sub, [sized, written])
    from runner.bench.yolo import add_parser as add_yolo

    add_yolo(sub, [written])
    sub.add_parser("selfcheck", add_help=False,  # its own command line: main() hands it over
                   help="every GPU claim, a row each that can fail (python -m runner.selfcheck;"
                        " selfcheck --help)").set_defaults(overrides=[])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["selfcheck"]:  # python -m runner.selfcheck's own options
        from runner.bench.selfcheck import main as selfcheck

        return selfcheck(argv[1:])
    args = command_line().parse_args(argv)
    why = job_refusal(args.overrides, runnable=False)  # a typo, a type, a choice: no work
    if why:
        print(f"error: {why}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        return run_bench(args)
    except ConfigError as e:  # a value these benches' configs cannot take
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_USER_ERROR


def run_bench(args: argparse.Namespace) -> int:
    """The bench ``args.command`` names; its exit status."""
    if args.command == "remote":
        from runner.bench.remote import bench_remote

        return run_with_targets("remote", bench_remote, args)
    if args.command == "pairs":
        from runner.bench.pairs import bench_pairs

        return run_with_targets("pairs", bench_pairs, args)
    if args.command == "yolo":
        from runner.bench.yolo import bench_yolo

        return run_with_targets("yolo", bench_yolo, args)
    if args.command == "infer":
        from runner.bench.ablation import bench_infer_parts

        return run_with_targets("infer", bench_infer_parts, args)
    if args.command == "gpudecode":
        from runner.bench.gpudecode import bench_gpu_decode

        return run_with_targets("gpudecode", bench_gpu_decode, args)
    if args.command == "gil":
        bench_gil(args)
        return 0
    if args.command == "contention":
        return run_with_targets("contention", bench_contention, args)
    if args.command == "overhead":
        return run_with_targets("overhead", bench_overhead, args)
    torch.manual_seed(0)
    if args.command == "stores":
        print(f"runner.bench stores on {platform.machine()} ({torch.get_num_threads()} "
              f"threads, torch {torch.__version__})", flush=True)
        base = [*args.overrides, f"dataset.image_size=[{args.size},{args.size}]",
                "model=none", "logger=none", "run.progress=false"]
        stores = bench_stores(args, base)
        checks = print_store_targets(stores)
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out / f"stores-{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
        out.write_text(dumps({"stores": stores, "targets": checks, "args": {
            k: str(v) for k, v in vars(args).items()}}, indent=2))
        print(f"\nwritten to {out}")
        return 0 if all(c["met"] for c in checks) else 1
    print(f"runner.bench loaders on {platform.machine()} ({torch.get_num_threads()} threads, "
          f"torch {torch.__version__})", flush=True)
    result = bench_loaders(args)
    print_report(result)
    store_checks = print_store_targets(result["stores"])
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"loaders-{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
    checks = [dict(zip(("what", "ratio", "target", "met"), c)) for c in loader_targets(result)]
    checks += store_checks
    out.write_text(dumps({**result, "targets": checks, "args": {
        k: str(v) for k, v in vars(args).items()}}, indent=2))
    print(f"\nwritten to {out}")
    return 0 if all(c["met"] for c in checks) else 1
