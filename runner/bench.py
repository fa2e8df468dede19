"""``python -m runner.bench loaders``: every way of loading the same images, against the limit.

Measured in one run, on one machine, on the same images at one size (default 224x224):
  1. the limits: a contiguous memory copy of one batch's bytes, and a raw batched gather
     from the memmap cache into a preallocated batch;
  2. the per-item way the field starts from: a DataLoader over the memmap, one
     ``__getitem__`` per image and the default collate, 2 workers;
  3. the naive folder path: PIL decode, resize, float conversion on the CPU, per item,
     2 workers;
  4. the runner's own loaders (``model=none``, through the runner's loop): folder with each
     decoder, memmap and ram, in process and with 2 workers;
and, separately, which loop is fastest on a 300,000-element in-memory dataset (a
pure-Python loop over a list, the DataLoader as it comes and as scripts set it, a numpy
gather, the runner's batched loader: each one's cost per batch); then
the folder storage against its decode ceiling (one thread's read + decode + resize rate on
the same files, times the decode threads) at batch 32, 64 and 256, in alternating rounds.
Prints images/s, the ratios, whether each target holds, and writes the figures as JSON.

``python -m runner.bench stores`` (also section 8 of ``loaders``): the stores for datasets of
every size on the same images: folder (simplejpeg with DCT scaling, and the region decoder),
packed at store_size 256, memmap and ram, each with center and random crops at batch 64 and
256, memmap stored at 256 against stored at the output size, folder and packed with a cold
page cache; the bytes on disk; each target PASS/FAIL with the median and range of the
ratios over alternating rounds.

``python -m runner.bench gil``: whether each decoder releases the GIL: the same files
decoded by one thread and by one thread per core.

``python -m runner.bench infer``: an inference job with three models (runner/bench_infer.py).

``python -m runner.bench overhead``: section 5 alone (every loop's table), in ``--rounds``
rounds: the runner's own cost per batch against a DataLoader's, the median ratio and its
range, PASS/FAIL.

``python -m runner.bench remote``: shards and one object per JPEG from an S3 server on
loopback behind a delay line at 0/10/50 ms, against local disk, with faults injected and
webdataset's pipeline as the rival (runner/bench_remote.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from runner.atomic import dumps
from runner.clock import burst
from runner.compose import compose, job_refusal
from runner.config import Config, DatasetConfig, StorageName
from runner.data import build_data_path
from runner.data.loader import BatchStream, InProcessBatches, shutdown_workers
from runner.data.order import BatchOrder
from runner.data.storage import STORAGES, build_storage, decoded_once, resolve_dataset
from runner.data.storage.decode import DECODERS, DecoderUnavailable
from runner.data.storage.decoded import DecodedStorage
from runner.errors import EXIT_USER_ERROR, ConfigError
from runner.logger import NullLogger
from runner.loop import LoopOptions, run_loop
from runner.stats import median
from runner.tasks import DataOnlyStep

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


class PerItemMemmap(Dataset):
    """The field's starting point: one (image, label) per call, collated by the DataLoader."""

    def __init__(self, storage: DecodedStorage):
        self.images, self.labels = storage.images, storage.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]


class NaiveFolder(Dataset):
    """PIL decode, resize and crop in PIL, float tensor on the CPU: the slow path (the
    runner's centre crop: ``crop_fraction`` of the shorter side, "resize 256, crop 224")."""

    def __init__(self, samples: list[tuple[str, int]], size: tuple[int, int],
                 crop_fraction: float = DatasetConfig.crop_fraction):
        import torchvision.transforms as T

        self.samples = samples
        self.transform = T.Compose([T.Resize(round(min(size) / crop_fraction)),
                                    T.CenterCrop(size), T.ToTensor()])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), label


def limits(storage: DecodedStorage, batch_size: int, seconds: float) -> dict[str, float]:
    shape = (batch_size, *storage.image_shape)
    src = storage.images[:batch_size].clone()
    dst = torch.empty(shape, dtype=torch.uint8)
    copy = timed_rate(lambda: [dst.copy_(src)], seconds)
    out = torch.empty(shape, dtype=torch.uint8)
    order = BatchOrder(len(storage), batch_size, shuffle=True, drop_last=True, seed=0)
    gather = timed_rate(
        lambda: (torch.index_select(storage.images, 0, i, out=out) for i in order.batches()),
        seconds)
    return {"memcpy_limit": copy, "raw_memmap_gather": gather}


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


