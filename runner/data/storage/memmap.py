"""``loader=memmap``: decode an image folder once into a uint8 MemoryMappedTensor store.

A store holds ``images.memmap`` (N, 3, H, W) uint8 and ``labels.memmap`` (N,) int64, both
tensordict ``MemoryMappedTensor`` files, beside the engine's ``sources.bin`` and
``meta.json`` (runner/data/storage/cache.py: keyed, fingerprinted, resumable, reserved,
published atomically, checked). Slot ``i`` holds file ``i`` of the folder in ImageFolder
order; an undecodable file leaves its slot zero and is listed as skipped. The images are
``dataset.image_size``, or that size scaled to ``dataset.store_size`` (cropped to the output
on the device per batch).

The conversion decodes with the folder loader itself (same decoder, resize, class
indices), in worker processes, one chunk of images per task, with a progress bar; a worker
that dies fails the conversion at once (``WorkerDied``), never hangs it. The content hash
of the fingerprint costs about 6% of the conversion's decode time (BLAKE2b at about 1 GB/s
against about 1.3 ms to decode an 85 KB JPEG here).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import MemoryMappedTensor
from tqdm import tqdm

from runner.config import Crop, DatasetConfig, LoaderConfig, StorageName, StoreSide
from runner.data.pool import parallel_imap
from runner.data.storage.base import (
    SkippedFile,
    StorageKind,
    StoreFootprint,
    image_nbytes,
)
from runner.data.storage.cache import (
    SOURCE_DTYPE,
    SOURCES,
    Journal,
    StoreSpec,
    chunk_ranges,
    ensure_cache,
    file_record,
    reserve,
    skipped_files,
)
from runner.data.storage.decode import CPU_DECODERS, ImageDecoder, check_decoder
from runner.data.storage.decoded import DecodedStorage
from runner.data.storage.folder import FolderStorage, open_folder

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: per-file stats and content hashes (sources.bin)
IMAGES, LABELS = "images.memmap", "labels.memmap"


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


@dataclass(frozen=True)
class MemmapSpec(StoreSpec):
    """What a memmap store's pixels depend on; each distinct spec gets its own folder.

    ``selected_by``: the overrides that chose it (its rebuild command), not part of the key.
    """

    source: Path
    image_size: tuple[int, int]  # as stored (dataset.store_size, else dataset.image_size)
    decoder: str
    draft: bool
    selected_by: tuple[str, ...] = field(default=(), compare=False)
    whole: bool = False  # dataset.crop=whole: the whole image resized, not centre-cropped
    # the share of the shorter side the stored centre crop keeps: dataset.crop_fraction when
    # stored at the output size; 1.0 (the whole shorter side) at dataset.store_size, whose
    # centre crop is then cut on the device
    fraction: float = 1.0

    kind = StorageName.memmap.value
    version = CACHE_VERSION

    def settings(self) -> dict[str, Any]:
        return {"source": str(self.source), "image_size": list(self.image_size),
                "decoder": self.decoder, "draft": self.draft,
                **({"crop": "whole"} if self.whole else {}),
                **({"crop_fraction": self.fraction} if self.fraction != 1.0 else {})}

    def label(self) -> str:
        h, w = self.image_size
        return (f"{h}x{w}-{self.decoder}{'-draft' if self.draft else ''}"
                f"{'-whole' if self.whole else ''}"
                f"{f'-crop{self.fraction:g}' if self.fraction != 1.0 else ''}")

    def overrides(self) -> list[str]:
        h, w = self.image_size
        return list(self.selected_by) or [
            f"dataset.path={self.source}", f"dataset.image_size=[{h},{w}]",
            f"loader.decoder={self.decoder}", f"loader.draft={str(self.draft).lower()}"]

    def file_sizes(self, folder: Path, meta: dict[str, Any]) -> dict[str, int]:
        """The bytes each file of a valid store holds (CacheError when ``meta`` disagrees
        with this spec)."""
        if meta.get("image_size") != list(self.image_size):
            raise self.damaged(folder, f"its image size {meta.get('image_size')} is not "
                                       f"{list(self.image_size)}")
        count = meta["count"]
        return {IMAGES: count * image_nbytes(self.image_size), LABELS: count * 8}

    def convert(self, folder_storage: FolderStorage, journal: Journal, progress: bool
                ) -> dict[str, Any]:
        """Decode every image into ``journal.folder``, resuming what a killed conversion
        left there; returns the store's metadata."""
        return _convert(folder_storage, self, journal, progress)


