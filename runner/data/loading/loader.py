"""``loader.*``: a storage wrapped in a DataLoader, and the stream of batches the loop reads.

A batch is a ``TensorDict`` with ``image`` (N, 3, H, W) uint8, ``label`` int64 and ``index``
int64 (position in the storage), so one ``.to(device)`` moves all of it. Files the decoders
could not read travel beside the batch and are counted by ``BatchStream``.

A batch none of whose images decodes is still a position of the epoch: with
``BatchStream.keep_empty`` (the run's loop, runner/tasks/loop.py) it comes as an empty batch (no
rows, no ``image``: ``is_empty``), which the loop counts as read without a step, so a run's
steps, its epochs and the outputs' completion count what was read, not only what decoded.
Without it (validation, ``runner.pipeline``) such a batch is left out.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, Dataset

from runner.config.schema import Config, LoaderConfig
from runner.data.loading.buffers import BufferPool, pin_small_fields
from runner.data.order import BatchOrder, unpad
from runner.data.protocol import Sample, SkippedFile, Storage
from runner.data.storage.folder import UNREADABLE
from runner.data.targets import batch_fields
from runner.data.threads import RowPool, cores, one_core_pool
from runner.measure import timeline

log = logging.getLogger(__name__)


def collate(items: list[Sample | SkippedFile] | tuple[dict | None, list[SkippedFile]],
            pack: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]
            ) -> tuple[dict | None, list[SkippedFile]]:
    """Samples -> ({image, label, index}, skipped files); None when every file was skipped.

    ``pack`` is the storage's: decoded images are stacked, encoded bytes (nvjpeg) packed.
    A storage's batched read (``__getitems__``) is a whole batch already and passes through.
    """
    if isinstance(items, tuple):
        timeline.flush()  # in a worker: its spans so far, to its file
        return items
    with timeline.span("collate"):
        samples = [s for s in items if isinstance(s, Sample)]
        skipped = [s for s in items if isinstance(s, SkippedFile)]
        batch = {**pack([s.image for s in samples]), **batch_fields(samples)} if samples else None
    timeline.flush()
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


class ThreadedBatches:
    """A per-epoch-decoding storage (``loader=folder``) decoded in this process by a pool of
    threads, each image written straight into a reused batch buffer.

    The design that makes memmap/ram fast, for decoding: no worker processes, no pickling,
    no shared-memory batches, no wake-up per batch; one ``BatchOrder``. The decoders release
    the GIL while they decode and resize (``python -m runner.bench gil`` measures it), so
    the threads use every core. ``ahead`` batches are decoded ahead of the one the loop
    holds, so decoding overlaps the model's step. Each thread runs torch ops on one core
    (OpenMP teams per thread would fight for the cores).

    Args:
        storage: a storage with ``__getitem__`` giving Samples of ``item_shape`` images.
        order: the batches' indices.
        pin_memory: decode into page-locked buffers (asynchronous copies to CUDA).
        threads: decode threads.
        ahead: batches in flight besides the one handed out.
    """

    def __init__(self, storage: Storage, order: BatchOrder, *, pin_memory: bool, threads: int,
                 ahead: int = 2):
        self.storage, self.order, self.threads, self.ahead = storage, order, threads, ahead
        self.pool = BufferPool((order.largest_batch, *storage.item_shape), torch.uint8,
                               pin=pin_memory, capacity=ahead + 6,
                               channels_last=getattr(storage, "channels_last", False))

    def __len__(self) -> int:
        return len(self.order)

    def _submit(self, executor: ThreadPoolExecutor, index: torch.Tensor) -> tuple:
        self.storage.will_need(index)  # a cold page cache: reading starts before decoding
        indices = index.tolist()
        if self.order.crop_seeds:
            indices = list(zip(indices, self.order.seeds_for(index)))
        with torch.inference_mode(False):  # the decode threads write into it outside any
            out = self.pool.take(len(indices))  # inference_mode the caller may be in
            out = batch_view(out, self.storage, index)
        # a few slices per thread: balanced when one image is slow, few tasks per batch
        step = max(1, -(-len(indices) // (2 * self.threads)))
        futures = [executor.submit(self.storage.decode_slice, out,
                                   range(a, min(a + step, len(indices))), indices)
                   for a in range(0, len(indices), step)]
        return out, futures

    @staticmethod
    def _assemble(out: torch.Tensor, items: list[Sample | SkippedFile]
                  ) -> tuple[dict | None, list[SkippedFile]]:
        with timeline.span("collate"):
            good = [k for k, s in enumerate(items) if isinstance(s, Sample)]
            skipped = [s for s in items if isinstance(s, SkippedFile)]
            if not good:
                return None, skipped
            image = out
            if len(good) < len(items):  # compacted in place: the buffer stays (pinned) memory
                image = out[: len(good)]
                image.copy_(out[torch.tensor(good)])
            samples = [items[k] for k in good]
            return {"image": image, **batch_fields(samples)}, skipped

    def __iter__(self) -> Iterator[tuple[dict | None, list[SkippedFile]]]:
        pending: collections.deque = collections.deque()
        batches = self.order.batches()
        with one_core_pool(self.threads, "runner-decode") as executor:
            try:
                for index in itertools.islice(batches, self.ahead + 1):
                    pending.append(self._submit(executor, index))
                while pending:
                    out, futures = pending.popleft()
                    items = [item for f in futures for item in f.result()]
                    index = next(batches, None)
                    if index is not None:  # keep the pool busy while the loop uses this one
                        pending.append(self._submit(executor, index))
                    batch, skipped = self._assemble(out, items)
                    if batch is not None and self.pool.pin:
                        batch = pin_small_fields(batch)
                    yield batch, skipped
            finally:
                for _, futures in pending:
                    for f in futures:
                        f.cancel()


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
        self.pin = pin_memory
        self.rows = RowPool()  # the gathers' threads (not torch's intra-op ones: threads.py)
        self.pool = None
        if storage.item_shape is not None:
            self.pool = BufferPool((order.largest_batch, *storage.item_shape), torch.uint8,
                                   pin=pin_memory)

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[tuple[dict | None, list[SkippedFile]]]:
        for index in self.order.batches():
            out = self.pool.take(len(index)) if self.pool is not None else None
            if out is not None:
                out = batch_view(out, self.storage, index)
            batch, skipped = self.storage.gather(index, out=out, rows=self.rows)
            if batch is not None and self.pin and out is not None:
                batch = pin_small_fields(batch)
            yield batch, skipped

    def close(self) -> None:
        self.rows.close()


def batch_view(out: torch.Tensor, storage: Storage, index: torch.Tensor) -> torch.Tensor:
    """A batch buffer (rows of ``item_shape``) as the rows of the batch ``index`` decodes
    to: the same memory at its aspect bin's shape under ``loader.group_aspect`` (never
    larger than ``item_shape``, the largest: ``bin_shapes``), else as it is."""
    shapes = getattr(storage, "item_shapes", None)
    if shapes is None or not len(index):
        return out
    h, w = shapes[unpad(int(index[0]))[0]].tolist()
    n, c = out.shape[:2]
    if not out.is_contiguous() and out.is_contiguous(memory_format=torch.channels_last):
        rows = out.permute(0, 2, 3, 1).reshape(-1)[: n * h * w * c]
        return rows.view(n, h, w, c).permute(0, 3, 1, 2)
    return out.view(-1)[: n * c * h * w].view(n, c, h, w)


def decode_threads(cfg: LoaderConfig, storage: Storage) -> int:
    """Decode threads for the in-process threaded path; 0 when it does not apply (workers,
    a storage decoded once, or encoded bytes for the GPU to decode)."""
    if cfg.num_workers > 0 or not storage.decodes_per_epoch or storage.item_shape is None:
        return 0
    return cores() if cfg.decode_threads is None else cfg.decode_threads


def batch_order(storage: Storage, cfg: LoaderConfig, seed: int, rank: int = 0,
                world: int = 1, nodes: int = 1) -> BatchOrder:
    """The batch order of ``storage`` for this loader config and rank (its slot:
    ``Ranks.slot``); a sharded storage (``order_groups``: its shards' bounds) is read a
    block of shards at a time, in ``loader.lanes`` lanes (unset: one per node of the
    ``nodes``), and told the order so it can fetch ahead (``follow``)."""
    groups = getattr(storage, "order_groups", None)
    lanes = cfg.lanes or nodes
    if groups is not None and lanes > 1:
        check_lanes(lanes, nodes, cfg.batch_size * world)
    order = BatchOrder(len(storage), cfg.batch_size, shuffle=cfg.shuffle,
                       drop_last=cfg.drop_last, seed=seed, block=cfg.shuffle_block, rank=rank,
                       world=world, crop_seeds=storage.random_crops, groups=groups,
                       group_block=getattr(storage, "group_block", 1), lanes=lanes,
                       members=getattr(storage, "order_members", None),
                       bins=aspect_groups(storage, cfg) if cfg.group_aspect else None)
    if groups is not None:
        storage.follow(order)
    return order


def aspect_groups(storage: Storage, cfg: LoaderConfig) -> torch.Tensor:
    """Each item's aspect-ratio bin (runner/data/order.py: ``aspect_bins``) from the
    source sizes its detection labels carry (a YOLO image without boxes, whose labels gave
    no size, goes with the square ones), the storage told to decode each bin at its shape
    (``bin_shapes``, ``set_item_shapes``); or a ConfigError saying why this storage cannot
    group: no labels with sizes, a sharded order (read a block of shards at a time), or a
    storage that decodes at one size alone (memmap and ram are refused earlier, when the
    config is settled: runner/data/storage/__init__.py)."""
    from runner.common.errors import ConfigError
    from runner.data.order import bin_shapes

    bins, sizes = storage_aspect_bins(storage, cfg)
    if not callable(getattr(storage, "set_item_shapes", None)):
        from runner.config.schema import StorageName

        can = f"loader={StorageName.folder.value} or {StorageName.packed.value}"
        raise ConfigError(f"loader.group_aspect=true with loader={cfg.name.value}: it "
                          f"cannot decode each aspect bin's batches at the bin's shape; use "
                          f"{can}")
    size = storage.item_shape[1:]
    storage.set_item_shapes(bin_shapes(sizes, bins, size))
    return bins


def storage_aspect_bins(storage: Storage, cfg: LoaderConfig
                        ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Each item's aspect-ratio bin (runner/data/order.py: ``aspect_bins``) and its source
    size, from its detection labels, or a ConfigError saying why there are none (see
    ``aspect_groups``)."""
    from runner.common.errors import ConfigError
    from runner.data.order import aspect_bins

    if getattr(storage, "order_groups", None) is not None:
        raise ConfigError(f"loader.group_aspect=true with loader={cfg.name.value}: a sharded "
                          "storage reads its shards a block at a time and cannot group "
                          "images by aspect: use a loader= that reads single images")
    targets = getattr(storage, "targets", None)
    if targets is None or not hasattr(targets, "source_size"):
        raise ConfigError("loader.group_aspect=true groups images by their sizes, which "
                          "the detection labels carry (dataset.targets=auto, yolo or coco): "
                          "give those, or leave loader.group_aspect=false")
    sizes = [targets.source_size(i) for i in range(len(storage))]
    return aspect_bins(sizes), sizes


def drops_remainder(config: Config, world: int, every_image: bool = False,
                    images: int | None = None) -> bool:
    """Whether an epoch drops the images after its last whole global batch: with
    ``loader.drop_last``, and when training on several ranks, where a padded last batch
    would weigh its ranks' images unlike their peers' in the all-reduced gradient and
    change with the world size. Unset, training on one process drops them too (a batch of
    one fails BatchNorm: torchvision's and timm's train scripts drop it), unless the epoch's
    ``images`` hold no whole batch. ``every_image`` (validation, like inference): never;
    the last batches are padded and masked instead, so every image counts once."""
    if every_image:
        return False
    trains, asked = config.task.name.trains, config.loader.drop_last
    if asked is None:
        return trains and (world > 1 or images is None or images >= config.loader.batch_size)
    return asked or (trains and world > 1)


def check_lanes(lanes: int, nodes: int, global_batch: int) -> None:
    """Lanes of a sharded storage that ``nodes`` nodes share evenly and that split a
    global batch evenly, or a ``ConfigError`` naming the counts that would."""
    from runner.common.errors import ConfigError

    if lanes % nodes == 0 and global_batch % lanes == 0:
        return
    fits = [n for n in range(nodes, global_batch + 1, nodes) if global_batch % n == 0]
    raise ConfigError(f"loader.lanes={lanes} on {nodes} node(s) with a global batch of "
                      f"{global_batch}: each node reads whole lanes and each step takes the "
                      f"same share of every lane; use loader.lanes="
                      f"{' or '.join(map(str, fits[:6])) or nodes}")


def build_loader(storage: Storage, cfg: LoaderConfig, order: BatchOrder, pin_memory: bool):
    """An iterable of (batch dict, skipped files) over one epoch of ``storage``.

    With no workers, a storage decoded every epoch is decoded by ``loader.decode_threads``
    threads in process, into reused buffers (``ThreadedBatches``); ``loader.batched`` reads
    whole batches of a decoded storage in process (``storage.gather`` into reused buffers);
    otherwise a DataLoader calls ``__getitems__`` once per batch (batched) or
    ``__getitem__`` once per image.
    """
    threads = decode_threads(cfg, storage)
    if threads:
        return ThreadedBatches(storage, order, pin_memory=pin_memory, threads=threads)
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
    # worker seeds (crops draw from per-image seeds; this only fixes the workers' own)
    generator = torch.Generator().manual_seed(order.seed + order.rank)
    return DataLoader(dataset, batch_sampler=order, generator=generator,
                      collate_fn=functools.partial(collate, pack=storage.pack), **kwargs)


@dataclass
class SkipLog:
    """Every file skipped as undecodable (or unreadable), each named once in a warning, and
    the label files with bad labels left out (counted; the labels' reader said them)."""

    files: dict[str, str] = field(default_factory=dict)  # path -> error

    def add(self, skipped: list[SkippedFile]) -> None:
        for s in skipped:
            if s.path not in self.files:
                self.files[s.path] = s.error
                if s.label:
                    continue
                kind = UNREADABLE if s.error.startswith(UNREADABLE) else "undecodable"
                log.warning("skipped %s file %s: %s", kind, s.path, s.error)


def as_tensordict(batch: dict[str, torch.Tensor], n: int) -> TensorDict:
    """A batch's fields as a TensorDict of batch size ``n``. The fields come from a storage
    and its loader, one row per image by construction, so TensorDict's checks of every
    field's leading size are skipped where this tensordict has the call that skips them
    (``_new_unsafe``: 2 us a batch against 9 us, measured here; the loop's per-batch
    overhead is ~60 us on small items, bench overhead)."""
    if _NEW_UNSAFE is not None:
        return _NEW_UNSAFE(batch, batch_size=torch.Size([n]))
    return TensorDict(batch, batch_size=[n])


_NEW_UNSAFE = getattr(TensorDict, "_new_unsafe", None)


def empty_batch() -> TensorDict:
    """A position of the epoch whose images all failed to decode: no rows, no image."""
    none = torch.empty(0, dtype=torch.int64)
    return as_tensordict({"index": none, "label": none.clone()}, 0)


def is_empty(batch: TensorDict) -> bool:
    """Whether ``batch`` is ``empty_batch``'s (a position read, nothing to step on)."""
    return batch.batch_size[0] == 0 and "image" not in batch.keys()


def shutdown_workers(loader: DataLoader, iterator=None) -> None:
    """Stop a DataLoader's worker processes now, not whenever garbage collection runs.

    A persistent iterator lives on the DataLoader (a stage above it, as GPU decoding is,
    holds it as ``loader``); an iterator left behind by an exception lives on in its
    traceback. Either keeps its workers running (and competing for CPU with
    the next job of a sweep) until collected, and collection then blocks for seconds.
    """
    for it in (iterator, getattr(loader, "_iterator", None)):
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        elif hasattr(it, "close"):  # a wrapper's generator: its own finally shuts down
            it.close()
    if hasattr(loader, "_iterator"):
        loader._iterator = None
    inner = getattr(loader, "loader", None)  # a stage above a loader (GPU decoding): its own
    if isinstance(inner, DataLoader):
        shutdown_workers(inner)


class BatchStream:
    """Batches as TensorDicts over ``epochs`` epochs of ``loader``, skipped files recorded.

    Each iteration goes on from the epoch where the last one stopped (the first is
    ``start_epoch``), so iterating again, one epoch at a time, reshuffles as a longer run
    does. ``epochs`` is read at every epoch's end: raising it while the stream runs extends
    the run. The workers are shut down when the stream ends, is closed early or fails.

    Args:
        loader: yields (batch dict or None, skipped files) per batch.
        epochs: how many passes an iteration makes; the loop may stop earlier.
        order: the loader's batch order, told each epoch's number (None: it counts itself).
        start_epoch: the first epoch's number (a resumed run's epochs done).
        start_batch: batches of that epoch already done: it continues with the next one.
        per_batch: ``(epoch, batch number, index) -> tensors`` added to each batch (the
            random draws of device-side crops, from its images' crop seeds).
        on_epoch: called with the epoch number before each epoch starts (page-cache
            eviction for ``dataset.page_cache=cold``).
        known_skipped: files the storage already knew to be undecodable (a decode-once
            cache's metadata lists them); reported with the ones found while loading.

    ``keep_empty``: a batch with no decodable image comes as ``empty_batch()`` (the loop
    counts its position), else it is left out.
    """

    def __init__(self, loader, epochs: int, *, order: BatchOrder | None = None,
                 start_epoch: int = 0, on_epoch: Callable[[int], None] | None = None,
                 known_skipped: list[SkippedFile] = (), start_batch: int = 0,
                 per_batch: Callable[[int, int, torch.Tensor], dict] | None = None):
        self.loader = loader
        self.epochs = epochs
        self.order = order
        self.epoch = start_epoch  # the epoch being read (or read next)
        self.skip = start_batch  # batches of the first epoch already done (a resume)
        self.per_batch = per_batch
        self.on_epoch = on_epoch
        self.skips = SkipLog()
        self.skips.add(list(known_skipped))
        self.keep_empty = False

    def __len__(self) -> int:
        return self.epochs * len(self.loader)

    def __iter__(self) -> Iterator[TensorDict]:
        iterator = None
        done = 0
        try:
            while done < self.epochs:
                skip, self.skip = self.skip, 0
                if self.order is not None:
                    self.order.set_epoch(self.epoch, skip)
                    self.order.last_epoch = self.epoch + self.epochs - done - 1
                if self.on_epoch is not None:
                    self.on_epoch(self.epoch)
                iterator = iter(self.loader)
                for position, (batch, skipped) in enumerate(iterator, start=skip):
                    if skipped:
                        self.skips.add(skipped)
                    if batch is not None:
                        n = batch["label"].shape[0]
                        if self.per_batch is not None:  # e.g. the random draws of its crops
                            batch = {**batch, **self.per_batch(self.epoch, position,
                                                               batch["index"])}
                        yield as_tensordict(batch, n)
                    elif self.keep_empty:  # a position read, every image of it skipped
                        yield empty_batch()
                done += 1
                self.epoch += 1
        finally:
            shutdown_workers(self.loader, iterator)