# the loops of section 5, each over the same in-memory items: (key, what it is)
LOOPS = (("python_s", "pure-Python loop over a list (np.stack per batch)"),
         ("dataloader_s", "DataLoader, per item, default (no workers)"),
         ("dataloader_workers_s",
          "DataLoader as scripts set it (workers, prefetch 4, pin on CUDA)"),
         ("numpy_s", "numpy gather (take per batch)"),
         ("runner_s", "runner's batched loader"))


def per_batch_overhead(n: int = 300_000, batch_size: int = 300, repeats: int = 3,
                       workers: int = 2) -> dict:
    """One epoch over n tiny in-memory items (the best of ``repeats``) by each loop of
    ``LOOPS``: a pure-Python loop over a list, PyTorch's DataLoader as it comes and as
    scripts set it (``workers`` workers, ``prefetch_factor=4``, ``pin_memory`` where there
    is CUDA, ``persistent_workers``: its workers' start is in the first epoch only), a
    numpy gather, the runner's batched loader. The items are so small that the time is
    each loop's own cost per batch (``per_batch_us``)."""
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,))

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    dataloader = DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True)
    scripted = DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True,
                          num_workers=workers, prefetch_factor=4,
                          pin_memory=torch.cuda.is_available(), persistent_workers=True)
    storage = DecodedStorage(images, labels, skipped=[], classes=["c"], names=[], root=None)
    order = BatchOrder(n, batch_size, shuffle=True, drop_last=False, seed=0)
    runner = InProcessBatches(storage, order, False)
    xs, ys = images.numpy(), labels.numpy()
    items = list(zip(xs, ys.tolist()))  # one (image, label) per element, as a list holds them

    def python_loop():
        perm = list(range(n))
        random.shuffle(perm)
        for k in range(0, n, batch_size):
            batch = [items[i] for i in perm[k : k + batch_size]]
            torch.from_numpy(np.stack([x for x, _ in batch])), torch.tensor([y for _, y in batch])

    def numpy_loop():
        perm = np.random.permutation(n)
        for k in range(0, n, batch_size):
            idx = perm[k : k + batch_size]
            xs.take(idx, axis=0), ys.take(idx)

    def consume(batches: Iterable) -> None:
        for _ in batches:  # each batch dropped before the next, as a training loop does
            pass

    try:
        seconds = {"python_s": best(python_loop),
                   "dataloader_s": best(lambda: consume(dataloader)),
                   "dataloader_workers_s": best(lambda: consume(scripted)),
                   "numpy_s": best(numpy_loop),
                   "runner_s": best(lambda: consume(BatchStream(runner, 1)))}
    finally:
        shutdown_workers(scripted)
    batches = -(-n // batch_size)
    return {**seconds, "per_batch_us": {k: 1e6 * v / batches for k, v in seconds.items()},
            "items": n, "batch_size": batch_size, "workers": workers}


def print_loops(o: dict) -> None:
    """Section 5's table: each loop's epoch, its cost per batch, against the runner's."""
    print(f"  {'loop':56s} {'s/epoch':>8s} {'us/batch':>9s} {'x runner':>9s}")
    for key, what in LOOPS:
        print(f"  {what:56s} {o[key]:8.3f} {o['per_batch_us'][key]:9.1f} "
              f"{o[key] / o['runner_s']:9.1f}")


def bench_loaders(args: argparse.Namespace) -> dict:
    base = [*args.overrides, f"dataset.image_size=[{args.size},{args.size}]",
            f"loader.batch_size={args.batch_size}", "model=none", "logger=none",
            "run.progress=false"]
    rates: dict[str, float] = {}
    print(f"preparing the memmap cache ({args.size}x{args.size})...", flush=True)
    memmap_cfg = compose([*base, loader(MEMMAP)])
    path = resolve_dataset(memmap_cfg.dataset)
    memmap = build_storage(memmap_cfg.loader, memmap_cfg.dataset, path, progress=True)
    folder = build_storage(compose([*base, loader(FOLDER)]).loader, memmap_cfg.dataset, path)
    if len(memmap) < 4 * args.batch_size:  # a few batches per epoch at least, or no timing
        smaller = max(1, len(memmap) // 4)
        print(f"only {len(memmap)} images: batch {args.batch_size} leaves fewer than 4 batches "
              f"per epoch; using batch {smaller} (--batch-size to choose)", flush=True)
        args.batch_size = smaller
        base = [o if not o.startswith("loader.batch_size=") else f"loader.batch_size={smaller}"
                for o in base]
    print(f"{len(memmap)} images from {path}; batch {args.batch_size}; "
          f"{args.seconds:g} s per measurement\n", flush=True)

    def record(name: str, fn: Callable[[], float]) -> None:
        try:
            rates[name] = fn()
            print(f"  {name:34s} {rates[name]:>10,.0f} images/s", flush=True)
        except DecoderUnavailable as e:
            print(f"  {name:34s} {'skipped':>10s}  ({e})", flush=True)

    print("1. limits")
    for name, rate in limits(memmap, args.batch_size, args.seconds).items():
        record(name, lambda rate=rate: rate)
    print("2. per-item DataLoader over the memmap (default collate, 2 workers)")
    per_item = DataLoader(PerItemMemmap(memmap), batch_size=args.batch_size, shuffle=True,
                          num_workers=2, persistent_workers=True)
    drained = {"warmup": 2 * 2 + 1, "min_batches": 10}  # 2 workers x prefetch_factor 2, + 1
    record("per_item_dataloader", lambda: timed_rate(lambda: per_item, args.seconds, **drained))
    shutdown_workers(per_item)  # idle workers would still hold memory and prefetched work
    print("3. naive folder path (PIL, float on the CPU, per item, 2 workers)")

    def naive_rate() -> float:
        naive = DataLoader(NaiveFolder(folder.samples, (args.size, args.size),
                                       memmap_cfg.dataset.crop_fraction),
                           batch_size=args.batch_size, shuffle=True, num_workers=2,
                           persistent_workers=True)
        try:
            return timed_rate(lambda: naive, args.seconds, **drained)
        finally:
            shutdown_workers(naive)

    record("naive_folder", naive_rate)
    print("4. the runner's loaders (model=none)")
    folder_cfgs = {}
    for decoder, overrides in cpu_decoders():
        for mode, extra in (("workers", ["loader.num_workers=2"]),
                            ("threads", ["loader.num_workers=0"])):
            name = f"{FOLDER.value}_{decoder}_{mode}"
            folder_cfgs[name] = compose([*base, loader(FOLDER), *overrides, *extra])
            record(name, lambda c=folder_cfgs[name]: runner_rate(c, args.seconds))
    for kind in decoded_once():
        name = kind.name.value
        record(name, lambda k=kind: runner_rate(compose([*base, loader(k.name)]), args.seconds))
        record(f"{name}_2_workers", lambda k=kind: runner_rate(
            compose([*base, loader(k.name), "loader.num_workers=2"]), args.seconds))
    print("5. which loop is fastest: 300,000 in-memory items, batch 300, one epoch (best of 3)")
    overhead = per_batch_overhead()
    print_loops(overhead)
    best = max((k for k in rates if k.startswith(f"{FOLDER.value}_")), key=rates.get)
    print(f"6. {best} against the naive path, alternating rounds (this machine's speed drifts "
          "between measurements; the median ratio of pairs taken together is the figure)")
    rounds = []
    for k in range(args.rounds):
        naive, fast = naive_rate(), runner_rate(folder_cfgs[best], args.seconds)
        rounds.append(fast / naive)
        print(f"  round {k + 1}: naive {naive:,.0f}, {best} {fast:,.0f} images/s: "
              f"{rounds[-1]:.2f}x", flush=True)
    stem = best.rsplit("_", 1)[0]  # the best decoder, in both modes: workers and threads
    ceiling = decode_ceiling(args, base, {mode: folder_cfgs[f"{stem}_{mode}"]
                                          for mode in ("workers", "threads")}, stem)
    stores = bench_stores(args, base)
    return {"rates": rates, "overhead": overhead, "folder_vs_naive_rounds": rounds,
            "best_folder": best, "ceiling": ceiling, "stores": stores}


def decode_ceiling(args: argparse.Namespace, base: list[str], modes: dict[str, Config],
                   name: str) -> dict:
    """The best decoder, decoding in worker processes and in threads, at batch 32, 64 and
    256 against its decode ceiling (one thread's read + decode + resize rate times the
    cores that decode), in alternating rounds: each round takes the ceiling and every
    measurement one after another, so a drift of the machine's speed moves them together."""
    from runner.data.threads import cores

    any_cfg = next(iter(modes.values()))
    storage = build_storage(any_cfg.loader, any_cfg.dataset, resolve_dataset(any_cfg.dataset))
    threads = cores()
    sizes = [b for b in (32, 64, 256) if 4 * b <= len(storage)] or [args.batch_size]
    print(f"7. {name} against its decode ceiling ({threads} cores x one thread's read + "
          "decode + resize), in workers and in threads, alternating rounds")
    rounds = []
    for k in range(args.rounds):
        ceiling = threads * one_thread_rate(storage, args.seconds)
        row = {"ceiling": ceiling}
        for mode, cfg in modes.items():
            for b in sizes:
                row[f"{mode}_batch_{b}"] = runner_rate(
                    compose([*best_overrides(cfg, base), f"loader.batch_size={b}"]), args.seconds)
        rounds.append(row)
        print(f"  round {k + 1}: ceiling {ceiling:,.0f}", flush=True)
        for mode in modes:
            print(f"    {mode:8s} " + "; ".join(
                f"batch {b}: {row[f'{mode}_batch_{b}']:,.0f} "
                f"({row[f'{mode}_batch_{b}'] / ceiling:.0%})" for b in sizes), flush=True)

    def median_share(mode: str) -> float:
        return median([min(r[f"{mode}_batch_{b}"] for b in sizes) / r["ceiling"]
                       for r in rounds])

    best = max(modes, key=median_share)  # the mode whose worst batch size is best
    print(f"  best mode: {best} (its slowest batch size at {median_share(best):.0%} of the "
          "ceiling, median of rounds)")
    return {"config": f"{name}_{best}", "mode": best, "threads": threads,
            "batch_sizes": sizes, "rounds": [{"ceiling": r["ceiling"], **{
                f"batch_{b}": r[f"{best}_batch_{b}"] for b in sizes}} for r in rounds],
            "all_rounds": rounds}


def store_rows() -> dict[str, tuple[StorageName, tuple[str, ...]]]:
    """The stores compared by ``bench stores`` (and section 8 of ``bench loaders``): each
    storage's own bench rows (its registry record), name -> (storage, overrides)."""
    return {name: (kind.name, overrides) for kind in STORAGES.values()
            for name, overrides in kind.bench.items()}


def folder_rows() -> list[str]:
    return [n for n, (k, _) in store_rows().items() if k is FOLDER]


def stored_jpegs(storage, count: int = 256) -> list[bytes]:
    """The first ``count`` stored JPEGs of a packed store, in memory."""
    return [storage.read(i) for i in range(min(count, len(storage)))]


def full_decoders() -> dict[str, Callable[[bytes], torch.Tensor]]:
    """Every CPU decoder available here (the registry's), as a full decode of one JPEG to a
    CHW uint8 tensor (a view of the decoder's HWC pixels)."""
    from runner.data.storage.decode import Box, decode_region, read_jpeg_header

    out: dict[str, Callable[[bytes], torch.Tensor]] = {}
    for name, kind in DECODERS.items():
        if kind.cuda or not kind.available():
            continue
        if kind.decode is not None:
            out[name.value] = lambda d, kind=kind: kind.decode(d, None)
        elif kind.region:  # the window decoder, asked for the whole image
            def whole(d: bytes) -> torch.Tensor:
                h = read_jpeg_header(d)
                return decode_region(d, h, Box(0, 0, h.height, h.width),
                                     (h.height, h.width))[0]

            out[name.value] = whole
    return out


def decode_limit(jpegs: list[bytes], size: tuple[int, int], batch_size: int, seconds: float,
                 threads: int) -> dict[str, float]:
    """images/s of each full decoder of ``jpegs`` plus the copy of each image's centre
    ``size`` window into a CHW batch buffer, by ``threads`` threads each filling its share
    of a batch (each running torch ops on one core, as the decode threads do)."""
    from runner.data.threads import one_core_pool

    out = torch.empty((batch_size, 3, *size), dtype=torch.uint8)
    counter = iter(range(10**12))
    rates = {}
    with one_core_pool(threads) as pool:
        for name, decode in full_decoders().items():
            def part(k: int, first: int, decode=decode) -> None:
                for slot in range(k, batch_size, threads):
                    img = decode(jpegs[(first + slot) % len(jpegs)])
                    h, w = img.shape[-2:]
                    top, left = (h - size[0]) // 2, (w - size[1]) // 2
                    out[slot].copy_(img[:, top : top + size[0], left : left + size[1]])

            def batch(part=part) -> int:
                first = next(counter) * batch_size
                for f in [pool.submit(part, k, first) for k in range(threads)]:
                    f.result()
                return batch_size

            rates[name] = burst(batch, seconds=seconds, min_calls=2, warmup=1)
    return rates


def grid_crop_rate(storage: DecodedStorage, size: tuple[int, int], batch_size: int,
                   seconds: float) -> float:
    """images/s of a batched gather plus the batched float ``grid_sample`` random crop on the
    CPU: the device crop memmap/ram random crops ran through on a CPU device before they
    were cut per image (what ``BatchAugment`` still does on a GPU)."""
    from runner.data.augment import BatchAugment

    augment = BatchAugment(size)
    order = BatchOrder(len(storage), min(batch_size, len(storage)), shuffle=True,
                       drop_last=True, seed=0, crop_seeds=True)
    batches = iter(())

    def batch() -> int:
        nonlocal batches
        index = next(batches, None)
        if index is None:
            batches = iter(order.batches())
            index = next(batches)
        images = storage.gather(index)[0]["image"]
        draws = augment.draws(order.seeds_for(index))
        augment(images, draws=draws)
        return len(index)

    return burst(batch, seconds=seconds, min_calls=2, warmup=1)


def bench_stores(args: argparse.Namespace, base: list[str]) -> dict:
    """Every store's bench rows on the same images: center and random crops at batch 64 and
    256, and a cold page cache (at batch 64, for the stores that read their files every
    epoch), in alternating rounds; each round also measures the packed store's decode
    limit (the fastest full decode of its stored JPEGs plus the copy into the batch
    buffer, on the decode threads) and the batched grid_sample crop memmap random crops
    used on a CPU; plus the bytes each store holds on disk."""
    from runner.data.threads import cores

    base = [o for o in base if not o.startswith("loader.batch_size=")]
    stores = store_rows()
    rows = [(name, crop, b, "warm") for b in (64, 256) for crop in ("center", "random")
            for name in stores]
    rows += [(name, "center", 64, "cold") for name, (k, _) in stores.items()
             if STORAGES[k].decodes_per_epoch]
    print(f"8. stores: {', '.join(stores)}; center and random crops; warm and cold page "
          f"cache; {args.rounds} alternating rounds", flush=True)
    built = {}
    for name, (_, extra) in stores.items():  # build every store first, outside the timing
        config = compose([*base, *extra])
        try:
            built[name] = build_storage(config.loader, config.dataset,
                                        resolve_dataset(config.dataset))
        except DecoderUnavailable as e:
            print(f"  {name}: skipped ({e})", flush=True)
            rows = [r for r in rows if r[0] != name]
    size = (args.size, args.size)
    packed, memmap = _row(PACKED), _row(MEMMAP)
    jpegs = stored_jpegs(built[packed]) if packed in built else []
    threads = cores()
    rounds: list[dict[str, float]] = []
    for k in range(args.rounds):
        row = {}
        if jpegs:
            for b in (64, 256):
                for name, rate in decode_limit(jpegs, size, b, args.seconds, threads).items():
                    row[f"decode limit/{name}/{b}"] = rate
                row[f"decode limit/{b}"] = max(v for key, v in row.items()
                                               if key.startswith("decode limit/")
                                               and key.endswith(f"/{b}"))
        if memmap in built:
            for b in (64, 256):
                row[f"{memmap}/random grid_sample/{b}"] = grid_crop_rate(
                    built[memmap], size, b, args.seconds)
        for name, crop, b, cache in rows:
            config = compose([*base, *stores[name][1], f"dataset.crop={crop}",
                              f"loader.batch_size={b}", f"dataset.page_cache={cache}"])
            row[f"{name}/{crop}/{b}/{cache}"] = runner_rate(config, args.seconds)
        rounds.append(row)
        print(f"  round {k + 1} done", flush=True)
    keys = list(rounds[0]) if rounds else []
    limit = any(key.startswith("decode limit/") for key in keys)
    print(f"  {'store / crop / batch / page cache':44s} {'median':>9s}  (min-max) images/s"
          + ("   share of the decode limit" if limit else ""))
    for key in keys:
        values = [r[key] for r in rounds]
        line = f"  {key:44s} {median(values):>9,.0f}  ({min(values):,.0f}-{max(values):,.0f})"
        b = key.split("/")[2] if key.count("/") == 3 else None
        if limit and b in ("64", "256") and not key.startswith("decode limit"):
            shares = [r[key] / r[f"decode limit/{b}"] for r in rounds]
            line += f"   {median(shares):.0%} ({min(shares):.0%}-{max(shares):.0%})"
        print(line)
    on_disk = {}
    for name, (kind, extra) in stores.items():
        config = compose([*base, *extra])
        files = build_storage(config.loader, config.dataset,
                              resolve_dataset(config.dataset)).files
        if STORAGES[kind].build is not None and files:
            on_disk[name] = sum(os.path.getsize(f) for f in files)
    print("  on disk: " + ", ".join(f"{n} {v / 1e6:,.1f} MB" for n, v in on_disk.items()))
    return {"rounds": rounds, "bytes": on_disk}


def _row(name: StorageName) -> str:
    """The first bench row of a storage (its plain configuration)."""
    return next(iter(STORAGES[name].bench))


def store_targets(stores: dict) -> list[tuple[str, float, float, str]]:
    """(what, median ratio, target, spread) for each target of the stores benchmark: each
    ratio is taken within a round, then the median and range over rounds."""
    rounds = stores["rounds"]
    folders, packed, memmap = folder_rows(), _row(PACKED), _row(MEMMAP)
    memmap_256 = [n for n in STORAGES[MEMMAP].bench if n != memmap][0]

    def best_folder(r: dict, crop: str, b: int, cache: str = "warm") -> float:
        return max(r.get(f"{f}/{crop}/{b}/{cache}", 0.0) for f in folders)

    def ratio(what: str, fn, target: float) -> tuple[str, float, float, str]:
        values = [fn(r) for r in rounds]
        return what, median(values), target, f"{min(values):.2f}-{max(values):.2f}"

    checks = []
    for b in (64, 256):
        checks.append(ratio(f"{packed} center / best folder center, batch {b}",
                            lambda r, b=b: r[f"{packed}/center/{b}/warm"] /
                            best_folder(r, "center", b), 1.5))
    for b in (64, 256):
        checks.append(ratio(f"best folder random / best folder center, batch {b}",
                            lambda r, b=b: best_folder(r, "random", b) /
                            best_folder(r, "center", b), 0.9))
    # (packed random against packed center is not a target: at crop fraction 0.875 its
    # centre crop is a window of the stored image with no resize, a random crop is resized;
    # both are held to their share of the decode limit instead)
    if any(k.startswith("decode limit/") for k in rounds[0]):
        for crop, target in (("center", 0.85), ("random", 0.7)):
            for b in (64, 256):
                checks.append(ratio(f"{packed} {crop} / the decode limit of its stored JPEGs, "
                                    f"batch {b}",
                                    lambda r, b=b, crop=crop: r[f"{packed}/{crop}/{b}/warm"] /
                                    r[f"decode limit/{b}"], target))
    if f"{memmap}/random grid_sample/64" in rounds[0]:
        for b in (64, 256):
            checks.append(ratio(f"{memmap} random (cut per image) / the batched grid_sample "
                                f"crop on the CPU, batch {b}",
                                lambda r, b=b: r[f"{memmap}/random/{b}/warm"] /
                                r[f"{memmap}/random grid_sample/{b}"], 5.0))
    checks.append(ratio(f"{packed} cold / best folder cold, batch 64",
                        lambda r: r[f"{packed}/center/64/cold"] / best_folder(r, "center", 64,
                                                                              "cold"), 3.0))
    for b in (64, 256):
        checks.append(ratio(f"{memmap_256}, random / {memmap} (stored at the output size), "
                            f"random, batch {b}",
                            lambda r, b=b: r[f"{memmap_256}/random/{b}/warm"] /
                            r[f"{memmap}/random/{b}/warm"], 0.8))
    size = stores["bytes"][memmap] / stores["bytes"][packed]
    checks.append((f"{memmap} at the output size / {packed}, bytes on disk", size, 4.0, "-"))
    return checks


def print_store_targets(stores: dict) -> list[dict]:
    out = []
    print("\nstore targets (median of rounds, range in brackets)")
    for what, value, target, spread in store_targets(stores):
        met = value >= target
        print(f"  {'PASS' if met else 'FAIL'}  {what}: {value:.2f}x ({spread}; target "
              f">= {target:g}x)")
        out.append({"what": what, "ratio": value, "target": target, "spread": spread,
                    "met": met})
    return out


def best_overrides(cfg: Config, base: list[str]) -> list[str]:
    """The overrides that compose ``cfg`` (a folder configuration of the bench), less the
    batch size."""
    chosen = cfg.loader
    return [o for o in base if not o.startswith("loader.batch_size=")] + [
        loader(FOLDER), f"loader.decoder={chosen.decoder.value}",
        f"loader.draft={chosen.draft}", f"loader.num_workers={chosen.num_workers}"]


def loader_targets(result: dict) -> list[tuple[str, float, float, bool]]:
    """(what, measured ratio, target, met) for each target of the loader benchmark."""
    r, o = result["rates"], result["overhead"]
    folder_best = max((v for k, v in r.items() if k.startswith(f"{FOLDER.value}_")),
                      default=0.0)
    checks = []
    for name in (k.name.value for k in decoded_once()):
        if name in r:
            checks.append((f"{name} / per-item DataLoader", r[name] / r["per_item_dataloader"], 4.0))
            checks.append((f"{name} / memcpy limit", r[name] / r["memcpy_limit"], 0.35))
    checks.append(("runner batched / DataLoader, per-batch overhead",
                   o["dataloader_s"] / o["runner_s"], OVERHEAD_TARGET))
    rounds = result.get("folder_vs_naive_rounds") or [folder_best / r["naive_folder"]]
    checks.append(("folder (best decoder) / naive folder, median of rounds", median(rounds),
                   4.0))
    ceiling = result.get("ceiling")
    if ceiling:
        for b in ceiling["batch_sizes"]:
            share = median([r[f"batch_{b}"] / r["ceiling"] for r in ceiling["rounds"]])
            checks.append((f"best folder at batch {b} / decode ceiling, median of rounds",
                           share, 0.8))
        if {64, 256} <= set(ceiling["batch_sizes"]):
            ratio = median([r["batch_64"] / r["batch_256"] for r in ceiling["rounds"]])
            checks.append(("best folder batch 64 / batch 256, median of rounds", ratio, 0.9))
    return [(what, ratio, target, ratio >= target) for what, ratio, target in checks]


def print_report(result: dict) -> None:
    r = result["rates"]
    print("\nratios")
    once = [k.name.value for k in decoded_once()]
    pairs = [("raw_memmap_gather", "memcpy_limit"), *((f"{n}_2_workers", n) for n in once),
             *((n, once[0]) for n in once[1:]), (once[0], "naive_folder")]
    for a, b in pairs:
        if a in r and b in r:
            print(f"  {a} / {b}: {r[a] / r[b]:.2f}")
    o = result["overhead"]
    print(f"  numpy loop / DataLoader (per-batch overhead): {o['dataloader_s'] / o['numpy_s']:.0f}x")
    ceiling = result.get("ceiling")
    if ceiling and "naive_folder" in r:
        ceilings = median([x["ceiling"] for x in ceiling["rounds"]])
        print(f"  decode ceiling ({ceiling['config'].rsplit('_', 1)[0]}) / naive_folder: "
              f"{ceilings / r['naive_folder']:.2f} (the most any folder "
              "configuration with this decoder can reach on these files)")
    print("\ntargets")
    for what, ratio, target, met in loader_targets(result):
        shown = f"{ratio:.0%}" if target < 1 else f"{ratio:.1f}x"
        wanted = f">= {target:.0%}" if target < 1 else f">= {target:g}x"
        print(f"  {'PASS' if met else 'FAIL'}  {what}: {shown} (target {wanted})")


# --- contention: another process on the same cores ---------------------------------------

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
        import sys

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


OVERHEAD_TARGET = 20.0  # runner batched / DataLoader, per-batch overhead (section 5)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("loaders", help="every loader against the memory-copy limit")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--size", type=int, default=224, help="images are SIZE x SIZE")
    p.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternating folder/naive rounds")
    p.add_argument("--out", type=Path, default=Path("outputs/bench"))
    p.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.path=/data")
    t = sub.add_parser("stores", help="folder, packed, memmap and ram: center/random, warm/cold")
    t.add_argument("--size", type=int, default=224, help="images are SIZE x SIZE")
    t.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    t.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    t.add_argument("--out", type=Path, default=Path("outputs/bench"))
    t.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.path=/data")
    g = sub.add_parser("gil", help="does each decoder release the GIL (1 thread vs one per core)")
    g.add_argument("--size", type=int, default=224, help="images are SIZE x SIZE")
    g.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    g.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.path=/data")
    c = sub.add_parser("contention", help="each store quiet and beside another job's "
                                          "threads on the same cores")
    c.add_argument("--size", type=int, default=224, help="images are SIZE x SIZE")
    c.add_argument("--batch-size", type=int, default=64)
    c.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    c.add_argument("--rounds", type=int, default=3, help="alternating quiet/busy rounds")
    c.add_argument("--burner-threads", type=int, default=2)
    c.add_argument("--out", type=Path, default=Path("outputs/bench"))
    c.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.path=/data")
    v = sub.add_parser("overhead", help="the loop's own cost per batch against a DataLoader's "
                                        "(section 5 of loaders, in rounds)")
    v.add_argument("--items", type=int, default=300_000)
    v.add_argument("--batch-size", type=int, default=300)
    v.add_argument("--rounds", type=int, default=5)
    v.add_argument("--workers", type=int, default=2, help="of the DataLoader as scripts set it")
    v.add_argument("--out", type=Path, default=Path("outputs/bench"))
    v.add_argument("overrides", nargs="*", help="(none used)")
    i = sub.add_parser("infer", help="an inference job with three models: the runner's one "
                                     "pass against the naive script and three separate runs")
    i.add_argument("--size", type=int, default=224, help="images are SIZE x SIZE")
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
    i.add_argument("--out", type=Path, default=Path("outputs/bench"))
    i.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.path=/data")
    from runner.bench_remote import add_parser as add_remote

    add_remote(sub)
    args = parser.parse_args(argv)
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
        from runner.bench_remote import bench_remote

        return run_with_targets("remote", bench_remote, args)
    if args.command == "infer":
        from runner.bench_ablation import bench_infer_parts

        return run_with_targets("infer", bench_infer_parts, args)
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


if __name__ == "__main__":
    raise SystemExit(main())
