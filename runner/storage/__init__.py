"""``loader=`` storages: where batches come from.

folder decodes every image on every epoch; memmap and ram decode once (memmap.py, ram.py)
and then serve batches by indexed reads of one uint8 tensor (decoded.py).
"""

from __future__ import annotations

from pathlib import Path

from runner.config import Crop, DatasetConfig, Decoder, LoaderConfig, Storage
from runner.storage.decode import ImageDecoder, check_decoder
from runner.storage.decoded import DecodedStorage
from runner.storage.folder import FolderStorage
from runner.storage.memmap import IMAGES, CacheSpec, ensure_cache, open_images, open_labels
from runner.storage.nvjpeg import ReadBytes
from runner.storage.ram import load_ram
from runner.synthetic import SyntheticSpec, ensure_dataset


def resolve_dataset(cfg: DatasetConfig, progress: bool = True) -> Path:
    """``dataset.path``, or the generated default dataset (made once, then reused)."""
    if cfg.path is not None:
        return Path(cfg.path).expanduser()
    spec = SyntheticSpec(cfg.num_images, cfg.num_classes, *cfg.source_size, quality=cfg.quality)
    return ensure_dataset(spec, cfg.cache_dir, progress=progress)


def cache_spec(loader: LoaderConfig, dataset: DatasetConfig, path: Path) -> CacheSpec:
    return CacheSpec(Path(path).expanduser().resolve(), tuple(dataset.image_size),
                     loader.decoder.name, loader.draft)


def build_storage(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                  pin_memory: bool = False, progress: bool = True) -> FolderStorage | DecodedStorage:
    """The storage ``loader.name`` asks for, over the ImageFolder tree at ``path``."""
    check_decoder(loader.decoder)
    # Pre-decoded storage keeps the deterministic center crop; random crops for training
    # are applied to whole batches on the device instead (runner/augment.py).
    crop = dataset.crop if loader.name is Storage.folder else Crop.center
    decode = ImageDecoder(loader.decoder, tuple(dataset.image_size), crop, loader.draft)
    if loader.decoder is Decoder.nvjpeg:  # workers read bytes; the GPU decodes (nvjpeg.py)
        decode = ReadBytes()
    folder = FolderStorage(path, decode, dataset.on_corrupt)
    if loader.name is Storage.folder:
        return folder
    spec = cache_spec(loader, dataset, path)
    if loader.name is Storage.ram:
        return load_ram(folder, spec, Path(dataset.cache_dir), pin_memory, progress)
    return open_memmap(folder, spec, Path(dataset.cache_dir), progress)


def open_memmap(folder: FolderStorage, spec: CacheSpec, cache_root: Path,
                progress: bool = True) -> DecodedStorage:
    """The memmap cache of ``folder`` (converted first if there is no valid one)."""
    cache, meta = ensure_cache(folder, spec, cache_root, progress)
    return DecodedStorage(open_images(cache, meta), open_labels(cache, meta),
                          [s["index"] for s in meta["skipped"]], folder.classes, folder.names(),
                          folder.root, files=[str(cache / IMAGES)],
                          reopen=lambda: open_images(cache, meta))
