"""Pre-decoded storage for ``loader=memmap`` and ``loader=ram``: one uint8 tensor of images.

Both loaders serve batches the same way, with one indexed read per batch
(``torch.index_select`` into a reusable buffer); they differ only in where the tensor
lives: a memory-mapped cache file, or RAM.

A detection store (``dataset.targets``) keeps each image's boxes beside it in a ragged side
table (``RaggedBoxes``): the boxes in pixels of the stored image, as the conversion's decode
cut it (runner/data/decode/boxgeometry.py's one mapping and one rule, as loader=folder
maps them at that size). A batch gathers its images' boxes into the padded form
(``boxes``, ``box_labels``, ``box_count``) with one gather and one scatter
(``gather_padded``); the device's crops of the store then move them with the pixels
(runner/data/path.py: ``DataPath.finish``).

A per-pixel target (its kind's ``TargetPlane``, runner/data/targets/target.py: masks) is a
plane: one more dense tensor [N, H, W] beside the images, at the stored size, each slot the
target as the conversion's decode made it with the pixels (masks: NEAREST, 255 where there
is none and in a letterbox's padding). The store knows a plane only by its key and dtype
(``planes``: key -> tensor), never what its values mean: a batch gathers each plane with
the same slots as its images, under its key (``mask``, the key loader=folder's batches
carry it under), and the device's crops and flips then move it with the pixels by its
kind's ``follow`` (masks: runner/data/decode/maskgeometry.py's ``map_masks``). A memmap
store's planes are mapped once: ``dataset.page_cache=cold`` evicts and maps again the
images (``files``, what the bench measures), not the planes (a third of their bytes for a
uint8 mask).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, get_worker_info

from runner.config.schema import DatasetConfig
from runner.data.decode.boxgeometry import gather_padded
from runner.data.order import split_padding, unpad
from runner.data.protocol import (
    Probe,
    Sample,
    SkippedFile,
    cycle_rows,
    shared_empty,
    stack_images,
)
from runner.data.threads import RowPool
from runner.measure import timeline


@dataclass
class RaggedBoxes:
    """A decoded store's detection targets, one flat ragged table beside its images: slot
    ``i``'s boxes (float32 xyxy, pixels of the stored image) and class ids are rows
    ``offsets[i]`` to ``offsets[i] + counts[i]`` of ``boxes`` [C, 4] and ``labels`` [C].
    ``offsets`` [N + 1] give each slot room for its source's boxes (a decode only clips or
    drops boxes, never adds one); ``counts`` [N] are the boxes it kept (0 for a slot whose
    file was skipped)."""

    boxes: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def room(cls, sizes: list[int]) -> RaggedBoxes:
        """An empty table with room for ``sizes[i]`` boxes in slot ``i``."""
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        if sizes:
            torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0, out=offsets[1:])
        total = int(offsets[-1])
        return cls(torch.zeros((total, 4), dtype=torch.float32),
                   torch.zeros(total, dtype=torch.int64), offsets,
                   torch.zeros(len(sizes), dtype=torch.int64))

    def put(self, slot: int, boxes, labels) -> None:
        """Slot ``slot``'s boxes [n, 4] and labels [n] (n at most its room)."""
        start, n = int(self.offsets[slot]), len(labels)
        if start + n > int(self.offsets[slot + 1]):
            raise ValueError(f"slot {slot} has room for {int(self.offsets[slot + 1]) - start} "
                             f"boxes, not {n}")
        self.boxes[start : start + n] = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        self.labels[start : start + n] = torch.as_tensor(labels, dtype=torch.int64)
        self.counts[slot] = n

    def item(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, n = int(self.offsets[slot]), int(self.counts[slot])
        return self.boxes[start : start + n].clone(), self.labels[start : start + n].clone()

    def gather(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The padded targets of ``slots`` (``boxes``, ``box_labels``, ``box_count``)."""
        return gather_padded(self.boxes, self.labels, self.offsets.index_select(0, slots),
                             self.counts.index_select(0, slots))


class DecodedStorage(Dataset):
    """Images (N, 3, H, W) uint8 and labels (N,) int64, minus the slots of skipped files
    (the ``Storage`` protocol, runner/data/protocol.py).

    Args:
        images: the pixel tensor (a MemoryMappedTensor, or a tensor in RAM).
        labels: one class index per slot.
        skipped: the files that could not be decoded when the images were made; their
            slots are left out.
        classes: class names, in ImageFolder order.
        names: the source file name of every slot (for predictions).
        root: the source folder.
        files: the files the images are read from during the run (memmap: the cache file;
            ram: none).
        reopen: maps ``files`` again (drops this process's pages, for a cold page cache).
        keep: the slots this run reads (``dataset.val_fraction``'s side of a store of the
            whole folder), in order; None: every slot. The skipped files of other slots
            are not this run's.
        boxes: a detection store's boxes per slot (``RaggedBoxes``), or None.
        planes: a per-pixel target's planes by key (``mask``: uint8 [N, H, W]), or None.
    """

    decodes_per_epoch = False
    random_crops = False  # center crops decoded once; random ones happen on the device
    # what the model gets (dataset.image_size): a store at dataset.store_size is cropped
    # to it on the device (runner/data/decode/crops.py); None: images are stored at it
    output_size: tuple[int, int] | None = None
    crop_fraction = 1.0  # the share of the stored shorter side a centre crop keeps
    _probe_rows: RowPool | None = None  # the verdict's probe gathers with its own threads
    # a detection set's targets as listed, by index (source sizes and COCO's ids for the
    # detections a run serves; the batches' boxes come from ``boxes``), or None
    targets = None

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *,
                 skipped: list[SkippedFile], classes: list[str], names: list[str],
                 root: Path | None, files: list[str] | None = None,
                 reopen: Callable[[], torch.Tensor] | None = None,
                 keep: list[int] | None = None, boxes: RaggedBoxes | None = None,
                 planes: dict[str, torch.Tensor] | None = None):
        self.images = images
        self.boxes = boxes
        self.planes = dict(planes or {})
        self._files = files or []
        self._reopen = reopen
        self.labels = labels
        mask = torch.ones(len(labels), dtype=torch.bool)
        if keep is not None:
            mask[:] = False
            mask[keep] = True
        self.known_skipped = [s for s in skipped if bool(mask[s.index])]
        mask[[s.index for s in skipped]] = False
        self.slots = torch.nonzero(mask).flatten()
        self.contiguous_slots = bool(mask.all())  # index == slot: no translation needed
        self.classes = classes
        self.names = names
        self.root = root

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def files(self) -> list[str]:
        return self._files

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    @property
    def item_shape(self) -> tuple[int, ...]:
        return self.image_shape

    @property
    def image_bytes(self) -> int:
        return math.prod(self.image_shape) * self.images.element_size()

    def reopen(self) -> None:
        """Map the image file anew: the old mapping's pages can then leave the page cache."""
        if self._reopen is not None:
            self.images = None  # drop the old mapping first
            self.images = self._reopen()

    def name_of(self, index: int) -> str:
        return self.names[int(self.slots[index])]

    def label_tensor(self) -> torch.Tensor:
        """Every image's class index, in storage order."""
        return self.labels.index_select(0, self.slots)

    def __getitem__(self, index: int) -> Sample:
        index, valid = unpad(index)
        slot = int(self.slots[index])
        boxes = self.boxes.item(slot) if self.boxes is not None else (None, None)
        planes = {key: plane[slot].clone() for key, plane in self.planes.items()}
        return Sample(self.images[slot].clone(), int(self.labels[slot]), index, valid, *boxes,
                      **planes)

    def gather(self, index: torch.Tensor, out: torch.Tensor | None = None,
               rows: RowPool | None = None, shared: bool = False
               ) -> tuple[dict, list[SkippedFile]]:
        """One batch with one indexed read of the image tensor (into ``out`` if given),
        split over ``rows``' threads when given (runner/data/threads.py: why not torch's
        intra-op threads), and one of each plane (into shared memory when ``shared``)."""
        index, valid = split_padding(index)
        slots = index if self.contiguous_slots else self.slots.index_select(0, index)
        with timeline.span("gather"):
            if rows is None:
                image = torch.index_select(self.images, 0, slots, out=out)
            else:
                image = out if out is not None else torch.empty(
                    (len(slots), *self.image_shape), dtype=self.images.dtype)
                rows.run(lambda a, b: torch.index_select(self.images, 0, slots[a:b],
                                                         out=image[a:b]), len(slots),
                         nbytes=image.numel() * image.element_size())
        batch = {"image": image, "label": self.labels.index_select(0, slots), "index": index}
        if self.boxes is not None:  # detection: the batch's boxes, padded
            batch.update(self.boxes.gather(slots))
        for key, plane in self.planes.items():  # a per-pixel target: the same slots
            into = shared_empty((len(slots), *plane.shape[1:]), plane.dtype) if shared else None
            batch[key] = torch.index_select(plane, 0, slots, out=into)
        if valid is not None:
            batch["valid"] = valid
        return batch, []

    def __getitems__(self, indices: list[int]) -> tuple[dict, list[SkippedFile]]:
        """The DataLoader's batched path; in a worker the batch is gathered into shared
        memory, so it reaches the main process without another copy."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        out = None
        if get_worker_info() is not None:
            out = shared_empty((len(index), *self.image_shape), self.images.dtype)
        return self.gather(index, out, shared=out is not None)

    @staticmethod
    def pack(images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return stack_images(images)

    def serving(self, dataset: DatasetConfig) -> DecodedStorage:
        """This store for a run of ``dataset``: what the model gets (``image_size``) and the
        share of the stored shorter side its centre crop keeps (``crop_fraction``), for a
        store larger than that (``dataset.store_size``)."""
        self.output_size = tuple(int(v) for v in dataset.image_size)
        self.crop_fraction = float(dataset.crop_fraction)
        return self

    def example(self, n: int) -> torch.Tensor:
        """``n`` images as the model gets them (center crops of a larger store)."""
        images = self.gather(torch.arange(min(n, len(self))))[0]["image"]
        if self.output_size is not None and tuple(self.image_shape[1:]) != self.output_size:
            from runner.data.decode.crops import CenterCrop  # the loader's device stage

            images = CenterCrop(self.output_size, self.crop_fraction)(images)
        return cycle_rows(images.contiguous(), n)

    def probes(self, batch_size: int, device: torch.device | None = None
               ) -> dict[str, Probe]:
        """The batched gather of a random batch into a preallocated buffer, on the threads
        the loader gathers with."""
        out = torch.empty((batch_size, *self.image_shape), dtype=self.images.dtype)
        generator = torch.Generator().manual_seed(0)
        self._probe_rows = self._probe_rows or RowPool()

        def gather() -> int:
            index = torch.randperm(len(self), generator=generator)[:batch_size].sort().values
            return len(self.gather(index, out=out[: len(index)],
                                   rows=self._probe_rows)[0]["image"])

        return {"gather": gather}

    def close(self) -> None:
        """Stop the probe's threads, if the verdict started them."""
        rows, self._probe_rows = self._probe_rows, None
        if rows is not None:
            rows.close()
