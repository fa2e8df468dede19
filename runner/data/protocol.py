"""The ``Storage`` protocol: what every ``loader=`` storage offers the rest of the runner.

A storage is a map-style Dataset (``__len__``, ``__getitem__``) whose batched read,
``gather``, fills a whole batch at once. Everything the runner needs beyond reading
(the files it reads, an example batch to compile with, the stage probes of the verdict)
is asked of the storage through this protocol, never found out by switching on its type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch.utils.data import get_worker_info

if TYPE_CHECKING:
    from runner.config.schema import DatasetConfig, Decoder, LoaderConfig, StorageName, TargetName

# A stage probe handles one unit of work (one file read, one image decoded, one batch
# gathered) and returns how many images that was; the verdict times it (runner/job/diagnose.py).
Probe = Callable[[], int]


@dataclass(frozen=True)
class Sample:
    """One decoded image: CHW uint8, its class index and its index in the dataset; with
    detection targets (``dataset.targets``), its boxes (float32 [n, 4], xyxy in the output
    image's pixels) and their class ids (int64 [n])."""

    image: torch.Tensor
    label: int
    index: int
    valid: bool = True  # False: padding that evens out distributed shards
    boxes: torch.Tensor | None = None
    box_labels: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # masks: uint8 [H, W] class ids (255 ignored)


@dataclass(frozen=True)
class SkippedFile:
    """A file no decoder could read, or a label the labels' reader left out (``label``:
    said there already, with its count); it travels to the loop to be counted and
    reported."""

    path: str
    error: str
    index: int = -1  # position in the storage
    label: bool = False  # a bad label (a box, a line, an annotation), not an image


def image_nbytes(image_size: tuple[int, int] | list[int]) -> int:
    """Bytes of one decoded image: 3 channels of uint8 at (height, width)."""
    return 3 * int(image_size[0]) * int(image_size[1])


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in shared memory, so it crosses to another process without a copy."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def stack_images(images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"image": torch.stack(images)}``, stacked into shared memory inside a DataLoader
    worker, so the batch crosses to the main process without another copy (what
    default_collate does)."""
    out = None
    if get_worker_info() is not None:
        out = shared_empty((len(images), *images[0].shape), images[0].dtype)
    return {"image": torch.stack(images, 0, out=out)}


def cycle_rows(images: torch.Tensor, n: int) -> torch.Tensor:
    """Exactly ``n`` rows: ``images`` repeated as often as needed (a full example batch)."""
    return images.repeat(-(-n // len(images)), *([1] * (images.dim() - 1)))[:n]


@runtime_checkable
class Storage(Protocol):
    """What every storage offers.

    Attributes:
        root: the source ImageFolder tree.
        classes: class names, in ImageFolder order.
        known_skipped: files already known to be undecodable when the storage was opened
            (a decode-once cache records them); counted and reported like any other skip.
        decodes_per_epoch: True when every epoch decodes the source files (so random crops
            happen while decoding); False when images were decoded once (center crops, so
            random crops of training batches happen on the device).
        random_crops: True when items take ``(index, crop_seed)`` and crop at random while
            decoding; the batch order then hands out a seed per image and epoch.

    What callers need to know about a storage without opening one (does it bring its own
    loader, which decoders and knobs it takes, its advice and bench rows) is in its
    registry record, ``StorageKind``.
    """

    root: Path
    classes: list[str]
    known_skipped: list[SkippedFile]
    decodes_per_epoch: bool
    random_crops: bool

    def __len__(self) -> int: ...

    def name_of(self, index: int) -> str:
        """The file behind ``index``, relative to ``root`` (for predictions)."""
        ...

    @property
    def files(self) -> list[str]:
        """Every file an epoch reads from the storage device (for ``page_cache=cold``)."""
        ...

    @property
    def item_shape(self) -> tuple[int, ...] | None:
        """(3, H, W) of one decoded image as the storage hands it out; None when items are
        encoded bytes (loader.decoder=nvjpeg)."""
        ...

    @property
    def image_bytes(self) -> int | None:
        """Bytes one image takes where the run reads it (None: one file per image)."""
        ...

    def reopen(self) -> None:
        """Drop this process's own mappings of ``files`` so their pages can be evicted."""
        ...

    def gather(self, index: torch.Tensor, out: torch.Tensor | None = None, rows: Any = None
               ) -> tuple[dict | None, list[SkippedFile]]:
        """One batch read at once (into ``out`` when given; split over ``rows``, a
        ``RowPool``, when the storage can), and the files it skipped."""
        ...

    def pack(self, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-item results of ``__getitem__`` as the tensors of one batch."""
        ...

    def example(self, n: int) -> torch.Tensor:
        """``n`` real images, uint8 NCHW (to trace, warm up and verify compiled models)."""
        ...

    def probes(self, batch_size: int, device: torch.device | None = None
               ) -> dict[str, Probe]:
        """Each data stage of this storage alone, as a probe the verdict can time (on the
        run's ``device`` where the stage runs there: a rival's own pipeline)."""
        ...


@dataclass(frozen=True)
class StoreFootprint:
    """What a storage holds for a dataset, in bytes (``python -m runner.prepare sizes``)."""

    what: str  # e.g. "raw uint8 at 224x224"
    nbytes: int
    estimated: bool = False  # extrapolated from a sample
    on_disk: bool = True  # a store written to the cache (False: the source files themselves)


@dataclass(frozen=True)
class StorageKind:
    """A storage's registry record: everything a caller would otherwise guess from its name.

    Each storage module ``runner/data/storage/<name>.py`` defines one as ``KIND``; the
    registry (``runner.data.storage.STORAGES``) finds it there by ``loader.name``. Adding a
    storage is its enum value (``runner.config.schema.StorageName``), its preset
    (``conf/loader/<name>.yaml``) and its module with its ``KIND``.

    Attributes:
        name: its ``loader.name``.
        open: ``(loader config, dataset config, path, progress) -> Storage``.
        storage: the class ``open`` returns (``decodes_per_epoch`` is the class's).
        summary: what it is, in one line.
        decoders: the ``loader.decoder`` values it takes (for a store decoded once: the
            decoder of its conversion).
        knobs: config keys, beyond batch size and prefetch, that change how it reads (what
            autotune searches for it).
        own_loader: it brings its own loader (a rival's pipeline): the runner's loaders
            are not used, and the verdict probes that pipeline whole as one stage named
            after the storage.
        autotune: autotune may pick it.
        advice: per stage of the verdict, what this storage itself suggests trying.
        bench: the rows ``python -m runner.bench stores`` measures, name -> overrides.
        build: ``(loader, dataset, path, progress, rebuild) -> Path``: builds (or reuses,
            unless ``rebuild``) the store it converts the folder to and returns its folder
            (``python -m runner.prepare <name>`` calls it); None: it reads the folder as is.
        footprint: ``(dataset config, folder storage) -> StoreFootprint``, or None.
        speed_rank: among stores that fit the page cache, ``prepare sizes`` picks the
            lowest (0 is fastest).
        build_options: ``key=value`` arguments of ``python -m runner.prepare <name>`` that
            are not runner overrides, passed to ``build`` as keywords (``out=``).
        urls: ``open`` takes a URL (``dataset.path=s3://...``, runner/data/sources/) as well
            as a local path.
        reads_path: it reads ``dataset.path`` (an image folder or what is built from one);
            False: the user's own Dataset (``dataset.target``, user.py), which no folder
            store, crop comparison or ``prepare`` applies to.
        boxes: it carries detection targets (``dataset.targets``): each image's boxes
            through its crops, padded in the batch.
        counts_items: its length may come from reading it (an IterableDataset without
            ``__len__``): ``open`` takes ``needed``, the items the run's steps read, as the
            bound of that count.
        masks: it carries masks (``dataset.targets=masks``) through its crops.
    """

    name: StorageName
    open: Callable[..., Storage]
    storage: type
    summary: str
    decoders: frozenset[Decoder]
    knobs: tuple[str, ...] = ()
    own_loader: bool = False
    autotune: bool = True
    advice: dict[str, str] = field(default_factory=dict)
    bench: dict[str, tuple[str, ...]] = field(default_factory=dict)
    build: Callable[[LoaderConfig, DatasetConfig, Path, bool, bool], Path] | None = None
    footprint: Callable[[DatasetConfig, Any], StoreFootprint] | None = None
    speed_rank: int = 10
    build_options: tuple[str, ...] = ()
    urls: bool = False
    reads_path: bool = True
    boxes: bool = False
    counts_items: bool = False
    masks: bool = False

    def carries(self, kind: TargetName) -> bool:
        """Whether it serves batches with a target of ``kind``: the field named by the
        kind's value (``boxes``, ``masks``); a kind with none (a class index) every storage
        carries."""
        return bool(getattr(self, kind.value, True))

    @property
    def decodes_per_epoch(self) -> bool:
        """Every epoch decodes the images (random crops while decoding, decode threads or
        workers competing for a CPU model's cores); False: decoded once (crops on the
        device)."""
        return bool(self.storage.decodes_per_epoch)
