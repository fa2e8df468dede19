"""``loader=ffcv``: FFCV's ``.beton`` and its Loader over ``dataset.path``, measured the
runner's way (the rival for datasets stored once and decoded per epoch, like packed).

Conversion, with the runner's cache engine (runner/data/storage/convert.py: keyed by the
source's layout and every file's stat and content hash, rebuilt when stale, built in
``<key>.partial`` and published by a rename, refused with the rebuild command when
damaged; ``python -m runner.prepare ffcv`` builds it ahead): the files DALI would stop on
are screened out the same way (dali.py) and listed as skipped; the others are written by FFCV's ``DatasetWriter`` (its own worker processes
and progress bar) as JPEG (``loader.ffcv_mode=jpg``, at ``dataset.store_quality``) or raw
pixels (``raw``), at the same stored size as ``loader=packed`` (``dataset.store_size``
along ``dataset.store_side``; FFCV's own ``max_resolution`` caps only the longer side, so
the runner hands it images already at the stored size: both rivals hold the same pixels).
A conversion killed halfway is started again (FFCV's writer cannot resume).

Reading: FFCV's ``Loader`` with its decoders (``CenterCropRGBImageDecoder`` with
``dataset.crop_fraction`` as its ratio: the centre crop every storage takes; or
``RandomResizedCropRGBImageDecoder`` and a random flip, drawn from FFCV's own random
numbers, not the runner's per-image crop seeds), ``ToTensor`` and ``ToTorchImage``, one worker thread per core, FFCV's seeded random
order (``OrderOption.RANDOM``) or dataset order, FFCV's own sharding under torchrun
(``distributed=True``). Batches stay on the host: the runner's copy and prefetch move them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.config.schema import Crop, DatasetConfig, LoaderConfig, StorageName, StoreSide
from runner.data.decode.decoders import CPU_DECODERS
from runner.data.order import BatchOrder
from runner.data.protocol import StorageKind
from runner.data.storage.convert import (
    META,
    SOURCE_DTYPE,
    SOURCES,
    Journal,
    StoreSpec,
    ensure_cache,
    file_record,
    skipped_files,
)
from runner.data.storage.folder import FolderStorage, open_folder
from runner.data.storage.packed import default_store_size, stored_hw
from runner.data.storage.rival import (
    RivalStorage,
    RivalUnavailable,
    screen_data,
    screen_samples,
)
from runner.data.threads import cores

log = logging.getLogger(__name__)

FFCV_VERSION = 1
BETON = "data.beton"
# FFCV hands out views of its own buffers, reused after this many batches: more than the
# runner ever holds (the batch in the loop plus prefetch.depth staged ones)
BATCHES_AHEAD = 8


def check_ffcv() -> None:
    try:
        import ffcv.loader  # noqa: F401
    except Exception as e:  # ImportError, or a build that cannot load its libraries
        raise RivalUnavailable(
            "loader=ffcv needs FFCV, which builds from source: apt-get install libopencv-dev "
            "libturbojpeg0-dev pkg-config, then pip install -e '.[ffcv]' "
            f"({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class FfcvSpec(StoreSpec):
    """What a .beton's bytes depend on; each distinct spec gets its own folder.

    ``selected_by``: the overrides that chose it (its rebuild command), not part of the key.
    """

    source: Path
    store_size: int
    side: StoreSide
    quality: int
    mode: str  # jpg or raw
    selected_by: tuple[str, ...] = field(default=(), compare=False)

    kind = StorageName.ffcv.value
    version = FFCV_VERSION

    def settings(self) -> dict[str, Any]:
        return {"source": str(self.source), "store_size": self.store_size,
                "side": self.side.value, "quality": self.quality, "mode": self.mode}

    def label(self) -> str:
        return (f"{self.side.value}{self.store_size}-{self.mode}"
                f"{self.quality if self.mode == 'jpg' else ''}")

    def overrides(self) -> list[str]:
        return list(self.selected_by) or [
            f"dataset.path={self.source}", f"dataset.store_size={self.store_size}",
            f"dataset.store_side={self.side.value}", f"dataset.store_quality={self.quality}",
            f"loader.ffcv_mode={self.mode}"]

    def file_sizes(self, folder: Path, meta: dict[str, Any]) -> dict[str, int]:
        if not isinstance(meta.get("data_bytes"), int):
            raise self.damaged(folder, f"its {META} lacks or mistypes: data_bytes")
        return {BETON: meta["data_bytes"]}

    def convert(self, folder_storage: FolderStorage, journal: Journal, progress: bool
                ) -> dict[str, Any]:
        return _convert(folder_storage, self, journal, progress)


def ffcv_spec(loader: LoaderConfig, dataset: DatasetConfig, path: Path) -> FfcvSpec:
    """The .beton ``loader=ffcv`` reads: the stored size of ``loader=packed``."""
    source = Path(path).expanduser().resolve()
    size = default_store_size(dataset)
    picked = (f"dataset.path={source}",
              f"dataset.image_size=[{','.join(str(int(v)) for v in dataset.image_size)}]",
              f"dataset.store_size={size}", f"dataset.store_side={dataset.store_side.value}",
              f"dataset.store_quality={dataset.store_quality}",
              f"loader.ffcv_mode={loader.ffcv_mode}")
    return FfcvSpec(source, size, dataset.store_side, dataset.store_quality, loader.ffcv_mode,
                    selected_by=picked)


class _Stored(torch.utils.data.Dataset):
    """(image at the stored size as HWC uint8, label, index) for FFCV's writer."""

    def __init__(self, samples: list[tuple[str, int]], spec: FfcvSpec):
        self.samples, self.spec = samples, spec

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        from runner.data.decode.decoders import upright_rgb

        path, label = self.samples[i]
        with Image.open(path) as img:
            img = upright_rgb(img)
        h, w = stored_hw(img.height, img.width, self.spec.store_size, self.spec.side)
        if (h, w) != (img.height, img.width):
            img = img.resize((w, h), Image.Resampling.BILINEAR)
        return np.asarray(img), label, i


