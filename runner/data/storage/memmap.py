"""``loader=memmap``: decode an image folder once into a uint8 MemoryMappedTensor store.

A store holds ``images.memmap`` (N, 3, H, W) uint8 and ``labels.memmap`` (N,) int64, both
tensordict ``MemoryMappedTensor`` files, beside the engine's ``sources.bin`` and
``meta.json`` (runner/data/storage/convert.py: keyed, fingerprinted, resumable, reserved,
published atomically, checked). Slot ``i`` holds file ``i`` of the folder in ImageFolder
order; an undecodable file leaves its slot zero and is listed as skipped. The images are
``dataset.image_size``, or that size scaled to ``dataset.store_size`` (cropped to the output
on the device per batch).

A store holds the whole folder, whatever ``dataset.val_fraction``: a run with a split reads
the slots of its side (``split_slots``, the split every storage makes), so runs with and
without one share one store and never rebuild it for each other. A reader opens the files
once, through the folder whose ``meta.json`` it checked (``pin_store``), and maps them again
(``dataset.page_cache=cold``) from the file it holds open, never by name: a store another
run publishes meanwhile (a rebuild after the source changed) never reaches it.

A detection store (``dataset.targets``) adds a ragged side store of each image's boxes
(runner/data/storage/decoded.py's ``RaggedBoxes``): ``boxes.memmap`` float32 [C, 4] (xyxy,
pixels of the stored image), ``box_labels.memmap`` int64 [C], ``box_offsets.memmap`` int64
[N + 1] (slot ``i``'s room: its label file's box count) and ``box_counts.memmap`` int64 [N]
(the boxes its decode kept). The conversion writes each image's boxes as the folder loader
maps them through the window it decoded at the stored size (``follow``: clipped, those
under a pixel dropped), a chunk's rows synced before the chunk is recorded, like its
pixels. Its key holds the label format and the listing's images folder (a classification
store and a detection store of one folder, or a layout's train and val splits, never
share a folder), and the source's fingerprint holds every image's boxes (an edited label
file rebuilds the store: convert.py's ``layout_fingerprint``). The readers load the table
into memory (small beside the pixels); a detection layout's own split folders and
``dataset.val_fraction`` together are refused (``check_whole_listing``).

A store of a per-pixel target (masks: ``dataset.targets=masks``; the kind's ``TargetPlane``,
runner/data/targets/target.py) adds one plane file per target, ``<key>.memmap`` (masks:
``mask.memmap``, uint8 [N, H, W] at the stored size), written by the conversion's workers
straight into its rows as they write the pixels (each image's target as the folder loader
makes it at that size: masks resized NEAREST through the same window, 255 ignored, also
for a letterbox's padding and a skipped slot) and synced with them before a chunk is
recorded. The store names the plane by its key and dtype only (``settings``' ``plane``);
the readers map it beside the images (memmap) or read it into shared memory (ram). Its
key holds the kind's label format and images folder as a detection store's does, and the
source's fingerprint holds every mask file's bytes (an edited mask rebuilds the store:
convert.py's ``targets_fingerprint``). A layout with split folders of its own and
``dataset.val_fraction`` together are refused, as for boxes.

The conversion decodes with the folder loader itself (same decoder, resize, class
indices), in worker processes, one chunk of images per task, with a progress bar; a worker
that dies fails the conversion at once (``WorkerDied``), never hangs it. The content hash
of the fingerprint costs about 6% of the conversion's decode time (BLAKE2b at about 1 GB/s
against about 1.3 ms to decode an 85 KB JPEG here).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import MemoryMappedTensor
from tqdm import tqdm

from runner.common.errors import ConfigError
from runner.config.schema import Crop, DatasetConfig, LoaderConfig, Split, StorageName, StoreSide
from runner.data.decode.decoders import CPU_DECODERS, ImageDecoder, check_decoder
from runner.data.pool import parallel_imap
from runner.data.protocol import (
    SkippedFile,
    StorageKind,
    StoreFootprint,
    image_nbytes,
)
from runner.data.sources.listing import split_positions
from runner.data.storage.convert import (
    META,
    SOURCE_DTYPE,
    SOURCES,
    CacheError,
    Journal,
    StoreSpec,
    chunk_ranges,
    ensure_cache,
    file_record,
    reserve,
    skipped_files,
)
from runner.data.storage.decoded import DecodedStorage, RaggedBoxes
from runner.data.storage.folder import FolderStorage, open_folder
from runner.data.targets import TARGETS
from runner.data.targets.target import TargetPlane

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: per-file stats and content hashes (sources.bin)
IMAGES, LABELS = "images.memmap", "labels.memmap"
# a detection store's side store of boxes (RaggedBoxes' four tensors, raw little-endian)
BOXES, BOX_LABELS = "boxes.memmap", "box_labels.memmap"
BOX_OFFSETS, BOX_COUNTS = "box_offsets.memmap", "box_counts.memmap"


def plane_file(key: str) -> str:
    """The file of a per-pixel target's plane (``mask.memmap``)."""
    return f"{key}.memmap"


