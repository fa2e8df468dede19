"""``python -m runner.prepare``: prepare data ahead of runs.

``<store> [--rebuild] [overrides]`` builds a store now (``memmap``, ``ram`` (the memmap store
it loads), ``packed``, ``ffcv``: every storage whose registry record has one). It takes the
runner's own overrides (``dataset.path=...``, ``dataset.image_size=[224,224]``,
``loader.decoder=simplejpeg``, ``dataset.store_size=256``), so the store it builds is exactly
the one ``python -m runner loader=<store>`` with the same overrides opens. Without it, the
first run converts on its own. A damaged store's error message ends with this command.

``sizes [overrides]`` prints, for the dataset at hand, the bytes each storage would hold
(the source files; raw at the stored size for memmap/ram; packed at its quality, estimated
from a sample) against free disk and available memory, and which store to pick. Building
a store prints the same table first.

``reencode --quality Q [--max-size S] [--src DIR] [--dst DIR] [overrides]`` writes a copy
of an image folder (by default the run's dataset, e.g. the generated default) at JPEG
quality Q, and prints the bytes before and after and the ``dataset.path=`` to run it with.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from runner.common.errors import EXIT_USER_ERROR, UserError
from runner.common.text import human_bytes
from runner.config.schema import Config, ConfigError, StorageName
from runner.data.decode.reencode import Reencoding, describe, reencode_folder
from runner.data.protocol import StorageKind, StoreFootprint
from runner.data.storage import STORAGES, resolve_dataset
from runner.data.storage.folder import FolderStorage, open_folder
from runner.data.storage.ram import memory_available
from runner.job.compose import compose


def with_store(kind: StorageKind) -> bool:
    return kind.build is not None


def prepare(name: str, overrides: list[str], rebuild: bool = False) -> Path:
    """Convert (or, when valid and not ``rebuild``, reuse) the store ``loader=<name>`` opens
    with these overrides; returns its folder."""
    kind = STORAGES[StorageName(name)]
    if kind.build is None:
        have = ", ".join(k.name.value for k in STORAGES.values() if with_store(k))
        raise ConfigError(f"loader={name} has no store to prepare (it reads the folder as it "
                          f"is); these do: {have}")
    options = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides
               if "=" in o and o.split("=", 1)[0] in kind.build_options}
    overrides = [o for o in overrides if "=" not in o or o.split("=", 1)[0] not in options]
    config = compose([*[o for o in overrides if not o.startswith("loader=")],
                      f"loader={name}"])
    path = resolve_dataset(config.dataset)
    if not isinstance(path, str):  # a URL is listed by the build itself
        print(describe_sizes(store_sizes(config)))
    return kind.build(config.loader, config.dataset, path, True, rebuild, **options)


@dataclass(frozen=True)
class Sizes:
    images: int
    stores: list[tuple[StorageKind, StoreFootprint]]
    memory: int  # available (the page cache can grow into it)
    disk: int  # free where the stores go
    cache_dir: Path


def _free_disk(path: Path) -> int:
    """Free bytes on the filesystem ``path`` is (or would be) on."""
    path = Path(path).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def store_sizes(config: Config, folder: FolderStorage | None = None) -> Sizes:
    """What each storage of ``config``'s dataset holds (its registry record's footprint):
    the source files, memmap/ram raw at the stored size, packed at its stored size and
    quality (estimated from a sample)."""
    path = resolve_dataset(config.dataset)
    if folder is None:
        folder = open_folder(config.loader, config.dataset, path)
    kind = config.dataset.targets.kind  # boxes, masks: the stores that carry them
    stores = [(k, k.footprint(config.dataset, folder)) for k in STORAGES.values()
              if k.footprint is not None and k.reads_path and k.carries(kind)]
    return Sizes(len(folder), stores, memory_available(),
                 _free_disk(Path(config.dataset.cache_dir)),
                 Path(config.dataset.cache_dir).expanduser())


# A store "fits the page cache" when it takes at most this share of the available memory
# (the run, its model and the rest of the machine need the remainder).
PAGE_CACHE_SHARE = 0.8


def describe_sizes(sizes: Sizes) -> str:
    """The table ``prepare`` prints, and which store to pick: the fastest (its record's
    ``speed_rank``) that fits the page cache and the disk, else the one that reads the fewest
    bytes per image."""
    limit = PAGE_CACHE_SHARE * sizes.memory
    lines = [f"{sizes.images:,} images; {human_bytes(sizes.memory)} of memory available, "
             f"{human_bytes(sizes.disk)} free on disk at {sizes.cache_dir}",
             f"{'store':16s} {'holds':38s} {'bytes':>11s}  page cache  disk"]

    def fits(f: StoreFootprint) -> tuple[bool, bool]:
        return f.nbytes <= limit, not f.on_disk or f.nbytes <= sizes.disk

    for kind, f in sizes.stores:
        amount = ("~" if f.estimated else "") + human_bytes(f.nbytes)
        memory, disk = fits(f)
        lines.append(f"{'loader=' + kind.name.value:16s} {f.what:38s} {amount:>11s}  "
                     f"{'fits' if memory else 'too big':10s}  "
                     f"{('fits' if disk else 'too big') if f.on_disk else '-'}")
    fitting = [(k, f) for k, f in sizes.stores if all(fits(f))]
    if fitting:
        kind, _ = min(fitting, key=lambda s: s[0].speed_rank)
        why = "the fastest store that fits the page cache"
    else:
        kind, _ = min(((k, f) for k, f in sizes.stores if fits(f)[1]),
                      key=lambda s: s[1].nbytes, default=sizes.stores[0])
        why = ("nothing fits the page cache: the store that reads the fewest bytes per image "
               "(lower dataset.store_size or dataset.store_quality to read fewer)")
    lines.append(f"pick: loader={kind.name.value}: {why}; {kind.summary}")
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
    for kind in (k for k in STORAGES.values() if k.reads_path):  # not the user's Dataset
        what = (f"build loader={kind.name.value}'s store now" if with_store(kind) else
                f"nothing to build: loader={kind.name.value} reads the folder as it is")
        p = sub.add_parser(kind.name.value, help=f"{what} ({kind.summary})")
        p.add_argument("--rebuild", action="store_true", help="build again even if valid")
        more = ", and " + ", ".join(f"{o}=..." for o in kind.build_options) \
            if kind.build_options else ""
        p.add_argument("overrides", nargs="*",
                       help=f"runner overrides, e.g. dataset.path=/data{more}")
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
        else:
            print(prepare(args.command, args.overrides, rebuild=args.rebuild))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
