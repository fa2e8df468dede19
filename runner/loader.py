"""``loader.*``: a storage wrapped in a DataLoader, and the stream of batches the loop reads.

A batch is a ``TensorDict`` with ``image`` (N, 3, H, W) uint8, ``label`` int64 and ``index``
int64 (position in the storage), so one ``.to(device)`` moves all of it. Files the decoders
could not read travel beside the batch and are counted by ``BatchStream``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset, get_worker_info

from runner.config import LoaderConfig
from runner.storage.folder import Sample, SkippedFile

log = logging.getLogger(__name__)


def _stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack into shared memory when in a worker, so the batch crosses to the main
    process without another copy (what default_collate does)."""
    out = None
    if get_worker_info() is not None:
        first = images[0]
        storage = first._typed_storage()._new_shared(len(images) * first.numel(), device=first.device)
        out = first.new(storage).resize_(len(images), *first.shape)
    return torch.stack(images, 0, out=out)


def collate(items: list[Sample | SkippedFile]) -> tuple[dict | None, list[SkippedFile]]:
    """Samples -> ({image, label, index}, skipped files); None when every file was skipped."""
    samples = [s for s in items if isinstance(s, Sample)]
    skipped = [s for s in items if isinstance(s, SkippedFile)]
    if not samples:
        return None, skipped
    batch = {
        "image": _stack_images([s.image for s in samples]),
        "label": torch.tensor([s.label for s in samples], dtype=torch.int64),
        "index": torch.tensor([s.index for s in samples], dtype=torch.int64),
    }
    return batch, skipped


class PerItem(Dataset):
    """Hides a storage's ``__getitems__`` so the DataLoader calls ``__getitem__`` per image."""

    def __init__(self, storage: Dataset):
        self.storage = storage

    def __len__(self) -> int:
        return len(self.storage)

    def __getitem__(self, index: int):
        return self.storage[index]


def dataloader_kwargs(cfg: LoaderConfig, pin_memory: bool) -> dict:
    """The DataLoader options this config asks for, minus those that need workers when it
    has none (torch rejects prefetch_factor and persistent_workers without workers)."""
    kwargs = dict(
        batch_size=cfg.batch_size,
        shuffle=cfg.shuffle,
        drop_last=cfg.drop_last,
        num_workers=cfg.num_workers,
        pin_memory=pin_memory,
    )
    if cfg.num_workers > 0:
        kwargs.update(prefetch_factor=cfg.prefetch_factor, persistent_workers=cfg.persistent_workers)
    return kwargs


def build_loader(storage: Dataset, cfg: LoaderConfig, seed: int, pin_memory: bool) -> DataLoader:
    """A DataLoader over ``storage``; ``loader.batched`` picks one call per batch or per image."""
    dataset = storage if cfg.batched else PerItem(storage)
    generator = torch.Generator().manual_seed(seed)  # the shuffle order and worker seeds
    return DataLoader(dataset, collate_fn=collate, generator=generator,
                      **dataloader_kwargs(cfg, pin_memory))


@dataclass
class SkipLog:
    """Every file skipped as undecodable, each named once in a warning."""

    files: dict[str, str] = field(default_factory=dict)  # path -> error

    def add(self, skipped: list[SkippedFile]) -> None:
        for s in skipped:
            if s.path not in self.files:
                self.files[s.path] = s.error
                log.warning("skipped undecodable file %s: %s", s.path, s.error)


def shutdown_workers(loader: DataLoader, iterator=None) -> None:
    """Stop a DataLoader's worker processes now, not whenever garbage collection runs.

    A persistent iterator lives on the DataLoader; an iterator left behind by an exception
    lives on in its traceback. Either keeps its workers running (and competing for CPU with
    the next job of a sweep) until collected, and collection then blocks for seconds.
    """
    for it in (iterator, getattr(loader, "_iterator", None)):
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
    if hasattr(loader, "_iterator"):
        loader._iterator = None


class BatchStream:
    """Batches as TensorDicts over ``epochs`` epochs of ``loader``, skipped files recorded.

    The workers are shut down when the stream ends, is closed early or fails.

    Args:
        loader: yields (batch dict or None, skipped files) per batch.
        epochs: how many passes; the loop may stop earlier (``run.steps``).
    """

    def __init__(self, loader: DataLoader, epochs: int):
        self.loader = loader
        self.epochs = epochs
        self.epoch = 0
        self.skips = SkipLog()

    def __len__(self) -> int:
        return self.epochs * len(self.loader)

    def __iter__(self) -> Iterator[TensorDict]:
        iterator = None
        try:
            for epoch in range(self.epochs):
                self.epoch = epoch
                iterator = iter(self.loader)
                for batch, skipped in iterator:
                    self.skips.add(skipped)
                    if batch is not None:
                        yield TensorDict(batch, batch_size=[len(batch["label"])])
        finally:
            shutdown_workers(self.loader, iterator)
