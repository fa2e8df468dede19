"""``python -m runner.prepare memmap [--rebuild] [overrides]``: build a memmap cache now.

Takes the runner's own overrides (``dataset.path=...``, ``dataset.image_size=[224,224]``,
``loader.decoder=simplejpeg``, ``loader.draft=true``), so the cache it builds is exactly the
one ``python -m runner loader=memmap`` with the same overrides opens. Without it, the first
``loader=memmap`` run converts on its own.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from runner.config import ConfigError, compose
from runner.storage import build_storage, cache_spec, resolve_dataset
from runner.storage.decode import ImageDecoder, check_decoder
from runner.storage.folder import DatasetError, FolderStorage
from runner.storage.memmap import CacheError, ensure_cache


def prepare_memmap(overrides: list[str], rebuild: bool = False) -> Path:
    """Convert (or, when valid and not ``rebuild``, reuse) the cache for these overrides."""
    config = compose([*overrides, "loader=memmap"] if not any(
        o.startswith("loader=") for o in overrides) else overrides)
    path = resolve_dataset(config.dataset)
    if not rebuild:
        build_storage(config.loader, config.dataset, path)  # converts only if needed
        return cache_spec(config.loader, config.dataset, path).folder(Path(config.dataset.cache_dir))
    check_decoder(config.loader.decoder)
    decode = ImageDecoder(config.loader.decoder, tuple(config.dataset.image_size),
                          draft=config.loader.draft)
    folder = FolderStorage(path, decode, config.dataset.on_corrupt)
    spec = cache_spec(config.loader, config.dataset, path)
    cache, _ = ensure_cache(folder, spec, Path(config.dataset.cache_dir), rebuild=True)
    return cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("memmap", help="decode a dataset once into a uint8 memmap cache")
    p.add_argument("--rebuild", action="store_true", help="convert again even if valid")
    p.add_argument("overrides", nargs="*", help="runner overrides, e.g. dataset.path=/data")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cache = prepare_memmap(args.overrides, rebuild=args.rebuild)
    except (ConfigError, DatasetError, CacheError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
