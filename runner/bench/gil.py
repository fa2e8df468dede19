"""``python -m runner.bench gil``: whether each decoder releases the GIL: the same files
decoded by one thread and by one thread per core.
"""

from __future__ import annotations

import argparse

from runner.bench import FOLDER, loader
from runner.data.decode.decoders import DECODERS, DecoderUnavailable
from runner.data.storage import build_storage, resolve_dataset
from runner.job.compose import compose
from runner.measure.clock import burst
from runner.measure.stats import median


def one_thread_rate(storage, seconds: float, threads: int = 1, files: int = 64) -> float:
    """images/s of read + decode + resize of ``storage``'s first files (page cache warm),
    by ``threads`` threads, each running torch ops on one core."""
    from runner.data.threads import one_core_pool

    indices = list(range(min(files, len(storage))))
    for i in indices:
        storage[i]  # warm: the page cache, the decoder's first-call set-up

    def chunk(part: list[int]) -> int:
        for i in part:
            storage[i]
        return len(part)

    with one_core_pool(threads) as pool:
        def all_files() -> int:
            return sum(pool.map(chunk, [indices[k::threads] for k in range(threads)]))

        rates = [burst(all_files, seconds=seconds / 3, min_calls=1, warmup=0)
                 for _ in range(3)]
    return median(rates)


def bench_gil(args: argparse.Namespace) -> dict:
    """Each decoder's decode + resize rate with one thread and with one thread per core."""
    from runner.data.threads import cores

    n = cores()
    out = {}
    print(f"decode + resize to {args.size}x{args.size}, 1 thread vs {n} threads "
          f"(ideal: {n:.1f}x when the GIL is released)")
    for d, k in DECODERS.items():
        for draft in ((False, True) if k.scales else (False,)):
            if k.cuda:
                continue
            cfg = compose([*args.overrides, f"dataset.image_size=[{args.size},{args.size}]",
                           loader(FOLDER), f"loader.decoder={d.value}", f"loader.draft={draft}"])
            name = f"{d.value}{'_draft' if draft else ''}"
            try:
                storage = build_storage(cfg.loader, cfg.dataset, resolve_dataset(cfg.dataset))
            except DecoderUnavailable as e:
                print(f"  {name:18s} skipped ({e})")
                continue
            one, many = one_thread_rate(storage, args.seconds), \
                one_thread_rate(storage, args.seconds, n)
            out[name] = {"one_thread": one, "threads": many, "speedup": many / one}
            print(f"  {name:18s} {one:>8,.0f} -> {many:>8,.0f} images/s: {many / one:.2f}x "
                  f"({'releases' if many / one >= 0.75 * n else 'holds'} the GIL)", flush=True)
    return out
