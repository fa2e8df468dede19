"""``loader=`` storages: where batches come from (the ``Storage`` protocol, base.py).

folder decodes every image on every epoch; memmap and ram decode once (memmap.py, ram.py)
and then serve batches by indexed reads of one uint8 tensor (decoded.py). ``STORAGES`` maps
each ``loader.name`` to the function that opens it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from runner.config import Crop, DatasetConfig, Decoder, LoaderConfig, StorageName
from runner.data.storage.base import Storage
from runner.data.storage.decode import ImageDecoder, check_decoder
from runner.data.storage.decoded import DecodedStorage
from runner.data.storage.encoded import ReadBytes
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import CacheSpec, open_cache
from runner.data.storage.ram import load_ram
from runner.data.synthetic import SyntheticSpec, ensure_dataset


def resolve_dataset(cfg: DatasetConfig, progress: bool = True) -> Path:
    """``dataset.path``, or the generated default dataset (made once, then reused)."""
    if cfg.path is not None:
        return Path(cfg.path).expanduser()
    spec = SyntheticSpec(cfg.num_images, cfg.num_classes, *cfg.source_size, quality=cfg.quality)
    return ensure_dataset(spec, cfg.cache_dir, progress=progress)


def cache_spec(loader: LoaderConfig, dataset: DatasetConfig, path: Path) -> CacheSpec:
    return CacheSpec(Path(path).expanduser().resolve(), tuple(dataset.image_size),
                     loader.decoder.value, loader.draft)


def open_folder(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> FolderStorage:
    """The image folder at ``path``, decoded with ``loader.decoder``.

    Pre-decoded storage keeps the deterministic center crop; random crops for training
    are applied to whole batches on the device instead (runner/data/augment.py).
    """
    check_decoder(loader.decoder)
    crop = dataset.crop if loader.name is StorageName.folder else Crop.center
    decode = ImageDecoder(loader.decoder, tuple(dataset.image_size), crop, loader.draft)
    if loader.decoder is Decoder.nvjpeg:  # workers read bytes; the GPU decodes (nvjpeg.py)
        decode = ReadBytes(ImageDecoder(Decoder.pil, decode.size, decode.crop))
    return FolderStorage(path, decode, dataset.on_corrupt)


def open_memmap(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> DecodedStorage:
    """The memmap cache of the folder at ``path`` (converted first if there is no valid one)."""
    folder = open_folder(loader, dataset, path, progress)
    return open_cache(folder, cache_spec(loader, dataset, path), Path(dataset.cache_dir),
                      progress)


def open_ram(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
             progress: bool = True) -> DecodedStorage:
    """The folder at ``path`` decoded once into memory (read from its memmap cache if valid)."""
    folder = open_folder(loader, dataset, path, progress)
    return load_ram(folder, cache_spec(loader, dataset, path), Path(dataset.cache_dir),
                    progress)


STORAGES: dict[StorageName, Callable[..., Storage]] = {
    StorageName.folder: open_folder,
    StorageName.memmap: open_memmap,
    StorageName.ram: open_ram,
}


def build_storage(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                  progress: bool = True) -> Storage:
    """The storage ``loader.name`` asks for, over the ImageFolder tree at ``path``."""
    return STORAGES[loader.name](loader, dataset, path, progress)