def memmap_spec(loader: LoaderConfig, dataset: DatasetConfig, path: Path) -> MemmapSpec:
    """The store ``loader=memmap`` (and ``loader=ram``, which loads it) uses for ``path``."""
    source = Path(path).expanduser().resolve()
    picked = [f"dataset.path={source}",
              f"dataset.image_size=[{','.join(str(int(v)) for v in dataset.image_size)}]",
              f"loader.decoder={loader.decoder.value}",
              f"loader.draft={str(bool(loader.draft)).lower()}"]
    if dataset.store_size is not None:
        picked += [f"dataset.store_size={dataset.store_size}",
                   f"dataset.store_side={dataset.store_side.value}"]
    whole = dataset.crop is Crop.whole
    if whole:
        picked.append("dataset.crop=whole")
    fraction = stored_fraction(dataset)
    if fraction != 1.0:
        picked.append(f"dataset.crop_fraction={fraction:g}")
    return MemmapSpec(source, stored_size(dataset), loader.decoder.value, bool(loader.draft),
                      selected_by=tuple(picked), whole=whole, fraction=fraction)


def stored_fraction(dataset: DatasetConfig) -> float:
    """The share of the shorter side memmap/ram store: for centre crops stored at the output
    size, ``dataset.crop_fraction`` (the centre crop itself); otherwise the whole side (a
    store larger than the output, whose centre crop is cut on the device; random crops,
    cut from the whole stored side as a folder's decode cuts them from the whole image)."""
    size = tuple(int(v) for v in dataset.image_size)
    if dataset.crop is not Crop.center or stored_size(dataset) != size:
        return 1.0
    return float(dataset.crop_fraction)


