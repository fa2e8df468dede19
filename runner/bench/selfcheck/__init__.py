"""``python -m runner.selfcheck``: every GPU claim of the project, a row each that can fail.

Run it first on a GPU node, from a source checkout, with the torch the node has (nothing
of the project installed; the small pure-Python dependencies from a wheelhouse, see
docs/gpu.md). It prints which torch, CUDA and GPU it certified, which missing package leaves
which row untested, then one row per claim with its figure and its verdict. ``--list``
prints every row and what makes it fail, without running anything.

- **sync**: the training recipes run with no per-step host sync (``torch.cuda``'s sync
  debug mode set to "error" over the timed steps, the data path's threads included), at
  64x128 px (the shape does not decide whether an op syncs): ``recipe=quick``; AdamW + EMA
  + clipping + accumulation; every ``task.augment`` option; memmap random crops on the
  device. Fails on the first implicit sync (an ``.item()``, a blocking copy, a boolean
  mask's ``nonzero``). On the CPU the debug mode sees nothing; tests/test_selfcheck.py
  checks there that recipe=quick's device stage makes no tensor from a host value.
- **prefetch**: memmap + ``prefetch=gpu`` + resnet50 bf16 training within 5% of the same
  step on a batch already on the device: plain, ``model.channels_last=true`` and random
  crops; and channels_last against not (fails when channels_last is slower).
- **transfers**: uint8 batches cross PCIe > 3x faster than float32; pinned > 1.2x pageable.
- **timing**: a source with a known host delay against a step of known GPU time:
  ``gpu_idle_frac`` as expected, the epoch-end pause left out, batches pinned.
- **inductor**: ``compile=inductor`` for training and for inference, verified against
  eager (fails on a mismatch or an error), its speed against eager shown; a small model
  (its compile time grows with the graph).
- **gpu-decode**: ``python -m runner.bench gpudecode``'s three targets, one round each: a
  folder with ``loader.decoder=nvjpeg`` >= 8,000 img/s with a worker per core (set for one
  H100/H200), >= 5x the documented best CPU decoder when both have 2 workers, and
  ``loader=packed`` on the GPU at least its CPU path with a worker per core each (and the
  CPU path's pixels: mean |difference| < 2 of 255).
- **pinned**: every batch the folder, packed and memmap loaders hand over is pinned.
- **detector-sync**: a detector (SSDlite) trains with amp=fp16 and amp=bf16, and with
  memmap's device crops moving its boxes (dataset.crop=random), with no implicit host sync.
- **fp16**, **fp16-numbers**: fp16 training with no per-step sync; a first step that
  overflows, then 5 steps against a reference SGD.
- **infer**: ``task=infer`` with two classifiers (probs, embeddings) and a segmentation
  model (masks) in bf16 on the GPU against the same run in float32 on the CPU (each CPU
  reference job runs beside its GPU job).
- **timeline**: ``run.timeline``'s GPU copy and compute lanes from CUDA events on a
  ``prefetch=gpu`` run: both there, each lane's spans in order, a copy overlapping a compute.
- **reduce-on**: ``task.reduce_on=device`` gives ``host``'s outputs (top-k of 1000 classes,
  masks) with fewer bytes crossing to the host (runs on the CPU too).
- **host-dtype**: ``loader.host_dtype``'s copy at 224 and 512 px: float16 >= 1.6x and
  float32 >= 3x uint8's time, 512 px >= 3x 224 px's, the converted batches pinned.
- **onnxruntime-gpu**: ``compile=onnxruntime`` on CUDA's execution provider verified against
  eager float32, its output on the GPU (untested without ``onnxruntime-gpu``).
- **resume**: a CUDA checkpoint (fused AdamW, EMA, bf16, dropout, a stop in the middle of
  an accumulation) resumed gives the weights an uninterrupted run gives.
- **tensorrt**, **tensorrt-job**: ``compile=tensorrt`` fp16 >= 1.5x eager fp16, verified,
  and the engine reused; ``python -m runner task=infer compile=tensorrt`` run twice. Where
  torch_tensorrt is missing the row says how to run them where it is installed.
- **dali-gpu**: ``loader=dali`` decodes on the GPU into the run's batches.
- **ddp**: two ranks through the project's process group; NCCL needs two GPUs, so on one
  GPU the row says so and runs the ranks on gloo.
- **map-ranks**: a detector's validation mAP over two gloo ranks spawned here (one GPU
  shared; without one, the CPU: it runs everywhere) equals one process's over the same
  images (13, dealt 7 and 6), each counted once.
- **bf16-targets**: a detector (SSDlite) and a segmenter (LR-ASPP) trained 60 steps in bf16
  on the GPU, then bf16 on the GPU against float32 on the CPU, the same weights and images:
  the head's class scores of every anchor within 0.02, >= 90% of the CPU's 10 best untied
  boxes an image found (same class, IoU >= 0.9, score within 0.05), mAP@0.5 within 0.02;
  masks >= 98% of pixels alike, mIoU within 0.02.
- **boxes-on-device**: memmap batches (a letterboxed store; the device crops) through a
  mosaic and box crops on the device under sync debug "error", against the CPU's replay of
  the same draws: boxes within 1e-3 px, pixels within one level, every box inside its image
  (the store's inside the letterbox's picture).

Rows that need a package the node lacks (TensorRT, DALI) are *untested*, listed apart from
the passes; a row asked for by ``--only`` that cannot run is a failure. Without CUDA every
GPU row is untested and only the rows that need no GPU run. Exit status 1 when a row fails;
a failed row names its innermost cause and its line (``harness.describe``: a StopIteration
a generator turned into a RuntimeError is named as the StopIteration, where it was raised).
A check may yield its rows: those it yielded before failing are kept beside the failure.
Each row prints the seconds it took (its check's total follows the check's rows).
``--out FILE`` writes the final table, after the node's header and the command, to FILE
(for a note). ``python -m runner.selfcheck --budget 600 --out selfcheck.txt`` is the whole
self-check in one call on a GPU node: the rows it runs there fit in ``NODE_BUDGET``
(tests/test_selfcheck.py sums their expected seconds). ``--budget SECONDS`` fits the run in a window: each check declares the seconds it is
expected to take on a fresh node (``Check.seconds``, shown by ``--list``), and a check that
would not fit in what is left of the budget (counted from the start, the header included) is
skipped and listed as untested with the reason; a later, shorter one may still run.

The package: this module collects the rows (``CHECKS``, in the order they run), runs them
and prints the table; harness.py holds what rows build on (the row record, the sync
detector, the timers); node.py what is said of the node first; the rows live by what they
check: train_rows.py (sync, detector-sync, fp16, fp16-numbers, resume, ddp), copy_rows.py (prefetch,
transfers, timing, pinned, timeline, host-dtype), decode_rows.py (gpu-decode, dali-gpu),
model_rows.py (inductor, tensorrt, tensorrt-job, infer, reduce-on, onnxruntime-gpu),
target_rows.py (map-ranks, bf16-targets, boxes-on-device: detectors' and segmenters').
``python -m runner.selfcheck`` and ``python -m runner.bench selfcheck`` run :func:`main`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from pathlib import Path

import torch

from runner.bench.selfcheck import harness
from runner.bench.selfcheck.copy_rows import (
    check_host_dtype,
    check_pinned_storages,
    check_prefetch,
    check_timeline,
    check_timing,
    check_transfers,
)
from runner.bench.selfcheck.decode_rows import check_dali, check_nvjpeg
from runner.bench.selfcheck.harness import Check, Row, describe, lap, on_cuda
from runner.bench.selfcheck.model_rows import (
    check_inductor,
    check_infer,
    check_onnxruntime,
    check_reduce_on,
    check_tensorrt,
    check_tensorrt_job,
)
from runner.bench.selfcheck.node import build_region, header, missing_dependencies
from runner.bench.selfcheck.target_rows import (
    check_bf16_targets,
    check_boxes_on_device,
    check_map_ranks,
)
from runner.bench.selfcheck.train_rows import (
    check_ddp,
    check_detector_sync,
    check_fp16_numbers,
    check_fp16_training,
    check_resume,
    check_sync,
)

# where torch_tensorrt is missing (the H200 node has none), how to measure these rows
TENSORRT_HOW = ("where it is installed (pip install torch-tensorrt, the release built for "
                "this torch), run: python -m runner.selfcheck --only tensorrt tensorrt-job")
# the detection extra's packages (a detector's mAP, a segmenter's mIoU), where a node lacks them
DETECTION = ("torchmetrics", "lightning_utilities", "pycocotools")
DETECTION_HOW = ("bring them as wheels (pip download torchmetrics lightning-utilities "
                 "pycocotools into docs/gpu.md's wheelhouse) and run: python -m "
                 "runner.selfcheck --only map-ranks bf16-targets")
# the whole self-check in one call on a GPU node (--budget 600): the rows it runs there
# (those needing no package it lacks) fit in this many seconds, the header and build included
NODE_BUDGET = 600
HEADER_SECONDS = 60  # the header, the region decoder's build

CHECKS: list[Check] = [
    Check("sync", "each recipe (recipe=quick; AdamW + EMA + clipping + accumulation; every "
          "task.augment option; memmap random crops) trains 8 steps at 64x128 px with no "
          "implicit host sync; fails on the first sync the debug mode catches", check_sync,
          seconds=40),
    Check("prefetch", "prefetch=gpu's step within 5% of the model alone (plain, "
          "channels_last, random crops) with no sync; fails above 1.05x; and channels_last "
          "fails when slower than NCHW", check_prefetch, seconds=30),
    Check("transfers", "uint8 over PCIe > 3x faster than float32, pinned > 1.2x pageable",
          lambda a: check_transfers(a.size, a.batch_size), seconds=5),
    Check("timing", "gpu_idle_frac within 0.15 of a known idle share, epoch pauses left out, "
          "every batch pinned", lambda a: check_timing(min(a.batch_size, 64)), seconds=10),
    Check("inductor", "compile=inductor train and infer (a small model) match eager within "
          "the amp tolerance; fails on a mismatch or an error", check_inductor, seconds=40),
    Check("gpu-decode", "nvjpeg: a folder >= 8,000 img/s with a worker per core (H100/H200), "
          ">= 5x the best CPU decoder at 2 workers each, packed >= its CPU path (and its "
          "pixels); fails below any", check_nvjpeg, seconds=45),
    Check("pinned", "every batch of folder, packed and memmap is pinned; fails on one "
          "pageable tensor", lambda a: check_pinned_storages(min(a.batch_size, 64)),
          seconds=10),
    Check("detector-sync", "a detector (SSDlite) trains with amp=fp16 and amp=bf16, and "
          "with memmap device crops moving its boxes, 6 steps each with no implicit host "
          "sync; fails on the first sync the debug mode catches", check_detector_sync,
          seconds=40),
    Check("boxes-on-device", "memmap batches (a letterboxed store; the device crops) through "
          "a mosaic and box crops on the device with no implicit host sync, boxes as the "
          "CPU's replay of the same draws (1e-3 px) and inside the image; fails on a sync or "
          "a box astray", check_boxes_on_device, seconds=15),
    Check("bf16-targets", "a detector and a segmenter trained 60 steps in bf16, then bf16 on "
          "the GPU vs float32 on the CPU: anchors' class scores within 0.02, >= 90% of the "
          "CPU's 10 best untied boxes an image found (IoU >= 0.9, score within 0.05), "
          "mAP@0.5 within 0.02; masks >= 98% of pixels "
          "alike, mIoU within 0.02", check_bf16_targets, packages=DETECTION, seconds=60,
          how=DETECTION_HOW),
    Check("fp16", "amp=fp16 training with no per-step sync",
          lambda a: check_fp16_training(a.size, min(a.batch_size, 64)), seconds=5),
    Check("fp16-numbers", "an fp16 step that overflows is skipped, then 5 steps match a "
          "reference SGD within 1e-2", lambda a: check_fp16_numbers(64, 32), seconds=5),
    Check("infer", "two classifiers and a segmenter, bf16 on the GPU vs float32 on the CPU: "
          "probs within 0.02, embeddings at cosine >= 0.99, masks >= 95% alike",
          check_infer, seconds=60),
    Check("resume", "a CUDA checkpoint resumed mid-accumulation gives an uninterrupted run's "
          "weights and EMA (within the GPU's own run-to-run difference)", check_resume,
          seconds=10),
    Check("timeline", "run.timeline's GPU copy and compute lanes from CUDA events, each in "
          "order, a copy overlapping a compute (prefetch=gpu); fails on a missing lane, "
          "spans out of order or no overlap", check_timeline, seconds=30),
    Check("reduce-on", "task.reduce_on=device gives host's outputs (topk, masks) with fewer "
          "bytes to the host; fails on another output or as many bytes", check_reduce_on,
          seconds=10),
    Check("host-dtype", "loader.host_dtype's copy at 224 and 512 px: float16 >= 1.6x and "
          "float32 >= 3x uint8's, 512 px >= 3x 224 px, batches pinned; fails below",
          check_host_dtype, seconds=5),
    Check("onnxruntime-gpu", "compile=onnxruntime on CUDA's provider (I/O binding) verified "
          "against eager float32, output on the GPU, speed shown; fails on a mismatch or a "
          "CPU fallback (untested without onnxruntime-gpu)", check_onnxruntime,
          packages=("onnxruntime", "onnx", "onnxscript"), seconds=30),
    Check("tensorrt", "compile=tensorrt fp16 >= 1.5x eager fp16, verified; a cached engine "
          "takes a short last batch without a rebuild",
          lambda a: check_tensorrt(a.size, a.batch_size), packages=("torch_tensorrt",),
          seconds=90, how=TENSORRT_HOW),
    Check("tensorrt-job", "python -m runner task=infer compile=tensorrt (fp16, bf16, both "
          "engine formats) runs, and its second run reuses the engine",
          lambda a: check_tensorrt_job(), packages=("torch_tensorrt",), seconds=240,
          how=TENSORRT_HOW),
    Check("dali-gpu", "the DALI loader decodes into device batches of the run's shape", check_dali,
          packages=("nvidia.dali",), seconds=15),
    Check("map-ranks", "a detector's validation mAP over 2 gloo ranks spawned here (one GPU "
          "shared, or the CPU) equals one process's over the same 13 images, each counted "
          "once; fails on another figure, a lost image, an error or a hang",
          check_map_ranks, cuda=False, packages=DETECTION, seconds=30, how=DETECTION_HOW),
    Check("ddp", "2 ranks through the project's process group end with replicas in sync "
          "(NCCL on 2 GPUs; on fewer, gloo, and the row says NCCL is untested)",
          lambda a: check_ddp(), cuda=False, seconds=30),
]


NAMES = [c.name for c in CHECKS]


def missing(check: Check) -> list[str]:
    """The packages a check needs that this Python cannot import."""
    out = []
    for name in check.packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def table(rows: list[Row]) -> str:
    """A line per row: its verdict, the seconds it took (a column only where a row that ran
    has them), what it claims, its figure."""
    if not rows:
        return ""
    width = max(len(r.check) for r in rows)
    verdict = {True: "PASS", False: "FAIL", None: "UNTESTED"}
    timed = any(r.ok is not None and r.seconds is not None for r in rows)

    def took(r: Row) -> str:
        if not timed:
            return ""
        shown = r.ok is not None and r.seconds is not None
        return f"{r.seconds:6.1f} s  " if shown else " " * 10

    return "\n".join(f"{verdict[r.ok]:<8}  {took(r)}{r.check:<{width}}  {r.figure}"
                     for r in rows)


def listing() -> str:
    width = max(len(c.name) for c in CHECKS)
    return "\n".join(f"{c.name:<{width}}  {'GPU' if c.cuda else 'any'}  {c.seconds:>4g} s  "
                     f"{c.claim}" + (f" [needs {', '.join(c.packages)}]" if c.packages else "")
                     for c in CHECKS)


def positive_seconds(text: str) -> float:
    """``--budget``'s value: seconds above zero (argparse says the bad value in one line)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0, "
                                         "e.g. --budget 330")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.selfcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--only", nargs="*", choices=NAMES,
                        help="these rows only; one that cannot run here is a failure")
    parser.add_argument("--list", action="store_true", help="each row and what fails it")
    parser.add_argument("--no-build", action="store_true",
                        help="never compile the region decoder's binding in place")
    parser.add_argument("--out", type=Path, metavar="FILE",
                        help="also write the final table (with the header and the command) "
                             "to FILE, for a note")
    parser.add_argument("--budget", type=positive_seconds, metavar="SECONDS",
                        help="run only what fits in SECONDS from the start (each row's "
                             "expected seconds against what is left); the rest is listed "
                             "as untested")
    args = parser.parse_args(argv)
    started = time.perf_counter()  # --budget counts from here: the header and build too
    if args.list:
        print(listing())
        return 0
    cuda = on_cuda() and torch.cuda.is_available() or harness.DEVICE == "cpu"
    said_first = header()
    print(said_first, flush=True)
    lacking_deps = missing_dependencies()
    if lacking_deps:
        print(f"missing the project's dependencies {', '.join(lacking_deps)}: bring them as "
              "wheels (docs/gpu.md, 'Self-check on an offline GPU node') and run again")
        from runner.common.errors import EXIT_USER_ERROR

        return EXIT_USER_ERROR
    if cuda and not args.no_build:
        print(build_region(), flush=True)
    lacking = {c.name: missing(c) for c in CHECKS}
    said = sorted({p for names in lacking.values() for p in names})
    if said:
        print("missing: " + "; ".join(
            f"{p} (untested: {', '.join(n for n, m in lacking.items() if p in m)})"
            for p in said), flush=True)
    rows: list[Row] = []
    for check in CHECKS:
        asked = bool(args.only) and check.name in args.only
        if args.only and not asked:
            continue
        why = None
        if check.cuda and not cuda:
            why = "no CUDA device here"
        elif lacking[check.name]:
            why = f"{', '.join(lacking[check.name])} not installed" + (
                f"; {check.how}" if check.how else "")
        if why is not None:
            # an explicitly requested row that cannot run fails; otherwise it is untested
            rows.append(Row(check.name, False if asked else None, why, seconds=None))
            continue
        left = None if args.budget is None else args.budget - (time.perf_counter() - started)
        if left is not None and check.seconds > left:  # the user's window: untested, said
            rows.append(Row(check.name, None, f"skipped by --budget {args.budget:g} s: "
                                              f"expected {check.seconds:g} s, {max(left, 0):.1f}"
                                              " s left", seconds=None))
            continue
        before, t0 = len(rows), time.perf_counter()
        lap()  # the check's first row counts from here
        try:
            for row in check.run(args):  # a generator's rows are kept as they come
                rows.append(row)
        except Exception as e:  # one broken path never hides the others
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(check.name, False, describe(e)))
        print(table(rows[before:]) + f"\n          ({check.name}: "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    done = [r for r in rows if r.ok is not None]
    untested = [r for r in rows if r.ok is None]
    passed = sum(bool(r.ok) for r in done)
    final = (f"{passed} passed, {len(done) - passed} failed, {len(untested)} untested in "
             f"{time.perf_counter() - started:.0f} s\n{table(done)}"
             + (f"\n\nuntested here:\n{table(untested)}" if untested else ""))
    print("\n" + final)
    if args.out is not None:
        write_table(args.out, said_first, argv, final)
    return 1 if any(r.ok is False for r in rows) else 0


def write_table(path: Path, said_first: str, argv: list[str] | None, final: str) -> None:
    """The final table, after the node's header and the command that made it (``--out``)."""
    command = " ".join(["python -m runner.selfcheck", *(sys.argv[1:] if argv is None
                                                        else argv)])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{said_first}\n$ {command}\n\n{final}\n")
        print(f"\nthe table: {path}")
    except OSError as e:  # the run's verdicts stand; the file is a convenience
        print(f"\nthe table could not be written to {path}: {e}")

