"""``python -m runner.prepare``: prepare data ahead of runs.

``memmap [--rebuild] [overrides]`` builds the decode-once cache now. It takes the runner's
own overrides (``dataset.path=...``, ``dataset.image_size=[224,224]``,
``loader.decoder=simplejpeg``, ``loader.draft=true``), so the cache it builds is exactly the
one ``python -m runner loader=memmap`` with the same overrides opens. Without it, the first
``loader=memmap`` run converts on its own.

``reencode --quality Q [--max-size S] [--src DIR] [--dst DIR] [overrides]`` writes a copy
of an image folder (by default the run's dataset, e.g. the generated default) at JPEG
quality Q, and prints the bytes before and after and the ``dataset.path=`` to run it with.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from runner.compose import compose
from runner.config import ConfigError
from runner.data.reencode import Reencoding, describe, reencode_folder
from runner.data.storage import cache_spec, open_folder, resolve_dataset
from runner.data.storage.memmap import ensure_cache
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
    cache, _ = ensure_cache(folder, cache_spec(config.loader, config.dataset, path),
                            Path(config.dataset.cache_dir), rebuild=rebuild)
    return cache


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
        else:
            print(prepare_memmap(args.overrides, rebuild=args.rebuild))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