def plane_dtype(name: str) -> torch.dtype:
    """A plane's dtype from its name in ``meta.json`` (``uint8``)."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def plane_nbytes(count: int, image_size, dtype: torch.dtype) -> int:
    return count * int(image_size[0]) * int(image_size[1]) * dtype.itemsize


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
    letterbox: bool = False  # dataset.crop=letterbox: the whole image, aspect kept, padded
    # the share of the shorter side the stored centre crop keeps: dataset.crop_fraction when
    # stored at the output size; 1.0 (the whole shorter side) at dataset.store_size, whose
    # centre crop is then cut on the device
    fraction: float = 1.0
    # detection (dataset.targets): the label format, and the folder the listing's images
    # are in, relative to the source (a layout's split folder); None: a classification store
    targets: str | None = None
    images: str | None = None
    # a per-pixel target kept as a plane beside the images (masks), or None
    plane: TargetPlane | None = None

    kind = StorageName.memmap.value
    version = CACHE_VERSION

    def settings(self) -> dict[str, Any]:
        return {"source": str(self.source), "image_size": list(self.image_size),
                "decoder": self.decoder, "draft": self.draft,
                **({"crop": "whole"} if self.whole else {}),
                **({"crop": "letterbox"} if self.letterbox else {}),
                **({"crop_fraction": self.fraction} if self.fraction != 1.0 else {}),
                **({"targets": self.targets, "images": self.images} if self.targets else {}),
                **({"plane": self.plane.key, "plane_dtype": dtype_name(self.plane.dtype)}
                   if self.plane is not None else {})}

    def label(self) -> str:
        h, w = self.image_size
        return (f"{h}x{w}-{self.decoder}{'-draft' if self.draft else ''}"
                f"{'-whole' if self.whole else ''}"
                f"{'-letterbox' if self.letterbox else ''}"
                f"{f'-crop{self.fraction:g}' if self.fraction != 1.0 else ''}"
                f"{f'-{self.targets}' if self.targets else ''}"
                f"{f'-{self.plane.key}' if self.plane is not None else ''}")

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
        sizes = {IMAGES: count * image_nbytes(self.image_size), LABELS: count * 8}
        if self.targets and self.plane is None:  # boxes: the ragged side store
            room = meta.get("boxes")
            if not isinstance(room, int) or room < 0:
                raise self.damaged(folder, f"its {META} has no box count")
            sizes.update({BOXES: room * 16, BOX_LABELS: room * 8,
                          BOX_OFFSETS: (count + 1) * 8, BOX_COUNTS: count * 8})
        if self.plane is not None:
            if meta.get("planes") != {self.plane.key: dtype_name(self.plane.dtype)}:
                raise self.damaged(folder, f"its {META} does not name its "
                                           f"{self.plane.key} plane")
            sizes[plane_file(self.plane.key)] = plane_nbytes(count, self.image_size,
                                                             self.plane.dtype)
        return sizes

    def convert(self, folder_storage: FolderStorage, journal: Journal, progress: bool
                ) -> dict[str, Any]:
        """Decode every image into ``journal.folder``, resuming what a killed conversion
        left there; returns the store's metadata."""
        return _convert(folder_storage, self, journal, progress)


