"""``python -m runner.bench <name>``: the project's benches, one module each, on one machine, each
target printed PASS/FAIL with the ratios measured in one run (medians over alternating
rounds, with their range), the figures written as JSON under ``outputs/bench``.

- ``loaders`` (loaders.py): every way of loading the same images against the memory-copy
  limit, which loop is fastest, the folder against its decode ceiling;
- ``stores`` (stores.py): the stores for datasets of every size, center and random crops,
  warm and cold;
- ``gil`` (gil.py): whether each decoder releases the GIL;
- ``contention`` (contention.py): each store quiet and beside another job's threads;
- ``overhead`` (overhead.py): the loop's own cost per batch against a DataLoader's;
- ``infer`` (infer.py, ablation.py): an inference job with three models against the naive
  script, and what each change buys;
- ``remote`` (remote.py): shards and one object per JPEG over a delay line, a far disk;
- ``pairs`` (pairs.py): detection's image/label-file pairs from the folder against the
  one-file stores, cold and warm;
- ``yolo`` (yolo.py): ultralytics' own YOLO dataloader against the folder and packed
  paths, decode and letterbox of the same YOLO folder;
- ``gpudecode`` (gpudecode.py): ``loader.decoder=nvjpeg`` against the best CPU decoder on
  its three targets (CUDA);
- ``selfcheck`` (selfcheck/): every GPU claim of the project, a row each that can fail
  (also ``python -m runner.selfcheck``).

The command line is cli.py. This module holds what the benches share: the storages they
compare, the CPU decoders, and the runner's own rate of a config through its loop.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Iterable

import torch

from runner.common.atomic import dumps
from runner.config.schema import Config, StorageName
from runner.data import build_data_path
from runner.data.decode.decoders import DECODERS
from runner.measure.clock import burst
from runner.measure.metrics import NullLogger
from runner.tasks import DataOnlyStep
from runner.tasks.loop import LoopOptions, run_loop

CPU = torch.device("cpu")
# what the bench compares against each other: the image folder as it is (decoded every
# epoch), the decode-once store whose raw gather is the limit, and the packed store
FOLDER, MEMMAP, PACKED = StorageName.folder, StorageName.memmap, StorageName.packed


def loader(name: StorageName) -> str:
    return f"loader={name.value}"


def cpu_decoders() -> list[tuple[str, list[str]]]:
    """(row name, overrides) for every CPU decoder, with DCT scaling where it has it."""
    rows = []
    for d, k in DECODERS.items():
        if not k.cuda:
            rows.append((f"{d.value}{'_draft' if k.scales else ''}",
                         [f"loader.decoder={d.value}", f"loader.draft={k.scales}"]))
    return rows


def timed_rate(batches: Callable[[], Iterable], seconds: float, warmup: int = 1,
               min_batches: int = 2) -> float:
    """Images/s over ``seconds`` (and ``min_batches``) of batches after ``warmup`` batches.

    A DataLoader's workers fill their queue (workers x prefetch_factor batches) before the
    first batch is taken: the warm-up must drain it, or a short window counts that
    backlog as throughput.
    """

    def endless():
        while True:
            yield from batches()

    it = endless()

    def one_batch() -> int:
        batch = next(it)
        return len(batch[0]) if isinstance(batch, list | tuple) else len(batch)

    return burst(one_batch, seconds=seconds, min_calls=min_batches, warmup=warmup)


def runner_rate(config: Config, seconds: float, device: torch.device = CPU) -> float:
    """images/s of the runner's data path for ``config`` (model=none), through the runner's
    loop: built by ``runner.data.build_data_path`` as a run builds it, so every stage a run
    has is timed (GPU decoding for nvjpeg, the prefetcher, the copy to ``device``).

    A short probe sizes the timed run to about ``seconds``.
    """
    data = build_data_path(config, device, epochs=1, progress=True)

    def loop(steps: int, warmup: int) -> float:
        data.extend(steps)  # one pass of the stream reads at least this many batches
        result = run_loop(data, DataOnlyStep(), NullLogger(), LoopOptions(
            total_steps=steps, warmup_steps=warmup, log_every=10**9, repeats=1))
        return result.timed.figures()["images_per_sec"]

    try:
        per_epoch = data.steps_per_epoch
        probe = loop(max(4, min(per_epoch, 8)), warmup=2)
        steps = max(2 * per_epoch, 6, int(probe * seconds / config.loader.batch_size))
        return loop(steps, warmup=min(5, per_epoch, steps // 2))
    finally:
        data.close()


def run_with_targets(name: str, bench: Callable[[argparse.Namespace], dict],
                     args: argparse.Namespace) -> int:
    """One bench that returns its rounds and targets: the header, the JSON under
    ``args.out``, exit status 0 when every target holds."""
    print(f"runner.bench {name} on {platform.machine()} ({torch.get_num_threads()} "
          f"threads, torch {torch.__version__})", flush=True)
    result = bench(args)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{name}-{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
    out.write_text(dumps({**result, "args": {k: str(v) for k, v in vars(args).items()}},
                              indent=2))
    print(f"\nwritten to {out}")
    return 0 if all(c["met"] for c in result["targets"]) else 1
