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
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from runner.bench import FOLDER, MEMMAP, cpu_decoders, loader, runner_rate, timed_rate
from runner.bench.gil import one_thread_rate
from runner.bench.stores import bench_stores
from runner.config.schema import Config, DatasetConfig
from runner.data.decode.decoders import DecoderUnavailable
from runner.data.loading.loader import BatchStream, InProcessBatches, shutdown_workers
from runner.data.order import BatchOrder
from runner.data.storage import build_storage, decoded_once, resolve_dataset
from runner.data.storage.decoded import DecodedStorage
from runner.job.compose import compose
from runner.measure.stats import median


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


# the one measurement of the per-batch overhead, the same in ``bench loaders`` (section 5)
# and ``bench overhead`` (its flags default to these): a figure quoted once, from one place
OVERHEAD_ITEMS, OVERHEAD_BATCH, OVERHEAD_ROUNDS, OVERHEAD_WORKERS = 300_000, 300, 3, 2


def overhead_figure(items: int = OVERHEAD_ITEMS, batch_size: int = OVERHEAD_BATCH,
                    rounds: int = OVERHEAD_ROUNDS, workers: int = OVERHEAD_WORKERS,
                    repeats: int = 3) -> dict:
    """The runner's per-batch overhead against a DataLoader's: ``rounds`` rounds of
    ``per_batch_overhead``, each round's ratio taken from loops timed one after the other
    (a drift of the machine's speed moves both), their median and range. Every round runs
    with the machine's intra-op threads (a benchmark before it may have left fewer: the
    DataLoader's collate and the runner's gather are torch ops), so both benches measure
    under the same conditions.

    Returns:
        ``rounds`` (each round's ``per_batch_overhead``), ``ratio`` and ``numpy`` (DataLoader
        time over the runner's, over the numpy loop's: median, min, max), the parameters.
    """
    from runner.data.threads import cores, torch_threads

    done = []
    with torch_threads(cores()):
        for _ in range(rounds):
            done.append(per_batch_overhead(items, batch_size, repeats, workers))

    def spread(key: str) -> dict[str, float]:
        values = [o["dataloader_s"] / o[key] for o in done]
        return {"median": median(values), "min": min(values), "max": max(values)}

    return {"rounds": done, "ratio": spread("runner_s"), "numpy": spread("numpy_s"),
            "items": items, "batch_size": batch_size, "workers": workers, "target": OVERHEAD_TARGET,
            "met": spread("runner_s")["median"] >= OVERHEAD_TARGET}


def print_overhead(figure: dict) -> None:
    """``overhead_figure`` as both benches print it: each round's loops, then the figure."""
    print(f"per-batch overhead: {figure['items']:,} in-memory items, batch "
          f"{figure['batch_size']}, one epoch per loop (the best of 3), "
          f"{len(figure['rounds'])} rounds", flush=True)
    for k, o in enumerate(figure["rounds"]):
        print_loops(o)
        print(f"  round {k + 1}: DataLoader {o['dataloader_s']:.3f} s, runner "
              f"{o['runner_s']:.3f} s, numpy loop {o['numpy_s']:.3f} s per epoch; runner "
              f"{o['dataloader_s'] / o['runner_s']:.1f}x DataLoader", flush=True)
    r, n = figure["ratio"], figure["numpy"]
    print(f"\n  numpy loop / DataLoader: {n['median']:.1f}x ({n['min']:.1f}-{n['max']:.1f})")
    print(f"  {'PASS' if figure['met'] else 'FAIL'}  runner batched / DataLoader, per-batch "
          f"overhead: {r['median']:.1f}x ({r['min']:.1f}-{r['max']:.1f}; target >= "
          f"{OVERHEAD_TARGET:g}x)", flush=True)


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
    print("5. which loop is fastest (the figure ``bench overhead`` prints: one measurement)")
    overhead = overhead_figure()
    print_overhead(overhead)
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
    checks.append(("runner batched / DataLoader, per-batch overhead", o["ratio"]["median"],
                   OVERHEAD_TARGET))
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
    print(f"  numpy loop / DataLoader (per-batch overhead): {o['numpy']['median']:.0f}x")
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

OVERHEAD_TARGET = 20.0  # runner batched / DataLoader, per-batch overhead (section 5)