def memmap_spec(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                folder: FolderStorage | None = None) -> MemmapSpec:
    """The store ``loader=memmap`` (and ``loader=ram``, which loads it) uses for ``path``;
    a detection store's key also takes the label format and images folder of ``folder``
    (``decoding_folder``'s listing)."""
    source = Path(path).expanduser().resolve()
    picked = [f"dataset.path={source}",
              f"dataset.image_size=[{','.join(str(int(v)) for v in dataset.image_size)}]",
              f"loader.decoder={loader.decoder.value}",
              f"loader.draft={str(bool(loader.draft)).lower()}"]
    if dataset.store_size is not None:
        picked += [f"dataset.store_size={dataset.store_size}",
                   f"dataset.store_side={dataset.store_side.value}"]
    whole, letterbox = dataset.crop is Crop.whole, dataset.crop is Crop.letterbox
    if whole or letterbox:
        picked.append(f"dataset.crop={dataset.crop.value}")
    fraction = stored_fraction(dataset)
    if fraction != 1.0:
        picked.append(f"dataset.crop_fraction={fraction:g}")
    targets = images = None
    kind = TARGETS[dataset.targets.kind]
    if kind.batch_keys:  # a target beside the label (boxes, masks): keyed by its layout
        picked.append(f"dataset.targets={dataset.targets.value}")
        if dataset.split is Split.val:
            picked.append("dataset.split=val")
        if folder is not None and folder.targets is not None:
            targets = folder.targets.format
            images = os.path.relpath(Path(folder.root).resolve(), source)
        else:
            targets = dataset.targets.value
    return MemmapSpec(source, stored_size(dataset), loader.decoder.value, bool(loader.draft),
                      selected_by=tuple(picked), whole=whole, letterbox=letterbox,
                      fraction=fraction, targets=targets, images=images, plane=kind.plane)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def whole_folder(dataset: DatasetConfig) -> DatasetConfig:
    """``dataset`` without its split: what a store holds (every image of the folder)."""
    if dataset.val_fraction > 0:
        return dataclasses.replace(dataset, val_fraction=0.0)
    return dataset


def split_slots(dataset: DatasetConfig, folder: FolderStorage) -> list[int] | None:
    """The slots of a store of the whole ``folder`` that ``dataset.val_fraction``'s side
    (``dataset.split``) holds, in order: the images a folder with the split lists (None:
    no split, every slot)."""
    if dataset.val_fraction <= 0:
        return None
    held_out = dataset.split is Split.val
    slots = split_positions(len(folder), dataset.val_fraction, dataset.split_seed, held_out)
    log.info("dataset.val_fraction=%g: %d of the store's %d images %s",
             dataset.val_fraction, len(slots), len(folder),
             "held out for validation" if held_out else "trained on")
    return slots


def fd_path(fd: int) -> str:
    """A name that opens the file ``fd`` holds open (even once unlinked or replaced)."""
    for base in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(base):
            return f"{base}/{fd}"
    raise OSError(f"no /proc/self/fd or /dev/fd to map file descriptor {fd} by")


@dataclass
class PinnedStore:
    """A published store's files, opened through the folder whose ``meta.json`` was
    checked: ``images`` is held open for the reader's life, so mapping it again maps
    the same bytes whatever is published under the folder's name meanwhile."""

    folder: Path
    meta: dict[str, Any]
    images: Any  # the open images.memmap (a binary file object)
    labels: torch.Tensor
    boxes: RaggedBoxes | None = None  # a detection store's side store, read into memory
    planes: dict[str, Any] = field(default_factory=dict)  # key -> its open plane file

    @property
    def images_path(self) -> str:
        return fd_path(self.images.fileno())

    def map_images(self) -> MemoryMappedTensor:
        return open_images(Path(self.images_path), self.meta, name=None)

    def plane_path(self, key: str) -> str:
        return fd_path(self.planes[key].fileno())

    def map_planes(self) -> dict[str, MemoryMappedTensor]:
        """Each plane mapped (mode "r": copy-on-write, as the images)."""
        return {key: open_plane(Path(self.plane_path(key)), self.meta, key)
                for key in self.planes}

    def close_planes(self) -> None:
        for f in self.planes.values():
            f.close()


PIN_TRIES = 5


