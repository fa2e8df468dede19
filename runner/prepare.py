"""``python -m runner.prepare``: prepare data ahead of runs.

``memmap [--rebuild] [overrides]`` builds the decode-once cache now. It takes the runner's
own overrides (``dataset.path=...``, ``dataset.image_size=[224,224]``,
``loader.decoder=simplejpeg``, ``loader.draft=true``), so the cache it builds is exactly the
one ``python -m runner loader=memmap`` with the same overrides opens. Without it, the first
``loader=memmap`` run converts on its own.

``packed [--rebuild] [overrides]`` packs the dataset once into ``loader=packed``'s store
(``dataset.store_size``, ``dataset.store_side``, ``dataset.store_quality``); without it, the
first ``loader=packed`` run packs on its own.

``sizes [overrides]`` prints, for the dataset at hand, the bytes each store would take (the
source files; raw at the stored size for memmap/ram; packed at its quality, estimated from a
sample) against free disk and available memory, and which store fits the page cache.
``memmap`` and ``packed`` print the same table before they convert.

``reencode --quality Q [--max-size S] [--src DIR] [--dst DIR] [overrides]`` writes a copy
of an image folder (by default the run's dataset, e.g. the generated default) at JPEG
quality Q, and prints the bytes before and after and the ``dataset.path=`` to run it with.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from runner.compose import compose
from runner.config import ConfigError
from runner.data.reencode import Reencoding, describe, reencode_folder
from runner.data.storage import (
    cache_spec,
    open_folder,
    packed_spec,
    resolve_dataset,
    stored_size,
)
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import ensure_cache
from runner.data.storage.packed import estimate_bytes
from runner.data.storage.ram import memory_available
from runner.errors import UserError


def prepare_memmap(overrides: list[str], rebuild: bool = False) -> Path:
    """Convert (or, when valid and not ``rebuild``, reuse) the cache for these overrides.

    ``loader=ram`` builds the same cache (a ram run loads it instead of decoding again);
    ``loader=folder`` has no cache to build and is refused.
    """
    loader = [o for o in overrides if o.startswith("loader=")]
    if loader and loader[-1] == "loader=folder":
        raise ConfigError("loader=folder decodes every epoch and has no cache to prepare: "
                          "use loader=memmap (or loader=ram, which loads the memmap cache)")
    config = compose([*[o for o in overrides if not o.startswith("loader=")], "loader=memmap"])
    path = resolve_dataset(config.dataset)
    folder = open_folder(config.loader, config.dataset, path)
    print(describe_sizes(store_sizes(config, folder)))
    cache, _ = ensure_cache(folder, cache_spec(config.loader, config.dataset, path),
                            Path(config.dataset.cache_dir), rebuild=rebuild)
    return cache


def prepare_packed(overrides: list[str], rebuild: bool = False) -> Path:
    """Pack (or, when valid and not ``rebuild``, reuse) the store for these overrides."""
    config = compose([*[o for o in overrides if not o.startswith("loader=")], "loader=packed"])
    path = resolve_dataset(config.dataset)
    folder = open_folder(config.loader, config.dataset, path)
    print(describe_sizes(store_sizes(config, folder)))
    cache, _ = ensure_cache(folder, packed_spec(config.dataset, path),
                            Path(config.dataset.cache_dir), rebuild=rebuild)
    return cache


@dataclass(frozen=True)
class StoreSize:
    """Bytes one way of storing the dataset takes."""

    store: str  # what to run it with
    what: str
    nbytes: int
    estimated: bool = False


@dataclass(frozen=True)
class Sizes:
    images: int
    stores: list[StoreSize]
    memory: int  # available (the page cache can grow into it)
    disk: int  # free where the caches go
    cache_dir: Path


def _free_disk(path: Path) -> int:
    """Free bytes on the filesystem ``path`` is (or would be) on."""
    path = Path(path).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def store_sizes(config, folder: FolderStorage | None = None) -> Sizes:
    """What each store of ``config``'s dataset takes: the source files, memmap/ram raw at
    the stored size, packed at its stored size and quality (estimated from a sample)."""
    path = resolve_dataset(config.dataset)
    if folder is None:
        folder = open_folder(config.loader, config.dataset, path)
    n = len(folder)
    source = sum(os.path.getsize(p) for p in folder.files if os.path.exists(p))
    h, w = stored_size(config.dataset)
    spec = packed_spec(config.dataset, path)
    side = f"{spec.side.value} side {spec.store_size}"
    stores = [
        StoreSize("loader=folder", "the source files", source),
        StoreSize("loader=memmap / loader=ram", f"raw uint8 at {h}x{w}", n * 3 * h * w),
        StoreSize("loader=packed", f"JPEG q{spec.quality} at the {side}",
                  estimate_bytes(folder, spec), estimated=True),
    ]
    return Sizes(n, stores, memory_available(), _free_disk(Path(config.dataset.cache_dir)),
                 Path(config.dataset.cache_dir).expanduser())


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


# A store "fits the page cache" when it takes at most this share of the available memory
# (the run, its model and the rest of the machine need the remainder).
PAGE_CACHE_SHARE = 0.8


def describe_sizes(sizes: Sizes) -> str:
    """The table ``prepare`` prints, and which store to pick."""
    limit = PAGE_CACHE_SHARE * sizes.memory
    lines = [f"{sizes.images:,} images; {_human(sizes.memory)} of memory available, "
             f"{_human(sizes.disk)} free on disk at {sizes.cache_dir}",
             f"{'store':28s} {'holds':34s} {'bytes':>12s}  page cache  disk"]
    for s in sizes.stores:
        amount = ("~" if s.estimated else "") + _human(s.nbytes)
        fits_memory = "fits" if s.nbytes <= limit else "too big"
        fits_disk = "-" if s.store == "loader=folder" else (
            "fits" if s.nbytes <= sizes.disk else "too big")
        lines.append(f"{s.store:28s} {s.what:34s} {amount:>12s}  {fits_memory:10s}  {fits_disk}")
    raw, packed = sizes.stores[1], sizes.stores[2]
    if raw.nbytes <= limit and raw.nbytes <= sizes.disk:
        pick = ("loader=memmap (or loader=ram): the raw store fits the page cache; batches "
                "are memory copies, the fastest path")
    elif packed.nbytes <= limit:
        pick = ("loader=packed: the raw store does not fit the page cache, the packed one "
                "does; every epoch decodes, but nothing is read from disk after the first")
    else:
        pick = ("loader=packed: nothing fits the page cache; the packed store reads the "
                "fewest bytes per image from disk (lower dataset.store_size or "
                "dataset.store_quality to read fewer)")
    lines.append(f"pick: {pick}")
    return "\n".join(lines)


def reencode(args: argparse.Namespace) -> Path:
    src = args.src or resolve_dataset(compose(args.overrides).dataset)
    suffix = f"-q{args.quality}" + (f"-s{args.max_size}" if args.max_size else "")
    dst = args.dst or Path(src).with_name(Path(src).name + suffix)
    manifest = reencode_folder(Path(src), Path(dst), Reencoding(args.quality, args.max_size))
    print(describe(manifest))
    print(f"run it with: dataset.path={dst}")
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("memmap", help="decode a dataset once into a uint8 memmap cache")
    p.add_argument("--rebuild", action="store_true", help="convert again even if valid")
    p.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.path=/data")
    k = sub.add_parser("packed", help="pack a dataset once into loader=packed's JPEG store")
    k.add_argument("--rebuild", action="store_true", help="pack again even if valid")
    k.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.store_size=256")
    z = sub.add_parser("sizes", help="the bytes each store would take, against disk and memory")
    z.add_argument("overrides", nargs="*", help="runner overrides that pick the dataset")
    r = sub.add_parser("reencode", help="a copy of an image folder at a lower JPEG quality")
    r.add_argument("--quality", type=int, default=75, help="JPEG quality, 1..100 (default 75)")
    r.add_argument("--max-size", type=int, help="cap the shorter side at this many pixels")
    r.add_argument("--src", type=Path, help="an ImageFolder tree (default: the run's dataset)")
    r.add_argument("--dst", type=Path, help="where the copy goes (default: beside the source)")
    r.add_argument("overrides", nargs="*", help="runner overrides that pick the dataset")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "reencode":
            if not 1 <= args.quality <= 100:
                raise ConfigError(f"--quality={args.quality} is invalid: must be in 1..100")
            reencode(args)
        elif args.command == "sizes":
            config = compose([o for o in args.overrides if not o.startswith("loader=")])
            print(describe_sizes(store_sizes(config)))
        elif args.command == "packed":
            print(prepare_packed(args.overrides, rebuild=args.rebuild))
        else:
            print(prepare_memmap(args.overrides, rebuild=args.rebuild))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
