"""``python -m runner.bench pairs``: detection's image/label-file pairs read from the folder
against the one-file stores (packed, shards), cold and warm page cache, on the same images
and boxes: the founding notes' reason to pack pairs, measured.

The images are the generated shapes dataset (runner/data/sources/shapes.py) at ``--height``
x ``--width`` in the YOLO layout: one JPEG and one label file per image. Each store with
boxes that reads its files every epoch (``StorageKind.boxes`` and ``decodes_per_epoch``) is
read with the same centre crop to ``--size`` at the same batch size, its boxes carried in
every batch (``dataset.targets=yolo``); the one-file stores are built first, outside the
timing, at ``dataset.store_size`` = the images' shorter side, so they decode the same
pixels the folder does (re-encoded once at ``dataset.store_quality``).

What is timed is what a run does: **start-up** (the data path built: the folder listed, its
label files parsed, a store's fingerprint checked and its index and boxes read) and **one
epoch** (every image read, decoded, cropped, its boxes mapped and padded), both from a
**cold** page cache (every file of the dataset and of the store evicted first, with
``posix_fadvise``: runner/data/sources/pagecache.py; where eviction does not take, the row
says so) and from a **warm** one (the same run again). The folder opens two files per
image: each label file at start-up, each image every epoch; a one-file store opens one
file (its index and boxes read in a few large reads). Rows alternate store by store over
``--rounds``; each figure is the median over rounds with its range, each ratio taken
within a round.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from runner.bench import CPU, FOLDER
from runner.config.schema import StorageName
from runner.data import build_data_path
from runner.data.sources.pagecache import can_evict, evict, resident_fraction
from runner.data.storage import STORAGES, build_storage, resolve_dataset
from runner.job.compose import compose
from runner.measure.stats import median

# the founding notes' claim: one file beats the pairs, from a cold cache and a warm one
TARGET = 1.0


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser("pairs", help="detection's image/label pairs from the folder against "
                                     "packed and shards, cold and warm page cache",
                       parents=parents)
    p.add_argument("--images", type=int, default=2000, help="images in the generated set")
    p.add_argument("--height", type=int, default=320, help="of the generated images")
    p.add_argument("--width", type=int, default=320, help="of the generated images")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--cache-dir", type=Path, default=Path("outputs/bench/cache"),
                   help="where the generated set and the stores go")
    p.add_argument("overrides", nargs="*", help="runner overrides, e.g. loader.threads=2")


def pair_stores() -> list[StorageName]:
    """The storages compared: those that carry boxes and read their files every epoch."""
    return [name for name, kind in STORAGES.items() if kind.boxes and kind.decodes_per_epoch]


def dataset_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def timed_epoch(config, cold_paths: list[Path] | None) -> dict[str, float]:
    """Start-up and one epoch of ``config``'s data path (seconds, images/s), after evicting
    ``cold_paths`` from the page cache (None: warm)."""
    resident = None
    if cold_paths is not None:
        evict(cold_paths)
        resident = resident_fraction([str(p) for p in cold_paths], sample=256)
    t0 = time.perf_counter()
    data = build_data_path(config, CPU, epochs=1, progress=False)
    try:
        t1 = time.perf_counter()
        images = boxes = 0
        for batch in data:
            images += len(batch["label"])
            boxes += int(batch["box_count"].sum())
        t2 = time.perf_counter()
    finally:
        data.close()
    out = {"startup_s": t1 - t0, "epoch_images_per_s": images / (t2 - t1),
           "images_per_s": images / (t2 - t0), "images": images, "boxes": boxes}
    if resident is not None:
        out["resident_after_evict"] = resident
    return out


def bench_pairs(args: argparse.Namespace) -> dict:
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes

    spec = ShapesSpec(num_images=args.images, height=args.height, width=args.width)
    root = ensure_shapes(spec, args.cache_dir.expanduser())
    stores = pair_stores()
    size = args.size
    base = [*args.overrides, f"dataset.path={root}", "dataset.targets=yolo",
            "dataset.crop=center", f"dataset.image_size=[{size},{size}]",
            f"dataset.store_size={min(args.height, args.width)}",
            f"dataset.cache_dir={args.cache_dir.expanduser()}",
            f"loader.batch_size={args.batch_size}", "model=none", "logger=none",
            "run.progress=false", "dataset.page_cache=warm"]
    print(f"pairs: {args.images} images of {args.height}x{args.width} with their label "
          f"files ({root}); {', '.join(s.value for s in stores)}; centre crop to {size}, "
          f"batch {args.batch_size}; cold and warm page cache; {args.rounds} rounds",
          flush=True)
    if not can_evict():
        print("  this OS cannot evict files from the page cache: warm rows only")
    configs, files = {}, {}
    source = dataset_files(root)
    for name in stores:  # build the stores first, outside the timing
        config = compose([*base, f"loader={name.value}"])
        storage = build_storage(config.loader, config.dataset, resolve_dataset(config.dataset))
        configs[name.value] = config
        own = [Path(f) for f in storage.files] if name is not FOLDER else []
        store_dir = {Path(f).parent for f in own}
        files[name.value] = source + own + [p for d in store_dir for p in d.iterdir()
                                            if p.is_file() and p not in own]
        if own:
            print(f"  {name.value}: {sum(os.path.getsize(f) for f in own) / 1e6:,.1f} MB in "
                  f"{len(own)} file(s)", flush=True)
    caches = ("cold", "warm") if can_evict() else ("warm",)
    rounds: list[dict[str, dict[str, float]]] = []
    for k in range(args.rounds):
        row = {}
        for name, config in configs.items():
            for cache in caches:
                row[f"{name}/{cache}"] = timed_epoch(config, files[name] if cache == "cold"
                                                     else None)
        rounds.append(row)
        print(f"  round {k + 1} done", flush=True)
    return {"rounds": rounds, "targets": pair_targets(rounds, caches),
            "dataset": str(root)}


def pair_targets(rounds: list[dict], caches: tuple[str, ...]) -> list[dict]:
    """The figures (median and range over rounds) and each one-file store's ratio to the
    folder (start-up plus one epoch, within each round), PASS at ``TARGET``."""
    keys = list(rounds[0])
    print(f"\n  {'store / page cache':22s} {'start-up s':>16s} {'epoch images/s':>20s} "
          f"{'start-up + epoch, images/s':>30s}")
    for key in keys:
        cells = []
        for fig, fmt in (("startup_s", "{:.2f}"), ("epoch_images_per_s", "{:,.0f}"),
                         ("images_per_s", "{:,.0f}")):
            v = [r[key][fig] for r in rounds]
            cells.append(f"{fmt.format(median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})")
        note = ""
        resident = [r[key].get("resident_after_evict") for r in rounds]
        if any(x is not None and x > 0.1 for x in resident):
            note = f"   eviction did not take ({max(x for x in resident if x is not None):.0%} "\
                   "still cached)"
        print(f"  {key:22s} {cells[0]:>16s} {cells[1]:>20s} {cells[2]:>30s}{note}")
    boxes = {r[key]["boxes"] for r in rounds for key in keys}
    images = {r[key]["images"] for r in rounds for key in keys}
    print(f"  every row read {'/'.join(map(str, sorted(images)))} images and "
          f"{'/'.join(map(str, sorted(boxes)))} boxes")
    checks = []
    folder = FOLDER.value
    for key in keys:
        name, cache = key.split("/")
        if name == folder:
            continue
        ratios = [r[key]["images_per_s"] / r[f"{folder}/{cache}"]["images_per_s"]
                  for r in rounds]
        met = median(ratios) >= TARGET
        what = f"{name} / folder, {cache} page cache (start-up + epoch)"
        print(f"  {'PASS' if met else 'FAIL'}  {what}: {median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}), target >= {TARGET:.1f}x")
        checks.append({"what": what, "ratio": median(ratios), "min": min(ratios),
                       "max": max(ratios), "target": TARGET, "met": met})
    return checks
