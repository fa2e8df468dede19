"""``loader.*``: a storage wrapped in a DataLoader, and the stream of batches the loop reads.

A batch is a ``TensorDict`` with ``image`` (N, 3, H, W) uint8, ``label`` int64 and ``index``
int64 (position in the storage), so one ``.to(device)`` moves all of it. Files the decoders
could not read travel beside the batch and are counted by ``BatchStream``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset

from runner.buffers import BufferPool
from runner.config import LoaderConfig
from runner.storage.base import Sample, SkippedFile, Storage
from runner.storage.folder import batch_fields

log = logging.getLogger(__name__)


def collate(items: list[Sample | SkippedFile] | tuple[dict | None, list[SkippedFile]],
            pack: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]
            ) -> tuple[dict | None, list[SkippedFile]]:
    """Samples -> ({image, label, index}, skipped files); None when every file was skipped.

    ``pack`` is the storage's: decoded images are stacked, encoded bytes (nvjpeg) packed.
    A storage's batched read (``__getitems__``) is a whole batch already and passes through.
    """
    if isinstance(items, tuple):
        return items
    samples = [s for s in items if isinstance(s, Sample)]
    skipped = [s for s in items if isinstance(s, SkippedFile)]
    if not samples:
        return None, skipped
    return {**pack([s.image for s in samples]), **batch_fields(samples)}, skipped


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


class BatchOrder:
    """The index sets of each epoch's batches: a seeded permutation, reshuffled per epoch.

    Every loading path (per item, batched, in process, with workers) draws its batches from
    this one sampler, so the same seed gives the same batches on every path. Indices within
    a batch are sorted: the batch is the same set of images, read in file order.

    Under torch.distributed every rank draws the same permutation and takes every
    ``world``-th index from ``rank`` on: disjoint shards that cover the epoch once. The
    permutation is first padded to a multiple of ``world`` with repeats marked as padding
    (negative indices, ``-1 - i``), so every rank runs the same number of steps; storages
    turn them into rows with ``valid=False``, which count in no figure, loss or prediction.

    Args:
        size: number of items.
        batch_size: items per batch.
        shuffle: permute each epoch (else file order).
        drop_last: drop a last, short batch.
        seed: seeds the permutations.
        block: shuffle runs of this many consecutive items instead of single items (1: a
            full permutation); larger blocks read a memmap in longer contiguous runs.
        rank: this process's rank (torch.distributed).
        world: the number of ranks.
    """

    def __init__(self, size: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int,
                 block: int = 1, rank: int = 0, world: int = 1):
        self.size, self.batch_size = size, batch_size
        self.shuffle, self.drop_last, self.block = shuffle, drop_last, block
        self.rank, self.world = rank, world
        self.per_rank = -(-size // world)  # padded to the same length on every rank
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        if self.drop_last:
            return self.per_rank // self.batch_size
        return -(-self.per_rank // self.batch_size)

    def epoch_order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        if self.block <= 1:
            return torch.randperm(self.size, generator=self.generator)
        starts = torch.randperm(-(-self.size // self.block), generator=self.generator)
        order = (starts[:, None] * self.block + torch.arange(self.block)).flatten()
        return order[order < self.size]

    def batches(self) -> Iterator[torch.Tensor]:
        order = self.epoch_order()
        if self.world > 1:
            pads = self.per_rank * self.world - self.size
            order = torch.cat([order, -1 - order[:pads]])[self.rank :: self.world]
        full = (len(order) // self.batch_size) * self.batch_size
        rows = order[:full].view(-1, self.batch_size)
        if self.shuffle:  # one sort for the whole epoch, not one call per batch
            rows = _sorted_rows(rows)
        yield from rows
        if not self.drop_last and full < len(order):
            rest = order[full:]
            yield _sorted_rows(rest[None])[0] if self.shuffle else rest

    def __iter__(self) -> Iterator[list[int]]:  # as a DataLoader batch_sampler
        for index in self.batches():
            yield index.tolist()


def _sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row in file order; padding (negative, ``-1 - i``) sorts as the index it repeats."""
    if (rows >= 0).all():
        return rows.sort(dim=1).values
    real = torch.where(rows < 0, -1 - rows, rows)
    return rows.gather(1, real.argsort(dim=1))


