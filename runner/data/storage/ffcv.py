"""``loader=ffcv``: FFCV's ``.beton`` and its Loader over ``dataset.path``, measured the
runner's way (the rival for datasets stored once and decoded per epoch, like packed).

Conversion, with the runner's cache rules (memmap.py's ``ensure_cache``: keyed by the
source's layout and every file's stat and content hash, rebuilt when stale, built in
``<key>.partial`` and published by a rename, refused with the rebuild command when
damaged): the files DALI would stop on are screened out the same way (dali.py) and listed
as skipped; the others are written by FFCV's ``DatasetWriter`` (its own worker processes
and progress bar) as JPEG (``loader.ffcv_mode=jpg``, at ``dataset.store_quality``) or raw
pixels (``raw``), at the same stored size as ``loader=packed`` (``dataset.store_size``
along ``dataset.store_side``; FFCV's own ``max_resolution`` caps only the longer side, so
the runner hands it images already at the stored size: both rivals hold the same pixels).
A conversion killed halfway is started again (FFCV's writer cannot resume).

Reading: FFCV's ``Loader`` with its decoders (``CenterCropRGBImageDecoder`` with the ratio
of the output to the stored size, or ``RandomResizedCropRGBImageDecoder`` and a random
flip), ``ToTensor`` and ``ToTorchImage``, one worker thread per core, FFCV's seeded random
order (``OrderOption.RANDOM``) or dataset order, FFCV's own sharding under torchrun
(``distributed=True``). Batches stay on the host: the runner's copy and prefetch move them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.config import Crop, DatasetConfig, LoaderConfig, StoreSide
from runner.data.order import BatchOrder
from runner.data.storage.base import SkippedFile
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import (
    META,
    SOURCE_DTYPE,
    SOURCES,
    CacheSpec,
    check_skipped,
    ensure_cache,
    file_record,
    layout_fingerprint,
    skipped_files,
)
from runner.data.storage.packed import stored_hw
from runner.data.storage.rival import RivalStorage, RivalUnavailable, screen_file
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
class FfcvSpec:
    """What a .beton's bytes depend on; each distinct spec gets its own folder."""

    source: Path
    store_size: int
    side: StoreSide
    quality: int
    mode: str  # jpg or raw

    kind = "ffcv"
    version = FFCV_VERSION
    damaged = CacheSpec.damaged

    def settings(self) -> dict[str, Any]:
        return {"source": str(self.source), "store_size": self.store_size,
                "side": self.side.value, "quality": self.quality, "mode": self.mode}

    def folder(self, cache_root: Path) -> Path:
        digest = hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode())
        name = (f"{self.source.name}-{self.side.value}{self.store_size}-{self.mode}"
                f"{self.quality if self.mode == 'jpg' else ''}-{digest.hexdigest()[:10]}")
        return Path(cache_root).expanduser() / "ffcv" / name

    def rebuild_command(self) -> str:
        return (f"deleting that folder; the next python -m runner loader=ffcv "
                f"dataset.path={self.source} converts again")

    def file_sizes(self, folder: Path, meta: dict[str, Any]) -> dict[str, int]:
        if not isinstance(meta.get("data_bytes"), int):
            raise self.damaged(folder, f"its {META} lacks or mistypes: data_bytes")
        return {BETON: meta["data_bytes"], SOURCES: meta["count"] * SOURCE_DTYPE.itemsize}

    def convert(self, folder_storage: FolderStorage, partial: Path, progress: bool
                ) -> dict[str, Any]:
        return _convert(folder_storage, self, partial, progress)


class _Stored(torch.utils.data.Dataset):
    """(image at the stored size as HWC uint8, label, index) for FFCV's writer."""

    def __init__(self, samples: list[tuple[str, int]], spec: FfcvSpec):
        self.samples, self.spec = samples, spec

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image, ImageOps

        path, label = self.samples[i]
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img).convert("RGB")
        h, w = stored_hw(img.height, img.width, self.spec.store_size, self.spec.side)
        if (h, w) != (img.height, img.width):
            img = img.resize((w, h), Image.Resampling.BILINEAR)
        return np.asarray(img), label, i


def _convert(folder_storage: FolderStorage, spec: FfcvSpec, partial: Path,
             progress: bool) -> dict[str, Any]:
    import shutil

    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    shutil.rmtree(partial, ignore_errors=True)  # FFCV's writer cannot resume: start over
    partial.mkdir(parents=True)
    count = len(folder_storage)
    sources = np.zeros(count, dtype=SOURCE_DTYPE)
    kept, skipped = [], []
    for i, (path, label) in enumerate(folder_storage.samples):
        row, _ = file_record(path)
        sources[i] = row
        reason = screen_file(path)
        if reason is None:
            kept.append((path, label))
        else:
            skipped.append({"index": i, "path": path, "error": f"screened out for FFCV: {reason}"})
            folder_storage.undecodable(path, ValueError(reason), i)  # on_corrupt=fail raises
    sources.tofile(partial / SOURCES)
    writer = DatasetWriter(str(partial / BETON), {
        "image": RGBImageField(write_mode=spec.mode, jpeg_quality=spec.quality),
        "label": IntField(), "index": IntField()}, num_workers=cores())
    writer.from_indexed_dataset(_Stored(kept, spec), chunksize=64)
    meta = {"version": FFCV_VERSION, "settings": spec.settings(),
            "layout": layout_fingerprint(folder_storage), "count": count,
            "data_bytes": os.path.getsize(partial / BETON), "classes": folder_storage.classes,
            "kept": len(kept), "skipped": skipped}
    (partial / META).write_text(json.dumps(meta))
    return meta


class FfcvStorage(RivalStorage):
    """The screened image folder as an FFCV .beton, read by FFCV's Loader: one stage the
    runner cannot look inside (``opaque``), probed whole by the verdict."""

    stage = "ffcv"

    def __init__(self, folder: FolderStorage, loader: LoaderConfig, dataset: DatasetConfig,
                 progress: bool = True):
        check_ffcv()
        size = dataset.store_size or math.ceil(max(dataset.image_size) * 8 / 7)
        spec = FfcvSpec(Path(folder.root).expanduser().resolve(), int(size),
                        dataset.store_side, dataset.store_quality, loader.ffcv_mode)
        cache, meta = ensure_cache(folder, spec, Path(dataset.cache_dir), progress)
        check_skipped(meta, folder)
        skipped = {s["index"] for s in meta["skipped"]}
        self.root, self.classes = folder.root, folder.classes
        self.samples = [s for i, s in enumerate(folder.samples) if i not in skipped]
        self.decode, self.on_corrupt = folder.decode, folder.on_corrupt
        self.known_skipped: list[SkippedFile] = skipped_files(meta)
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
        else:  # the runner's centre crop of the stored image: output / stored shorter side
            image = [CenterCropRGBImageDecoder((h, w), ratio=1.0)]
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


def open_ffcv(folder: FolderStorage, loader: LoaderConfig, dataset: DatasetConfig,
              progress: bool = True) -> FfcvStorage:
    return FfcvStorage(folder, loader, dataset, progress)
