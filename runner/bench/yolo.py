"""``python -m runner.bench yolo``: the detection user's own loader, ultralytics' YOLO
dataloader, against the runner's folder and packed paths on the same YOLO folder and the
same work.

The images are the generated shapes dataset (runner/data/sources/shapes.py) at ``--height``
x ``--width`` in the YOLO layout (``images/train`` beside ``labels/train``); both sides read
its training split, shuffled, at the same batch size, with the same number of workers, and
do the same work: decode each JPEG and letterbox it to ``--size`` square (aspect kept,
padded with grey 114), its boxes carried in every batch, no augmentation.

- **ultralytics**: ``ultralytics.data.build.build_yolo_dataset`` with ``mode="val"`` (no
  augmentation: its ``LoadImage`` long side to ``imgsz``, then ``LetterBox(imgsz,
  scaleup=False)`` and ``Format``; ``rect=False``: square batches) and ``build_dataloader``
  with ``workers`` processes, ``shuffle=True``, on the CPU: what its trainer builds, without
  a model. It runs in a fresh interpreter (``--ultralytics-python``: the bench's own by
  default, or a venv's that has it) so its import-time settings (cv2's threads, its
  environment) touch no runner row. Its label scan (``labels.cache``) is start-up, not
  epoch.
- **folder**: ``loader=folder dataset.crop=letterbox``, the decode threads
  (``loader.decode_threads``) as many as ultralytics' workers.
- **packed**: ``loader=packed`` with the store at the letterbox's size
  (``dataset.store_side=longer dataset.store_size=SIZE``: built once, outside the timing),
  the same threads.

- **decode bound**: the same JPEG files read and decoded to full-size RGB (simplejpeg,
  libjpeg-turbo, as cv2.imread is) by as many threads, nothing else: no letterbox, no
  collation, no boxes. No loader that decodes each image every epoch reads faster than
  this row, so where it is under a target's ratio, that target is out of reach on these
  images for folder (and for packed when its store is no smaller than the sources), and
  the row says so: the way past it is fewer pixels to decode (a packed store at a smaller
  ``store_size``, which pays where the sources are larger than the letterbox: ``--height
  1080 --width 1920``) or no decode at all (memmap, ram).

Each row builds its loader (start-up) and reads two epochs through it back to back, as a
training run does: ultralytics' ``InfiniteDataLoader`` keeps its worker processes and their
prefetch across the epochs, the runner's data path plans both epochs in one pass and keeps
its decode threads busy across the boundary. Two figures: the first epoch's images/s from
its first batch on (a worker pool's start is the first batch's wait, reported on its own),
and the second epoch's, from the first epoch's last batch to its own last: the rate after
warm-up, which the targets use. The first epoch carries one-off costs a run pays once: the
runner's reused batch buffers are faulted in page by page (five 39 MB buffers for batches of
32 letterboxed to 640, 48,000 page faults; a quarter of the CPU time of a 240-image epoch on
the 2-core box), ultralytics' workers import and warm their caches. Rows alternate over
``--rounds``; each figure is the median over rounds with its range, each ratio taken within
a round. Targets: folder >= 2x ultralytics, packed >= 3x, in the second epoch. Without
ultralytics the row says how to install it and the targets fail.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runner.bench import CPU, FOLDER, PACKED
from runner.data import build_data_path
from runner.data.storage import build_storage, resolve_dataset
from runner.job.compose import compose
from runner.measure.stats import median

ULTRALYTICS = "ultralytics"
INSTALL = ("pip install ultralytics (.[peers]), best in a venv of its own: python -m venv "
           "--system-site-packages V && V/bin/pip install ultralytics, then "
           "--ultralytics-python V/bin/python")
# images/s over ultralytics', median of rounds
TARGETS = {FOLDER.value: 2.0, PACKED.value: 3.0}
STEADY = "steady_images_per_s"  # the second epoch's images/s: what the targets compare


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser("yolo", help="ultralytics' YOLO dataloader against the runner's "
                                    "folder and packed paths: decode + letterbox",
                       parents=parents)
    p.add_argument("--size", type=int, default=640, help="letterboxed to SIZE x SIZE")
    p.add_argument("--images", type=int, default=1000, help="images in the generated set")
    p.add_argument("--height", type=int, default=480, help="of the generated images")
    p.add_argument("--width", type=int, default=640, help="of the generated images")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=None,
                   help="ultralytics' worker processes and the runner's decode threads "
                        "(unset: one per core)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--cache-dir", type=Path, default=Path("outputs/bench/cache"),
                   help="where the generated set and the packed store go")
    p.add_argument("--ultralytics-python", default=sys.executable,
                   help="an interpreter that has ultralytics (default: this one)")
    p.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.quality=80")


def missing(python: str) -> str | None:
    """Why ultralytics cannot run under ``python`` (``not installed: ...``), or None."""
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                            f"sys.exit(importlib.util.find_spec('{ULTRALYTICS}') is None)"],
                           capture_output=True)
    return None if probe.returncode == 0 else f"not installed: {INSTALL}"


def count_epochs(batches, epoch_images: int, images_of, boxes_of, shape_of) -> dict:
    """Two epochs of ``epoch_images`` images each, read from ``batches`` back to back:
    the first batch's wait; the first epoch's images, boxes and images/s from its first batch
    on; the second epoch's images/s from the first epoch's last batch to its own last
    (``steady_images_per_s``); the batches' image shapes."""
    t0 = time.perf_counter()
    first = boundary = last = None
    after_first = 0
    epochs = [[0, 0], [0, 0]]  # (images, boxes) of each epoch
    shapes = set()
    for batch in batches:
        n = images_of(batch)
        now = time.perf_counter()
        if first is None:
            first = now
        elif boundary is None:
            after_first += n
        epoch = epochs[0 if boundary is None else 1]
        epoch[0] += n
        epoch[1] += boxes_of(batch)
        shapes.add(shape_of(batch))
        if boundary is None and epochs[0][0] >= epoch_images:
            boundary = now
            if epochs[0][0] != epoch_images:
                raise RuntimeError(f"an epoch of {epoch_images} images read "
                                   f"{epochs[0][0]}: a batch crossed the epoch's end")
        last = now
    end = last if first is not None else time.perf_counter()  # the last batch's arrival
    (images, boxes), (second, second_boxes) = epochs
    if second != epoch_images or second_boxes != boxes:
        raise RuntimeError(f"the second epoch read {second} images and {second_boxes} boxes, "
                           f"the first {images} and {boxes}: not the same work")
    return {"first_batch_s": (first or end) - t0, "images": images, "boxes": boxes,
            "epoch_images_per_s": after_first / max((boundary or end) - (first or end), 1e-9),
            STEADY: second / max(end - (boundary or end), 1e-9),
            "shapes": sorted(shapes)}