def pin_store(find: Callable[[], tuple[Path, dict[str, Any]] | None], spec: MemmapSpec
              ) -> PinnedStore | None:
    """The store ``find`` checks (and, for loader=memmap, builds), its files opened through
    the very folder whose ``meta.json`` names the build it checked (None: ``find`` found
    none). A store published between the check and the open is checked again."""
    for _ in range(PIN_TRIES):
        found = find()
        if found is None:
            return None
        folder, meta = found
        try:
            pinned = _open_pinned(folder, meta)
        except FileNotFoundError:  # moved away and removed while it was opened
            continue
        if pinned is not None:
            return pinned
    raise CacheError(f"the {spec.kind} store {spec.folder(Path('.')).name} was replaced "
                     f"{PIN_TRIES} times while this run opened it (another run rebuilding "
                     "it from a source that keeps changing?): run again once the source "
                     "is settled")


def _open_pinned(folder: Path, meta: dict[str, Any]) -> PinnedStore | None:
    """``folder``'s files, if its ``meta.json`` is still ``meta`` (else None)."""
    directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        def opener(name: str, flags: int) -> int:
            return os.open(name, flags, dir_fd=directory)

        with open(META, "rb", opener=opener) as f:
            now = json.loads(f.read())
        if json.loads(json.dumps(meta)) != now:
            return None  # another build was published there since it was checked
        images = open(IMAGES, "rb", buffering=0, opener=opener)
        labels = _read_tensor(LABELS, torch.int64, opener)
        boxes = _read_boxes(meta, opener) if "boxes" in meta else None
        planes = {key: open(plane_file(key), "rb", buffering=0, opener=opener)
                  for key in meta.get("planes", {})}
    finally:
        os.close(directory)
    count = meta["count"]
    if len(labels) != count or os.fstat(images.fileno()).st_size != \
            count * image_nbytes(tuple(meta["image_size"])) or (
                boxes is not None and (len(boxes.counts) != count
                                       or len(boxes.labels) != meta["boxes"])) or any(
                os.fstat(f.fileno()).st_size != plane_nbytes(
                    count, meta["image_size"], plane_dtype(meta["planes"][key]))
                for key, f in planes.items()):
        images.close()
        for f in planes.values():
            f.close()
        return None  # not the files check_files measured: look again
    return PinnedStore(folder, meta, images, labels, boxes, planes)


def _read_tensor(name: str, dtype: torch.dtype, opener: Callable) -> torch.Tensor:
    """A whole raw file of the store as a tensor in memory."""
    with open(name, "rb", opener=opener) as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _read_boxes(meta: dict[str, Any], opener: Callable) -> RaggedBoxes:
    """A detection store's side store, in memory."""
    boxes = _read_tensor(BOXES, torch.float32, opener).reshape(-1, 4)
    return RaggedBoxes(boxes, _read_tensor(BOX_LABELS, torch.int64, opener),
                       _read_tensor(BOX_OFFSETS, torch.int64, opener),
                       _read_tensor(BOX_COUNTS, torch.int64, opener))


def open_images(folder: Path, meta: dict[str, Any], writable: bool = False,
                name: str | None = IMAGES) -> MemoryMappedTensor:
    """The images file of ``folder`` mapped (``name`` None: ``folder`` is the file)."""
    shape = image_shape(meta["count"], tuple(meta["image_size"]))
    # mode "r" maps copy-on-write: a reader can never change the store on disk
    path = folder / name if name else folder
    return MemoryMappedTensor.from_filename(path, dtype=torch.uint8,
                                            shape=torch.Size(shape), mode="r+" if writable else "r")


def open_plane(path: Path, meta: dict[str, Any], key: str, writable: bool = False
               ) -> MemoryMappedTensor:
    """The plane ``key`` of a store, at ``path`` (the file itself), mapped [N, H, W]."""
    shape = (meta["count"], *meta["image_size"])
    return MemoryMappedTensor.from_filename(path, dtype=plane_dtype(meta["planes"][key]),
                                            shape=torch.Size(shape),
                                            mode="r+" if writable else "r")


