"""Pre-decoded storage for ``loader=memmap`` and ``loader=ram``: one uint8 tensor of images.

Both loaders serve batches the same way, with one indexed read per batch
(``torch.index_select`` into a reusable buffer); they differ only in where the tensor
lives: a memory-mapped cache file, or RAM.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset, get_worker_info

from runner.storage.folder import Sample, unpad


def split_padding(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the indices to read, the valid mask or None when nothing is padding); padding is
    ``-1 - i`` (runner.loader.BatchOrder)."""
    valid = index >= 0
    if valid.all():
        return index, None
    return torch.where(valid, index, -1 - index), valid


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in shared memory, so it crosses to another process without a copy."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


class DecodedStorage(Dataset):
    """Images (N, 3, H, W) uint8 and labels (N,) int64, minus the slots of skipped files.

    Args:
        images: the pixel tensor (a MemoryMappedTensor, or a tensor in RAM).
        labels: one class index per slot.
        skipped: slots whose source file could not be decoded (left out).
        classes: class names, in ImageFolder order.
        names: the source file name of every slot (for predictions).
        root: the source folder.
        files: the files the images are read from during the run (memmap: the cache file;
            ram: none).
        reopen: maps ``files`` again (drops this process's pages, for a cold page cache).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, skipped: list[int],
                 classes: list[str], names: list[str], root, files: list[str] | None = None,
                 reopen=None):
        self.images = images
        self.files = files or []
        self._reopen = reopen
        self.labels = labels
        mask = torch.ones(len(labels), dtype=torch.bool)
        mask[list(skipped)] = False
        self.slots = torch.nonzero(mask).flatten()
        self.contiguous_slots = len(skipped) == 0  # index == slot: no translation needed
        self.classes = classes
        self.names = names
        self.root = root

    def __len__(self) -> int:
        return len(self.slots)

    def reopen(self) -> None:
        """Map the image file anew: the old mapping's pages can then leave the page cache."""
        if self._reopen is not None:
            self.images = None  # drop the old mapping first
            self.images = self._reopen()

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def name_of(self, index: int) -> str:
        return self.names[int(self.slots[index])]

    def __getitem__(self, index: int) -> Sample:
        index, valid = unpad(index)
        slot = int(self.slots[index])
        return Sample(self.images[slot].clone(), int(self.labels[slot]), index, valid)

    def gather(self, index: torch.Tensor, out: torch.Tensor | None = None) -> dict:
        """One batch with one indexed read of the image tensor (into ``out`` if given)."""
        index, valid = split_padding(index)
        slots = index if self.contiguous_slots else self.slots.index_select(0, index)
        image = torch.index_select(self.images, 0, slots, out=out)
        batch = {"image": image, "label": self.labels.index_select(0, slots), "index": index}
        if valid is not None:
            batch["valid"] = valid
        return batch

    def __getitems__(self, indices: list[int]) -> dict:
        """The DataLoader's batched path; in a worker the batch is gathered into shared
        memory, so it reaches the main process without another copy."""
        index = torch.as_tensor(indices, dtype=torch.int64)
        out = None
        if get_worker_info() is not None:
            out = shared_empty((len(index), *self.image_shape), self.images.dtype)
        return self.gather(index, out)