def ultralytics_epoch(images_dir: str, names: list[str], size: int, batch: int,
                      workers: int) -> dict:
    """ultralytics' own dataset and loader of ``images_dir`` (no augmentation, square
    letterbox to ``size``), one epoch (in the child, ``main``)."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_dataloader, build_yolo_dataset

    t0 = time.perf_counter()
    cfg = get_cfg(overrides={"imgsz": size, "rect": False, "cache": False, "task": "detect",
                             "fraction": 1.0, "single_cls": False})
    data = {"names": dict(enumerate(names)), "nc": len(names), "channels": 3}
    dataset = build_yolo_dataset(cfg, images_dir, batch, data, mode="val", rect=False)
    loader = build_dataloader(dataset, batch, workers, shuffle=True, rank=-1, device="cpu")
    startup = time.perf_counter() - t0
    # two passes over its InfiniteDataLoader: one iterator, the workers and their prefetch
    # go on into the second epoch
    out = count_epochs(itertools.chain(loader, loader), len(dataset), lambda b: len(b["img"]),
                       lambda b: len(b["cls"]), lambda b: tuple(b["img"].shape[1:]))
    return {"startup_s": startup, **out, "workers": loader.num_workers}


def run_ultralytics(python: str, images_dir: Path, names: list[str], size: int, batch: int,
                    workers: int, timeout: float = 3600.0) -> dict:
    """``ultralytics_epoch`` in a fresh interpreter ``python``; its output shown only when
    it fails."""
    with tempfile.TemporaryDirectory(prefix="runner-yolo-") as tmp:
        out = Path(tmp) / "epoch.json"
        ask = {"images": str(images_dir), "names": names, "size": size, "batch": batch,
               "workers": workers}
        proc = subprocess.run([python, "-m", "runner.bench.yolo", json.dumps(ask), str(out)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"exit status {proc.returncode}")
        got = json.loads(out.read_text())
    got["shapes"] = [tuple(s) for s in got["shapes"]]
    return got


DECODE = "decode bound"


def decode_epoch(images_dir: Path, threads: int) -> dict:
    """Every JPEG under ``images_dir`` read and decoded to RGB by ``threads`` threads
    (simplejpeg releases the GIL while it decodes): the ceiling of any loader that decodes
    each image every epoch, on this machine and these files."""
    from concurrent.futures import ThreadPoolExecutor

    import simplejpeg

    files = sorted(p for p in images_dir.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))

    def one(path: Path) -> int:
        return simplejpeg.decode_jpeg(path.read_bytes(), colorspace="RGB").shape[0]

    rates = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(2):  # the loaders' two epochs
            t0 = time.perf_counter()
            images = sum(1 for _ in pool.map(one, files, chunksize=8))
            rates.append(images / max(time.perf_counter() - t0, 1e-9))
    return {"startup_s": 0.0, "first_batch_s": 0.0, "images": images, "boxes": None,
            "epoch_images_per_s": rates[0], STEADY: rates[1], "shapes": []}


def runner_epoch(config) -> dict:
    """The runner's data path of ``config``, built (start-up) and read for two epochs in one
    pass."""
    t0 = time.perf_counter()
    data = build_data_path(config, CPU, epochs=2, progress=False)
    startup = time.perf_counter() - t0
    try:
        out = count_epochs(data, len(data.storage), lambda b: len(b["label"]),
                           lambda b: int(b["box_count"].sum()),
                           lambda b: tuple(b["image"].shape[1:]))
    finally:
        data.close()
    return {"startup_s": startup, **out}


def bench_yolo(args: argparse.Namespace) -> dict:
    from runner.data.sources.shapes import ShapesSpec, ensure_shapes
    from runner.data.threads import cores

    workers = args.workers or cores()
    spec = ShapesSpec(num_images=args.images, height=args.height, width=args.width)
    root = ensure_shapes(spec, args.cache_dir.expanduser())
    size = args.size
    base = [*args.overrides, f"dataset.path={root}", "dataset.targets=yolo",
            "dataset.crop=letterbox", f"dataset.image_size=[{size},{size}]",
            f"dataset.cache_dir={args.cache_dir.expanduser()}",
            f"loader.batch_size={args.batch_size}", "loader.num_workers=0",
            "loader.drop_last=false",  # every image, as ultralytics reads them
            f"loader.decode_threads={workers}", "loader.shuffle=true", "model=none",
            "logger=none", "run.progress=false"]
    folder, packed = FOLDER.value, PACKED.value
    configs = {folder: compose([*base, f"loader={folder}"]),
               packed: compose([*base, f"loader={packed}", "dataset.store_side=longer",
                                f"dataset.store_size={size}"])}
    build_storage(configs[packed].loader, configs[packed].dataset,
                  resolve_dataset(configs[packed].dataset))  # the store built, untimed
    storage = build_storage(configs[folder].loader, configs[folder].dataset, root)
    names, images_dir = list(storage.classes), Path(storage.root)  # images/train
    print(f"yolo: {len(storage)} images of {args.height}x{args.width} with their label files "
          f"({images_dir}); decode + letterbox to {size}x{size}, batch {args.batch_size}, "
          f"{workers} workers (ultralytics' processes, the runner's decode threads), no "
          f"augmentation; warm page cache; {args.rounds} rounds", flush=True)
    why = missing(args.ultralytics_python)
    if why:
        print(f"  ultralytics: {why}")
    rows = [*(() if why else (ULTRALYTICS,)), *configs, DECODE]
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        row = {}
        for name in rows:
            if name == ULTRALYTICS:
                row[name] = run_ultralytics(args.ultralytics_python, images_dir, names, size,
                                            args.batch_size, workers)
            elif name == DECODE:
                row[name] = decode_epoch(images_dir, workers)
            else:
                row[name] = runner_epoch(configs[name])
        rounds.append(row)
        print(f"  round {k + 1} done", flush=True)
    return {"rounds": rounds, "targets": yolo_targets(rounds, why), "dataset": str(root),
            "workers": workers, **({"ultralytics": why} if why else {})}


def yolo_targets(rounds: list[dict], why: str | None = None) -> list[dict]:
    """The figures (median and range over rounds) and folder's and packed's ratios to
    ultralytics (the second epoch's images/s, within each round), PASS at ``TARGETS``;
    without ultralytics each target says why and fails."""
    print(f"\n  {'loader':12s} {'start-up s':>16s} {'first batch s':>16s} "
          f"{'1st epoch images/s':>20s} {'2nd epoch images/s':>20s}")
    for key in rounds[0]:
        cells = []
        for fig, fmt in (("startup_s", "{:.2f}"), ("first_batch_s", "{:.2f}"),
                         ("epoch_images_per_s", "{:,.0f}"), (STEADY, "{:,.0f}")):
            v = [r[key][fig] for r in rounds]
            cells.append(f"{fmt.format(median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})")
        print(f"  {key:12s} {cells[0]:>16s} {cells[1]:>16s} {cells[2]:>20s} {cells[3]:>20s}")
    if why:
        print(f"  {ULTRALYTICS:12s} {why}")
    read = {(r[key]["images"], r[key]["boxes"]) for r in rounds for key in r
            if r[key]["boxes"] is not None}  # the decode bound reads no labels
    shapes = {tuple(s) for r in rounds for key in r for s in r[key]["shapes"]}
    print(f"  every row read (images, boxes) {sorted(read)}, batches of {sorted(shapes)}")
    checks = []
    for name, target in TARGETS.items():
        what = f"{name} / ultralytics (2nd epoch images/s)"
        if why:
            print(f"  FAIL  {what}: {why}")
            checks.append({"what": what, "target": target, "met": False, "why": why})
            continue
        ratios = [r[name][STEADY] / r[ULTRALYTICS][STEADY] for r in rounds]
        met = median(ratios) >= target
        print(f"  {'PASS' if met else 'FAIL'}  {what}: {median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}), target >= {target:.1f}x")
        check = {"what": what, "ratio": median(ratios), "min": min(ratios),
                 "max": max(ratios), "target": target, "met": met}
        bound = decode_bound(rounds)
        if not met and bound is not None and bound < target:
            check["why"] = (f"out of reach on these images: decoding each JPEG alone, "
                            f"nothing else, is {bound:.2f}x ultralytics on this machine")
            print(f"        {check['why']}")
        checks.append(check)
    return checks


def decode_bound(rounds: list[dict]) -> float | None:
    """The decode bound's images/s over ultralytics', median of rounds (None without
    either row)."""
    if not all(DECODE in r and ULTRALYTICS in r for r in rounds):
        return None
    return median([r[DECODE][STEADY] / r[ULTRALYTICS][STEADY] for r in rounds])


def main(argv: list[str]) -> int:
    """The child of ``run_ultralytics``: ``ASK_JSON OUT_JSON``."""
    ask, out = json.loads(argv[0]), Path(argv[1])
    got = ultralytics_epoch(ask["images"], ask["names"], ask["size"], ask["batch"],
                            ask["workers"])
    out.write_text(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