def decoding_folder(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                    progress: bool = True) -> FolderStorage:
    """The folder a decode-once store is made from: every image of it (no split), decoded
    at the stored size with the deterministic centre crop (random crops of training
    batches happen on the device, runner/data/decode/crops.py)."""
    check_decoder(loader.decoder)
    check_whole_listing(dataset, path)
    if dataset.crop is Crop.letterbox and dataset.store_size is not None:
        raise ConfigError(
            f"dataset.crop=letterbox with dataset.store_size={dataset.store_size}: "
            f"loader={loader.name.value} stores the letterbox itself, at dataset.image_size "
            "(a larger store would be cut by a centre crop on the device): leave "
            "dataset.store_size unset")
    crop = dataset.crop if dataset.crop in (Crop.whole, Crop.letterbox) else Crop.center
    decode = ImageDecoder(loader.decoder, stored_size(dataset), crop, loader.draft,
                          stored_fraction(dataset))
    return open_folder(loader, whole_folder(dataset), path, progress, decode=decode)


def check_whole_listing(dataset: DatasetConfig, path: Path) -> None:
    """A detection or masks layout with split folders of its own lists one of them without
    ``dataset.val_fraction`` and all of it with one: a store of the whole listing
    (``whole_folder``) cannot be split as the run lists it. Refused in one line."""
    kind = TARGETS[dataset.targets.kind]
    if not kind.batch_keys or kind.has_val_split is None or dataset.val_fraction <= 0 \
            or path is None:
        return
    # the layout's own split, asked as a run without val_fraction would ask it
    own = dataclasses.replace(dataset, val_fraction=0.0, path=str(path), val_path=None,
                              manifest=None)
    if kind.has_val_split(own):
        raise ConfigError(
            f"dataset.val_fraction={dataset.val_fraction:g} splits a {kind.name.value} "
            f"layout that has split folders of its own ({dataset.split.value}: its images "
            "and the others listed together), which loader=memmap and loader=ram do not "
            "store: leave dataset.val_fraction=0 (the layout's own split), or use "
            "loader=folder or loader=packed")