def count_images(batch: TensorDict) -> int:
    """Images in a batch that count: padding rows (torch.distributed) do not."""
    if "valid" in batch.keys():
        return int(batch["valid"].sum())  # only a last batch of an epoch has padding
    return batch.batch_size[0]


class InProcessBatches:
    """Batches read in the main process, one ``storage.gather`` each, into reused buffers.

    No worker processes, no inter-process copies, no per-item calls: the fastest path for
    pre-decoded storage when a batch is only a memory copy away.

    Args:
        storage: any storage; ``gather`` fills a buffer of its ``item_shape`` when it has
            one (None: encoded bytes of varying length, no buffers).
        order: the batches' indices.
        pin_memory: gather into page-locked buffers (asynchronous copies to CUDA).
    """

    def __init__(self, storage: Storage, order: BatchOrder, pin_memory: bool):
        self.storage = storage
        self.order = order
        self.pool = None
        if storage.item_shape is not None:
            self.pool = BufferPool((order.batch_size, *storage.item_shape), torch.uint8,
                                   pin=pin_memory)

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[tuple[dict | None, list[SkippedFile]]]:
        for index in self.order.batches():
            out = self.pool.take(len(index)) if self.pool is not None else None
            yield self.storage.gather(index, out=out)


def build_loader(storage: Storage, cfg: LoaderConfig, seed: int, pin_memory: bool,
                 rank: int = 0, world: int = 1):
    """An iterable of (batch dict, skipped files) over one epoch of ``storage``.

    ``loader.batched`` with no workers reads whole batches in process (``storage.gather``
    into reused buffers); otherwise a DataLoader calls ``__getitems__``
    once per batch (batched) or ``__getitem__`` once per image.
    """
    order = BatchOrder(len(storage), cfg.batch_size, cfg.shuffle, cfg.drop_last, seed,
                       cfg.shuffle_block, rank, world)
    if cfg.batched and cfg.num_workers == 0:
        return InProcessBatches(storage, order, pin_memory)
    kwargs = dataloader_kwargs(cfg, pin_memory)
    for key in ("batch_size", "shuffle", "drop_last"):  # the batch order decides these
        kwargs.pop(key)
    if cfg.num_workers > 0:
        # fork: workers map the storage's memory (pre-decoded images included) instead
        # of receiving a pickled copy each
        kwargs["multiprocessing_context"] = "fork"
    dataset = storage if cfg.batched else PerItem(storage)
    generator = torch.Generator().manual_seed(seed + rank)  # worker seeds (random crops)
    return DataLoader(dataset, batch_sampler=order, generator=generator,
                      collate_fn=functools.partial(collate, pack=storage.pack), **kwargs)


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
        elif hasattr(it, "close"):  # a wrapper's generator: its own finally shuts down
            it.close()
    if hasattr(loader, "_iterator"):
        loader._iterator = None


class BatchStream:
    """Batches as TensorDicts over ``epochs`` epochs of ``loader``, skipped files recorded.

    The workers are shut down when the stream ends, is closed early or fails.

    Args:
        loader: yields (batch dict or None, skipped files) per batch.
        epochs: how many passes; the loop may stop earlier (``run.steps``).
        on_epoch: called with the epoch number before each epoch starts (page-cache
            eviction for ``dataset.page_cache=cold``).
        known_skipped: files the storage already knew to be undecodable (a decode-once
            cache's metadata lists them); reported with the ones found while loading.
    """

    def __init__(self, loader: DataLoader, epochs: int,
                 on_epoch: Callable[[int], None] | None = None,
                 known_skipped: list[SkippedFile] = ()):
        self.loader = loader
        self.epochs = epochs
        self.epoch = 0
        self.on_epoch = on_epoch
        self.skips = SkipLog()
        self.skips.add(list(known_skipped))

    def __len__(self) -> int:
        return self.epochs * len(self.loader)

    def __iter__(self) -> Iterator[TensorDict]:
        iterator = None
        try:
            for epoch in range(self.epochs):
                self.epoch = epoch
                if self.on_epoch is not None:
                    self.on_epoch(epoch)
                iterator = iter(self.loader)
                for batch, skipped in iterator:
                    self.skips.add(skipped)
                    if batch is not None:
                        yield TensorDict(batch, batch_size=[len(batch["label"])])
        finally:
            shutdown_workers(self.loader, iterator)
