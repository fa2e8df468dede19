"""``loader=`` storages: where batches come from (folder now; memmap and ram decode once)."""

from __future__ import annotations

from pathlib import Path

from runner.config import DatasetConfig, LoaderConfig, Storage
from runner.storage.decode import ImageDecoder, check_decoder
from runner.storage.folder import FolderStorage
from runner.synthetic import SyntheticSpec, ensure_dataset


def resolve_dataset(cfg: DatasetConfig, progress: bool = True) -> Path:
    """``dataset.path``, or the generated default dataset (made once, then reused)."""
    if cfg.path is not None:
        return Path(cfg.path).expanduser()
    spec = SyntheticSpec(cfg.num_images, cfg.num_classes, *cfg.source_size, quality=cfg.quality)
    return ensure_dataset(spec, cfg.cache_dir, progress=progress)


def build_storage(loader: LoaderConfig, dataset: DatasetConfig, path: Path) -> FolderStorage:
    check_decoder(loader.decoder)
    decode = ImageDecoder(loader.decoder, tuple(dataset.image_size), dataset.crop, loader.draft)
    builders = {Storage.folder: FolderStorage}
    if loader.name not in builders:
        raise NotImplementedError(f"loader={loader.name.name} is not available yet")
    return builders[loader.name](path, decode, dataset.on_corrupt)