def open_memmap(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> DecodedStorage:
    """The memmap store of the folder at ``path`` (converted first if there is no valid
    one), serving the side of ``dataset.val_fraction``'s split the run reads."""
    folder = decoding_folder(loader, dataset, path, progress)
    return open_cache(folder, memmap_spec(loader, dataset, path, folder),
                      Path(dataset.cache_dir), progress,
                      keep=split_slots(dataset, folder)).serving(dataset)


def build_memmap(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                 progress: bool = True, rebuild: bool = False) -> Path:
    """The memmap store's folder, converted now if there is no valid one (or ``rebuild``)."""
    folder = decoding_folder(loader, dataset, path, progress)
    return ensure_cache(folder, memmap_spec(loader, dataset, path, folder),
                        Path(dataset.cache_dir), progress, rebuild)[0]


def open_cache(folder: FolderStorage, spec: MemmapSpec, cache_root: Path,
               progress: bool = True, keep: list[int] | None = None) -> DecodedStorage:
    """The memmap store of ``folder`` as a storage (converted first if there is no valid
    one), its files held open (``pin_store``); ``keep``: the slots it serves (None: all)."""
    pinned = pin_store(lambda: ensure_cache(folder, spec, cache_root, progress), spec)
    # the reopen keeps the open file alive: mapped again from it, never by name; files
    # names it where it was published (what a cold page cache evicts, what the bench
    # measures on disk), a name that outlives this storage
    storage = DecodedStorage(pinned.map_images(), pinned.labels,
                             skipped=skipped_files(pinned.meta), classes=folder.classes,
                             names=folder.names(), root=folder.root,
                             files=[str(pinned.folder / IMAGES)], reopen=pinned.map_images,
                             keep=keep, boxes=pinned.boxes, planes=pinned.map_planes())
    pinned.close_planes()  # mapped: the mappings hold the bytes they were opened with
    return with_label_skips(storage, folder)


def with_label_skips(storage: DecodedStorage, folder: FolderStorage,
                     listed: FolderStorage | None = None) -> DecodedStorage:
    """``storage`` reporting a detection set's bad labels too, as the folder does, and
    holding its images' targets as listed (``targets``: source sizes, COCO's ids, for the
    detections a run serves); ``listed``: the folder its slots number, when not ``folder``."""
    if folder.targets is not None:
        storage.known_skipped += folder.targets.skipped
        storage.targets = (listed or folder).targets.subset(storage.slots.tolist())
    return storage


def raw_footprint(dataset: DatasetConfig, folder: FolderStorage) -> StoreFootprint:
    h, w = stored_size(dataset)
    plane = TARGETS[dataset.targets.kind].plane  # a per-pixel target's plane beside them
    extra = 0 if plane is None else plane_nbytes(1, (h, w), plane.dtype)
    return StoreFootprint(f"raw uint8 at {h}x{w}" + (f" + a {plane.key} plane" if plane else ""),
                          len(folder) * (3 * h * w + extra))


# --- conversion ---------------------------------------------------------------------------

def _convert(folder_storage: FolderStorage, spec: MemmapSpec, journal: Journal,
             progress: bool) -> dict[str, Any]:
    count, partial = len(folder_storage), journal.folder
    reserve(partial / IMAGES, count * image_nbytes(spec.image_size))  # zeros until decoded
    reserve(partial / SOURCES, count * SOURCE_DTYPE.itemsize)
    boxes = box_room(folder_storage)  # detection: this run's chunks, written as they finish
    planes_meta = {} if spec.plane is None else {spec.plane.key: dtype_name(spec.plane.dtype)}
    for key, dtype in planes_meta.items():  # a per-pixel target: its workers write its rows
        reserve(partial / plane_file(key), plane_nbytes(count, spec.image_size,
                                                        plane_dtype(dtype)))
    if boxes is not None:
        reserve(partial / BOXES, len(boxes.labels) * 16)
        reserve(partial / BOX_LABELS, len(boxes.labels) * 8)
    if not journal.done:
        (partial / LABELS).write_bytes(folder_storage.label_tensor().numpy().tobytes())
        if boxes is not None:
            (partial / BOX_OFFSETS).write_bytes(boxes.offsets.numpy().tobytes())
            (partial / BOX_COUNTS).write_bytes(boxes.counts.numpy().tobytes())
        journal.start()
    chunks = chunk_ranges(count)
    todo = journal.todo(chunks)
    images = open_images(partial, {"count": count, "image_size": spec.image_size}, writable=True)
    sources = np.memmap(partial / SOURCES, dtype=SOURCE_DTYPE, mode="r+", shape=(count,))
    shape = {"count": count, "image_size": spec.image_size, "planes": planes_meta}
    planes = {key: open_plane(partial / plane_file(key), shape, key, writable=True)
              for key in planes_meta}
    plane_fds = [os.open(partial / plane_file(key), os.O_RDWR) for key in planes_meta]
    try:
        with open(partial / IMAGES, "rb+") as pixels, BoxFiles(partial, boxes) as box_files:
            def on_chunk(chunk: tuple[int, int], skipped: list[SkippedFile]) -> None:
                sources.flush()
                box_files.write(*chunk)  # the chunk's boxes, synced
                for fd in (pixels.fileno(), *plane_fds):  # pixels and planes reach the
                    os.fdatasync(fd)  # disk before the record does
                journal.record(chunk[0], skipped)

            decode_into(images, folder_storage, todo, progress, on_chunk, total=count,
                        already=count - sum(e - s for s, e in todo), sources=sources,
                        boxes=boxes, planes=planes)
    finally:
        for fd in plane_fds:
            os.close(fd)
    sources.flush()
    del images, planes
    extra = {} if boxes is None else {"boxes": len(boxes.labels)}
    if planes_meta:
        extra["planes"] = planes_meta
    return journal.finish(image_size=list(spec.image_size), dtype="uint8",
                          classes=folder_storage.classes, **extra)


def box_room(folder_storage: FolderStorage) -> RaggedBoxes | None:
    """An empty side store with room for each listed image's boxes (None: no targets, or
    a per-pixel target, which is kept as a plane instead)."""
    targets = folder_storage.targets
    if targets is None or TARGETS[targets.kind].plane is not None:
        return None
    return RaggedBoxes.room([len(t.labels) for t in folder_storage.targets.items])


class BoxFiles:
    """A conversion's side-store files, a chunk's rows of ``boxes`` written and synced at
    a time (nothing to do for a classification store)."""

    def __init__(self, folder: Path, boxes: RaggedBoxes | None):
        self.folder, self.boxes, self.fds = folder, boxes, {}

    def __enter__(self) -> BoxFiles:
        if self.boxes is not None:
            self.fds = {name: os.open(self.folder / name, os.O_WRONLY)
                        for name in (BOXES, BOX_LABELS, BOX_COUNTS)}
        return self

    def write(self, start: int, end: int) -> None:
        if self.boxes is None:
            return
        b = self.boxes
        first, last = int(b.offsets[start]), int(b.offsets[end])
        for name, table, at, stop in ((BOXES, b.boxes, first, last),
                                      (BOX_LABELS, b.labels, first, last),
                                      (BOX_COUNTS, b.counts, start, end)):
            row = math.prod(table.shape[1:]) * table.element_size()
            os.pwrite(self.fds[name], table[at:stop].numpy().tobytes(), at * row)
            os.fdatasync(self.fds[name])

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)


