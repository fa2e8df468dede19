"""``loader=`` storages: where batches come from (the ``Storage`` protocol, base.py).

folder decodes every image on every epoch; memmap and ram decode once (memmap.py, ram.py)
and then serve batches by indexed reads of one uint8 tensor (decoded.py); packed re-encodes
once at a stored size into one file and decodes per epoch (packed.py). ``STORAGES`` maps
each ``loader.name`` to the function that opens it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from runner.config import Crop, DatasetConfig, Decoder, LoaderConfig, StorageName, StoreSide
from runner.data.storage.base import Storage
from runner.data.storage.decode import ImageDecoder, check_decoder
from runner.data.storage.decoded import DecodedStorage
from runner.data.storage.encoded import ReadBytes
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import CacheSpec, open_cache
from runner.data.storage.packed import PackedSpec, PackedStorage, open_packed_cache
from runner.data.storage.ram import load_ram
from runner.data.synthetic import SyntheticSpec, ensure_dataset


def resolve_dataset(cfg: DatasetConfig, progress: bool = True) -> Path:
    """``dataset.path``, or the generated default dataset (made once, then reused)."""
    if cfg.path is not None:
        return Path(cfg.path).expanduser()
    spec = SyntheticSpec(cfg.num_images, cfg.num_classes, *cfg.source_size, quality=cfg.quality)
    return ensure_dataset(spec, cfg.cache_dir, progress=progress)


def stored_size(dataset: DatasetConfig) -> tuple[int, int]:
    """The (height, width) memmap and ram store: ``dataset.image_size`` scaled so its
    ``dataset.store_side`` is ``dataset.store_size`` (unset: ``image_size`` itself). The
    crop to ``image_size`` is taken from it on the device, per batch."""
    h, w = (int(v) for v in dataset.image_size)
    if dataset.store_size is None:
        return h, w
    scale = dataset.store_size / (min(h, w) if dataset.store_side is StoreSide.shorter
                                  else max(h, w))
    return max(h, round(h * scale)), max(w, round(w * scale))


def packed_spec(dataset: DatasetConfig, path: Path) -> PackedSpec:
    """What ``loader=packed`` stores: ``dataset.store_size`` (unset: 8/7 of the larger side
    of ``image_size``, the usual resize-256-crop-224 ratio) at ``dataset.store_quality``."""
    size = dataset.store_size or math.ceil(max(dataset.image_size) * 8 / 7)
    return PackedSpec(Path(path).expanduser().resolve(), int(size), dataset.store_side,
                      dataset.store_quality)


def cache_spec(loader: LoaderConfig, dataset: DatasetConfig, path: Path) -> CacheSpec:
    return CacheSpec(Path(path).expanduser().resolve(), stored_size(dataset),
                     loader.decoder.value, loader.draft)


def open_folder(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> FolderStorage:
    """The image folder at ``path``, decoded with ``loader.decoder``.

    Pre-decoded storage decodes at the stored size with the deterministic center crop;
    random crops for training are applied to whole batches on the device instead
    (runner/data/augment.py).
    """
    check_decoder(loader.decoder)
    decoded_once = loader.name in (StorageName.memmap, StorageName.ram)
    crop = Crop.center if decoded_once else dataset.crop
    size = stored_size(dataset) if decoded_once else tuple(dataset.image_size)
    decode = ImageDecoder(loader.decoder, size, crop, loader.draft)
    if loader.decoder is Decoder.nvjpeg:  # workers read bytes; the GPU decodes (nvjpeg.py)
        decode = ReadBytes(ImageDecoder(Decoder.pil, decode.size, decode.crop))
    return FolderStorage(path, decode, dataset.on_corrupt)


def open_memmap(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> DecodedStorage:
    """The memmap cache of the folder at ``path`` (converted first if there is no valid one)."""
    folder = open_folder(loader, dataset, path, progress)
    storage = open_cache(folder, cache_spec(loader, dataset, path), Path(dataset.cache_dir),
                         progress)
    storage.output_size = tuple(dataset.image_size)
    return storage


def open_ram(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
             progress: bool = True) -> DecodedStorage:
    """The folder at ``path`` decoded once into memory (read from its memmap cache if valid)."""
    folder = open_folder(loader, dataset, path, progress)
    storage = load_ram(folder, cache_spec(loader, dataset, path), Path(dataset.cache_dir),
                       progress)
    storage.output_size = tuple(dataset.image_size)
    return storage


def open_packed(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> PackedStorage:
    """The packed store of the folder at ``path`` (packed first if there is no valid one),
    each stored JPEG decoded per epoch with ``loader.decoder``."""
    folder = open_folder(loader, dataset, path, progress)
    return open_packed_cache(folder, packed_spec(dataset, path), Path(dataset.cache_dir),
                             folder.decode, progress)


def open_dali(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
              progress: bool = True) -> Storage:
    """The folder at ``path`` for NVIDIA DALI's own pipeline (the rival, measured the
    runner's way; runner/data/storage/dali.py)."""
    from runner.data.storage.dali import DaliStorage, check_dali

    check_dali()  # before listing the folder: a clear skip when DALI is not installed
    return DaliStorage(open_folder(loader, dataset, path, progress), loader, dataset)


def open_ffcv(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
              progress: bool = True) -> Storage:
    """The folder at ``path`` as an FFCV .beton read by FFCV's Loader (the rival, measured
    the runner's way; runner/data/storage/ffcv.py)."""
    from runner.data.storage.ffcv import FfcvStorage, check_ffcv

    check_ffcv()
    return FfcvStorage(open_folder(loader, dataset, path, progress), loader, dataset, progress)


STORAGES: dict[StorageName, Callable[..., Storage]] = {
    StorageName.folder: open_folder,
    StorageName.memmap: open_memmap,
    StorageName.ram: open_ram,
    StorageName.packed: open_packed,
    StorageName.dali: open_dali,
    StorageName.ffcv: open_ffcv,
}


def build_storage(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                  progress: bool = True) -> Storage:
    """The storage ``loader.name`` asks for, over the ImageFolder tree at ``path``."""
    return STORAGES[loader.name](loader, dataset, path, progress)