def image_shape(count: int, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
    return (count, 3, *image_size)


def open_images(folder: Path, meta: dict[str, Any], writable: bool = False) -> MemoryMappedTensor:
    shape = image_shape(meta["count"], tuple(meta["image_size"]))
    # mode "r" maps copy-on-write: a reader can never change the store on disk
    return MemoryMappedTensor.from_filename(folder / IMAGES, dtype=torch.uint8,
                                            shape=torch.Size(shape), mode="r+" if writable else "r")


def open_labels(folder: Path, meta: dict[str, Any]) -> torch.Tensor:
    labels = MemoryMappedTensor.from_filename(folder / LABELS, dtype=torch.int64,
                                              shape=torch.Size([meta["count"]]), mode="r")
    return labels.clone()  # small: keep it in RAM


def decoding_folder(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                    progress: bool = True) -> FolderStorage:
    """The folder a decode-once store is made from: decoded at the stored size with the
    deterministic centre crop (random crops of training batches happen on the device,
    runner/data/augment.py)."""
    check_decoder(loader.decoder)
    crop = Crop.whole if dataset.crop is Crop.whole else Crop.center
    decode = ImageDecoder(loader.decoder, stored_size(dataset), crop, loader.draft,
                          stored_fraction(dataset))
    return open_folder(loader, dataset, path, progress, decode=decode)


def open_memmap(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> DecodedStorage:
    """The memmap store of the folder at ``path`` (converted first if there is no valid
    one)."""
    folder = decoding_folder(loader, dataset, path, progress)
    return open_cache(folder, memmap_spec(loader, dataset, path), Path(dataset.cache_dir),
                      progress).serving(dataset)


def build_memmap(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                 progress: bool = True, rebuild: bool = False) -> Path:
    """The memmap store's folder, converted now if there is no valid one (or ``rebuild``)."""
    folder = decoding_folder(loader, dataset, path, progress)
    return ensure_cache(folder, memmap_spec(loader, dataset, path), Path(dataset.cache_dir),
                        progress, rebuild)[0]


def open_cache(folder: FolderStorage, spec: MemmapSpec, cache_root: Path,
               progress: bool = True) -> DecodedStorage:
    """The memmap store of ``folder`` as a storage (converted first if there is no valid
    one)."""
    cache, meta = ensure_cache(folder, spec, cache_root, progress)
    storage = DecodedStorage(open_images(cache, meta), open_labels(cache, meta),
                             skipped=skipped_files(meta), classes=folder.classes,
                             names=folder.names(), root=folder.root,
                             files=[str(cache / IMAGES)],
                             reopen=lambda: open_images(cache, meta))
    return storage


def raw_footprint(dataset: DatasetConfig, folder: FolderStorage) -> StoreFootprint:
    h, w = stored_size(dataset)
    return StoreFootprint(f"raw uint8 at {h}x{w}", len(folder) * 3 * h * w)


# --- conversion ---------------------------------------------------------------------------

def _convert(folder_storage: FolderStorage, spec: MemmapSpec, journal: Journal,
             progress: bool) -> dict[str, Any]:
    count, partial = len(folder_storage), journal.folder
    reserve(partial / IMAGES, count * image_nbytes(spec.image_size))  # zeros until decoded
    reserve(partial / SOURCES, count * SOURCE_DTYPE.itemsize)
    if not journal.done:
        (partial / LABELS).write_bytes(folder_storage.label_tensor().numpy().tobytes())
        journal.start()
    chunks = chunk_ranges(count)
    todo = journal.todo(chunks)
    images = open_images(partial, {"count": count, "image_size": spec.image_size}, writable=True)
    sources = np.memmap(partial / SOURCES, dtype=SOURCE_DTYPE, mode="r+", shape=(count,))
    with open(partial / IMAGES, "rb+") as pixels:
        def on_chunk(chunk: tuple[int, int], skipped: list[SkippedFile]) -> None:
            sources.flush()
            os.fdatasync(pixels.fileno())  # the pixels reach the disk before the record does
            journal.record(chunk[0], skipped)

        decode_into(images, folder_storage, todo, progress, on_chunk, total=count,
                    already=count - sum(e - s for s, e in todo), sources=sources)
    sources.flush()
    del images
    return journal.finish(image_size=list(spec.image_size), dtype="uint8",
                          classes=folder_storage.classes)


# Worker processes are forked with this set: they inherit the target mapping and the
# folder storage instead of receiving them by pickling.
_JOB: tuple[torch.Tensor, FolderStorage, np.ndarray | None] | None = None


def _decode_chunk(chunk: tuple[int, int]) -> tuple[tuple[int, int], list[SkippedFile]]:
    target, folder_storage, sources = _JOB
    skipped = []
    for i in range(*chunk):
        row, data = file_record(folder_storage.samples[i][0])
        # decodes, or raises with the path for on_corrupt=fail
        item = folder_storage.decode_data(i, data)
        if sources is not None:
            sources[i] = row
        if isinstance(item, SkippedFile):
            skipped.append(item)
        else:
            target[i] = item.image
    return chunk, skipped


def _init_worker() -> None:
    torch.set_num_threads(1)  # one process per core already


def decode_into(target: torch.Tensor, folder_storage: FolderStorage,
                chunks: list[tuple[int, int]], progress: bool, on_chunk=None,
                total: int | None = None, already: int = 0,
                sources: np.ndarray | None = None) -> list[SkippedFile]:
    """Decode ``chunks`` of ``folder_storage`` into rows of ``target`` with every core,
    recording each file's stat and content hash in ``sources`` when given.

    ``target`` (and ``sources``) must be shared with forked children: a file mapping, or
    shared memory. A worker that dies fails this at once (``runner.data.pool.WorkerDied``).
    """
    global _JOB
    skipped: list[SkippedFile] = []
    bar = tqdm(total=total or len(folder_storage), initial=already, unit="img",
               desc="decoding", disable=not progress)
    _JOB = (target, folder_storage, sources)
    try:
        for chunk, chunk_skipped in parallel_imap(_decode_chunk, chunks, initializer=_init_worker):
            skipped += chunk_skipped
            if on_chunk is not None:
                on_chunk(chunk, chunk_skipped)
            bar.update(chunk[1] - chunk[0])
    finally:
        _JOB = None
        bar.close()
    return skipped


KIND = StorageKind(
    name=StorageName.memmap,
    open=open_memmap,
    storage=DecodedStorage,
    summary="decoded once into a uint8 memory-mapped file; each batch is one indexed read",
    decoders=CPU_DECODERS,
    knobs=("loader.shuffle_block",),
    bench={"memmap": ("loader=memmap",),
           "memmap_store_256": ("loader=memmap", "dataset.store_size=256")},
    build=build_memmap,
    footprint=raw_footprint,
    speed_rank=0,
)