# Worker processes are forked with this set: they inherit the target mapping (and the
# planes') and the folder storage instead of receiving them by pickling.
_JOB: tuple[torch.Tensor, FolderStorage, np.ndarray | None, dict[str, torch.Tensor]] | None \
    = None


def _decode_chunk(chunk: tuple[int, int]
                  ) -> tuple[tuple[int, int], list[SkippedFile], list[tuple]]:
    """Decode ``chunk`` into the target's rows: its (start, end), its skipped files and,
    for detection, each decoded image's (index, boxes, labels) as numpy arrays (the
    parent writes them into its side store). A plane's rows are written here, as the
    pixels are: each decoded image's target by its key, a skipped one's the plane's fill."""
    target, folder_storage, sources, planes = _JOB
    fill = TARGETS[folder_storage.targets.kind].plane.fill if planes else 0
    skipped, boxes = [], []
    for i in range(*chunk):
        row, data = file_record(folder_storage.samples[i][0])
        # decodes, or raises with the path for on_corrupt=fail
        item = folder_storage.decode_data(i, data)
        if sources is not None:
            sources[i] = row
        if isinstance(item, SkippedFile):
            skipped.append(item)
            for plane in planes.values():
                plane[i] = fill
        else:
            target[i] = item.image
            for key, plane in planes.items():
                plane[i] = getattr(item, key)
            if item.boxes is not None:
                boxes.append((i, item.boxes.numpy(), item.box_labels.numpy()))
    return chunk, skipped, boxes


def _init_worker() -> None:
    torch.set_num_threads(1)  # one process per core already


def decode_into(target: torch.Tensor, folder_storage: FolderStorage,
                chunks: list[tuple[int, int]], progress: bool, on_chunk=None,
                total: int | None = None, already: int = 0,
                sources: np.ndarray | None = None, boxes: RaggedBoxes | None = None,
                planes: dict[str, torch.Tensor] | None = None) -> list[SkippedFile]:
    """Decode ``chunks`` of ``folder_storage`` into rows of ``target`` with every core,
    recording each file's stat and content hash in ``sources`` when given, and each
    image's boxes (at the decoded size) in ``boxes`` when given, and each image's per-pixel
    target in the rows of ``planes`` (key -> [N, H, W]) when given, before ``on_chunk``.

    ``target`` (and ``sources``, ``planes``) must be shared with forked children: a file
    mapping, or shared memory. A worker that dies fails this at once
    (``runner.data.pool.WorkerDied``).
    """
    global _JOB
    skipped: list[SkippedFile] = []
    bar = tqdm(total=total or len(folder_storage), initial=already, unit="img",
               desc="decoding", disable=not progress)
    _JOB = (target, folder_storage, sources, planes or {})
    try:
        for chunk, chunk_skipped, found in parallel_imap(_decode_chunk, chunks,
                                                         initializer=_init_worker):
            skipped += chunk_skipped
            if boxes is not None:
                for i, b, lab in found:
                    boxes.put(i, b, lab)
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
    boxes=True,  # a ragged side store beside the images, moved by the device's crops
    masks=True,  # a uint8 plane beside the images, moved by the device's crops
)