def _convert(folder_storage: FolderStorage, spec: FfcvSpec, journal: Journal,
             progress: bool) -> dict[str, Any]:
    check_ffcv()
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    journal.start_over()  # FFCV's writer cannot resume
    partial = journal.folder
    sources = np.zeros(len(folder_storage), dtype=SOURCE_DTYPE)

    def reasons():  # each file read once: its fingerprint, then the screen of its bytes
        for i, (path, _) in enumerate(folder_storage.samples):
            sources[i], data = file_record(path)
            yield "unreadable" if data is None else screen_data(data, data)

    kept, skipped = screen_samples(folder_storage, "FFCV", reasons())
    sources.tofile(partial / SOURCES)
    writer = DatasetWriter(str(partial / BETON), {
        "image": RGBImageField(write_mode=spec.mode, jpeg_quality=spec.quality),
        "label": IntField(), "index": IntField()}, num_workers=cores())
    writer.from_indexed_dataset(_Stored([folder_storage.samples[i] for i in kept], spec),
                                chunksize=64)
    return journal.finish(skipped, data_bytes=os.path.getsize(partial / BETON),
                          classes=folder_storage.classes)


class FfcvStorage(RivalStorage):
    """The screened image folder as an FFCV .beton, read by FFCV's Loader: one stage the
    runner cannot look inside, probed whole by the verdict."""

    stage = "ffcv"

    def __init__(self, folder: FolderStorage, loader: LoaderConfig, dataset: DatasetConfig,
                 progress: bool = True):
        check_ffcv()
        spec = ffcv_spec(loader, dataset, folder.root)
        cache, meta = ensure_cache(folder, spec, Path(dataset.cache_dir), progress)
        skipped = skipped_files(meta)
        left_out = {s.index for s in skipped}
        self._serve(folder, [i for i in range(len(folder)) if i not in left_out], skipped)
        self.path = cache / BETON
        self.spec, self.dataset = spec, dataset
        self.threads = loader.decode_threads or cores()

    @property
    def files(self) -> list[str]:
        return [str(self.path)]

    @property
    def image_bytes(self) -> int:
        return max(1, os.path.getsize(self.path) // max(len(self), 1))

    def own_loader(self, order: BatchOrder, device: torch.device) -> FfcvBatches:
        return FfcvBatches(self, order)


class FfcvBatches:
    """One epoch of FFCV's Loader per iteration, as the runner's loaders yield batches."""

    def __init__(self, storage: FfcvStorage, order: BatchOrder):
        from ffcv.fields.decoders import (
            CenterCropRGBImageDecoder,
            IntDecoder,
            RandomResizedCropRGBImageDecoder,
        )
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

        h, w = (int(v) for v in storage.dataset.image_size)
        if storage.dataset.crop is Crop.random:
            image = [RandomResizedCropRGBImageDecoder((h, w)), RandomHorizontalFlip()]
        else:  # the centre crop every storage takes: that share of the shorter side
            image = [CenterCropRGBImageDecoder((h, w), ratio=storage.dataset.crop_fraction)]
        ints = [IntDecoder(), ToTensor(), Squeeze()]
        self.order = order
        self.loader = Loader(
            str(storage.path), batch_size=order.batch_size, num_workers=storage.threads,
            order=OrderOption.RANDOM if order.shuffle else OrderOption.SEQUENTIAL,
            seed=order.seed, distributed=order.world > 1, drop_last=order.drop_last,
            batches_ahead=BATCHES_AHEAD,
            pipelines={"image": [*image, ToTensor(), ToTorchImage(channels_last=False)],
                       "label": ints, "index": list(ints)})

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        """Stop the epoch FFCV is reading ahead, if one was left unfinished."""
        epoch, self.epoch = getattr(self, "epoch", None), None
        if epoch is not None and epoch.is_alive():
            epoch.close()

    def __iter__(self):
        skip = self.order.begin_epoch()  # batches of a resumed epoch already done
        self.close()
        self.epoch = iter(self.loader)
        try:
            for k, (image, label, index) in enumerate(self.epoch):
                if k < skip:
                    continue
                yield {"image": image, "label": label.to(torch.int64),
                       "index": index.to(torch.int64)}, []
        finally:  # left early (the run's last step): FFCV's reader thread keeps working
            self.close()  # otherwise, taking a core from whatever runs next (the verdict)


def open_ffcv(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
              progress: bool = True) -> FfcvStorage:
    """The folder at ``path`` as an FFCV .beton read by FFCV's Loader (the rival, measured
    the runner's way)."""
    check_ffcv()  # before listing the folder: a clear skip when FFCV is not installed
    if dataset.crop in (Crop.whole, Crop.letterbox):
        raise RivalUnavailable(f"loader=ffcv has no dataset.crop={dataset.crop.value} (the "
                               "whole image resized without a crop): use loader=folder, "
                               "packed, shards, memmap or ram for detection and dense outputs")
    return FfcvStorage(open_folder(loader, dataset, path, progress), loader, dataset, progress)


def build_ffcv(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
               progress: bool = True, rebuild: bool = False) -> Path:
    """The .beton's folder, converted now if there is no valid one (or ``rebuild``)."""
    check_ffcv()
    folder = open_folder(loader, dataset, path, progress)
    return ensure_cache(folder, ffcv_spec(loader, dataset, path), Path(dataset.cache_dir),
                        progress, rebuild)[0]


KIND = StorageKind(
    name=StorageName.ffcv,
    open=open_ffcv,
    storage=FfcvStorage,
    summary="the rival: FFCV's .beton (at the stored size of loader=packed) and its Loader",
    decoders=CPU_DECODERS,  # only for the example images models are built with
    own_loader=True,
    autotune=False,
    advice={"ffcv": "FFCV's Loader is one stage the runner cannot look inside (read, decode "
                    "and crop together); compare it with loader=packed, memmap or ram in "
                    "python -m runner -m sweep=rivals"},
    build=build_ffcv,
)
