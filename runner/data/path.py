"""The data path's one constructor: ``build_data_path(config, device, ...) -> DataPath``.

storage (``loader=``) -> batch order -> loader (decode threads, in-process gathers or
DataLoader workers; nvjpeg decoding above it) -> stream (epochs, skipped files, a cold page
cache) -> prefetcher (``prefetch=``) -> the device (the copy, then random crops of
pre-decoded images, a batch's target moved with them: ``crop_targets``, by its kind's record).
``python -m runner``, ``runner.pipeline(...)``, the loader benchmark, validation and the
selfcheck all build their data path here, so a new storage or stage is added in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from tensordict import TensorDict

from runner.common.errors import ConfigError
from runner.common.text import human_bytes
from runner.config.schema import Config, Crop, LoaderConfig, PageCache, RunConfig
from runner.data.decode.boxgeometry import center_windows
from runner.data.decode.crops import BatchAugment, CenterCrop
from runner.data.decode.decoders import CROP_UNIFORMS, DECODERS
from runner.data.device.normalize import (
    HOST_DTYPES,
    Converted,
    HostConvert,
    check_host_dtype,
    host_convert,
)
from runner.data.device.nvjpeg import GpuDecodedBatches
from runner.data.device.prefetch import build_prefetcher
from runner.data.loading.loader import (
    BatchStream,
    batch_order,
    build_loader,
    drops_remainder,
    shutdown_workers,
)
from runner.data.order import BatchOrder, count_images
from runner.data.protocol import Storage, StorageKind
from runner.data.sources.pagecache import ColdPageCache
from runner.data.storage import STORAGES, build_storage, resolve_dataset
from runner.data.storage.ram import memory_available
from runner.data.targets import carried
from runner.data.threads import RowPool
from runner.launch.distributed import Ranks, barrier
from runner.measure import storage_tier

log = logging.getLogger(__name__)


def pin_memory(cfg: LoaderConfig, device: torch.device) -> bool:
    """Page-locked batches: on by default with CUDA (asynchronous copies), never without."""
    if device.type != "cuda":
        return False
    return True if cfg.pin_memory is None else bool(cfg.pin_memory)


def planned_epochs(run: RunConfig, steps_per_epoch: int) -> int:
    """Epochs a run of ``run.steps`` (else ``run.epochs``) reads."""
    if run.steps is not None:
        return math.ceil(run.steps / steps_per_epoch)
    return run.epochs


def check_batch_memory(cfg: LoaderConfig, order: BatchOrder, storage: Storage) -> None:
    """Refuse, in one line, a batch whose buffers would not fit in memory (a batch size
    with a few zeros too many), before any is allocated."""
    if storage.item_shape is None:
        return  # encoded bytes: sized by the files
    dtype = HOST_DTYPES[cfg.host_dtype] or torch.uint8  # a float batch, converted on the host
    nbytes = order.largest_batch * math.prod(storage.item_shape) * dtype.itemsize
    available = memory_available()
    if 4 * nbytes > available:  # a few buffers are in flight at once (buffers.py)
        raise ConfigError(
            f"loader.batch_size={cfg.batch_size} needs {human_bytes(nbytes)} per batch of "
            f"{order.largest_batch:,} images of {'x'.join(map(str, storage.item_shape))} "
            f"{str(dtype).replace('torch.', '')}, and a few batches are in flight; "
            f"{human_bytes(available)} of memory is available: use a smaller "
            "loader.batch_size" + ("" if dtype is torch.uint8 else
                                   " or loader.host_dtype=uint8"))


def open_storage(config: Config, ranks: Ranks, progress: bool) -> Storage:
    """The storage; under torch.distributed each node's local rank 0 makes the default
    dataset and the decode-once cache while the other ranks wait, then they open them."""
    if not ranks.local_main:
        barrier(ranks)
    path = None  # the user's own Dataset (dataset.target) reads no dataset.path
    if STORAGES[config.loader.name].reads_path:
        path = resolve_dataset(config.dataset, progress=progress and ranks.local_main)
    needed = None  # the items run.steps reads: the bound of a count by reading
    if config.run.steps is not None:
        needed = config.run.steps * config.loader.batch_size * ranks.world
    storage = build_storage(config.loader, config.dataset, path, progress and ranks.local_main,
                            needed)
    if ranks.local_main:
        barrier(ranks)
    return storage


class DataPath:
    """Batches of one dataset, from storage to the device, over a run's epochs.

    Iterating gives the batches as the loop takes them (in host memory, or already on the
    device with ``prefetch=gpu``); ``to_device`` moves one (a no-op for those already
    there) and ``finish`` applies ``augment`` (random crops of pre-decoded images, on the
    device); ``device_batches`` does all three. ``figures`` reports what the data path measured about
    itself; ``close`` stops its workers.

    Attributes:
        storage: where batches come from (``loader=``).
        kind: the storage's registry record.
        device: where they arrive.
        pin_memory: whether host batches are page-locked.
        steps_per_epoch: batches per epoch on this rank.
        augment: the device-side crop of images decoded once (random-resized crops +
            flips, or the centre of a larger store), or None.
        page_cache: the cold page cache's evictions (``dataset.page_cache=cold``), or None.
    """

    def __init__(self, storage: Storage, *, kind: StorageKind, stream: BatchStream, batches,
                 device: torch.device, pin: bool, augment: BatchAugment | None,
                 page_cache: ColdPageCache | None, convert: HostConvert | None = None):
        self.storage, self.kind = storage, kind
        self.stream = stream
        self.batches = batches
        self.device = device
        self.pin_memory = pin
        self.augment = augment
        self.page_cache = page_cache
        self.convert = convert  # loader.host_dtype: float batches made on the host
        self.steps_per_epoch = len(stream.loader)
        self.train_augment = None  # task.augment (runner/data/device/augment.py), training only
        # crops on a CPU device: image by image on the runner's threads (threads.py)
        self.rows = RowPool() if device.type == "cpu" and augment is not None else None

    @property
    def classes(self) -> list[str]:
        return self.storage.classes

    @property
    def finishes_on_device(self) -> bool:
        """Whether ``finish`` has work on the device: a crop, ``task.augment`` (its device
        half) or both."""
        return self.augment is not None or (self.train_augment is not None
                                            and self.train_augment.on_device)

    def __len__(self) -> int:  # batches one iteration reads
        return self.stream.epochs * self.steps_per_epoch

    def __iter__(self) -> Iterator[TensorDict]:
        return iter(self.batches)

    def count(self, batch: TensorDict) -> int:
        """Images that count in ``batch`` (padding does not), without a device sync."""
        count = getattr(self.batches, "count", None)  # batches already on the device
        return count(batch) if count is not None else count_images(batch)

    def to_device(self, batch: TensorDict) -> TensorDict:
        return batch.to(self.device, non_blocking=True)

    def finish(self, batch: TensorDict) -> TensorDict:
        """The device-side stage: random crops of pre-decoded images (when asked), drawn
        from the draws the batch carries (``crop_draws``); the batch's target (boxes,
        masks: its kind's ``follow``) through the same windows and flips
        (``crop_targets``)."""
        if self.augment is not None:
            draws = {k: batch[k] for k in CROP_DRAWS if k in batch.keys()} or None
            kind = carried(batch.keys())
            if kind is not None and kind.follow is not None:
                draws = crop_targets(self.augment, batch, draws, kind.follow)
            batch["image"] = self.augment(batch["image"], draws, rows=self.rows)
        if self.train_augment is not None and self.train_augment.on_device:  # after the crop
            self.train_augment(batch)
        return batch

    def device_batches(self) -> Iterator[TensorDict]:
        """Every batch of one iteration on the device, ready for the model."""
        for batch in self:
            yield self.finish(self.to_device(batch))

    def extend(self, steps: int) -> None:
        """Read at least ``steps`` batches per iteration (more epochs), while running."""
        self.stream.epochs = max(self.stream.epochs, math.ceil(steps / self.steps_per_epoch))

    def exclude_from_timing(self, paused: Callable[[], AbstractContextManager]) -> None:
        """Work that is the measurement's (evicting the page cache) runs under ``paused``."""
        if self.page_cache is not None:
            self.page_cache.pause = paused

    @property
    def skipped(self) -> list[str]:
        """Undecodable files met so far (and those a decode-once cache lists)."""
        return list(self.stream.skips.files)

    def figures(self, steps: int) -> dict[str, Any]:
        """What the data path measured about itself over ``steps`` steps."""
        page_cache = {"page_cache": "warm"} if self.page_cache is None \
            else self.page_cache.figures()
        out = {"pin_memory": self.pin_memory, **self.batches.figures(steps), **page_cache}
        if self.convert is not None:
            out.update(self.convert.figures(steps))
        fallbacks = getattr(self.stream.loader, "cpu_fallbacks", None)  # a GPU decoder's
        if fallbacks is not None:
            out["gpu_decode_cpu_fallbacks"] = fallbacks
        remote = getattr(self.storage, "figures", None)  # data read from a URL: its fetches
        if callable(remote):
            out.update(remote())
        # what its bytes are read from (a store built in the cache lives where the cache does)
        files = self.storage.files
        out["storage_tier"] = storage_tier.tier(str(files[0] if files else self.storage.root))
        return out

    def close(self) -> None:
        """Stop the loader's workers or threads (a rival's pipeline too) and whatever the
        storage started (a verdict's probe pipeline)."""
        shutdown_workers(self.stream.loader)
        for part in (self.stream.loader, self.storage, self.rows):
            close = getattr(part, "close", None)
            if callable(close):
                close()


CROP_DRAWS = ("crop_uniforms",)


def crop_targets(augment: BatchAugment | CenterCrop, batch: TensorDict, draws: dict | None,
                 follow: Callable) -> dict | None:
    """Move a batch's target through the windows and flips ``augment`` cuts its images
    by (``BatchAugment``'s random-resized crops from ``draws``, ``CenterCrop``'s centre
    window), on the batch's device with no host sync: ``follow`` is its kind's
    (runner/data/targets/: boxes by boxgeometry's ``map_padded``, one rule for boxes that
    leave the crop; masks nearest); returns the draws the images must be cut with (drawn
    here when the batch carries none, so pixels and target share them)."""
    image = batch["image"]
    n, hw, device = image.shape[0], tuple(image.shape[-2:]), image.device
    if isinstance(augment, BatchAugment):
        if draws is None:
            draws = {"crop_uniforms": torch.rand(n, CROP_UNIFORMS, dtype=torch.float64,
                                                 device=device)}
        windows = augment.boxes(n, *hw, device, draws=draws)
    else:
        windows = center_windows(n, hw, augment.size, augment.fraction, device)
    follow(batch, windows, tuple(augment.size))
    return draws



def crop_draws(augment: BatchAugment, order: BatchOrder, pin: bool
               ) -> Callable[[int, int, torch.Tensor], dict]:
    """Each batch's crop draws from its images' crop seeds (the batch order's: a function of
    the run's seed, the epoch and the image), as a folder or packed decode draws them: the
    same crops on every run, after a resume, and on every storage."""
    def draws(epoch: int, position: int, index: torch.Tensor) -> dict[str, torch.Tensor]:
        out = augment.draws(order.seeds_for(index, epoch))
        return {k: v.pin_memory() for k, v in out.items()} if pin else out

    return draws


def device_crop(storage: Storage, config: Config, order: BatchOrder, pin: bool
                ) -> tuple[BatchAugment | CenterCrop | None, Callable | None]:
    """The device-side crop of images decoded once (and the per-batch draws it needs):
    random-resized crops of the whole stored image (``dataset.crop=random``), or the centre
    window of a store larger than the output (``dataset.store_size``); None when images
    are decoded per epoch (cropped while decoding) or stored at the output size."""
    if storage.decodes_per_epoch:
        return None, None
    size = tuple(int(v) for v in config.dataset.image_size)
    if config.dataset.crop is Crop.random:
        augment = BatchAugment(size)
        return augment, crop_draws(augment, order, pin)
    if storage.item_shape is not None and tuple(storage.item_shape[1:]) != size:
        return CenterCrop(size, config.dataset.crop_fraction), None
    return None, None


def build_data_path(config: Config, device: torch.device, ranks: Ranks | None = None,
                    start_step: int = 0, epochs: int | None = None, progress: bool = True,
                    every_image: bool = False) -> DataPath:
    """The data path ``config`` selects, delivering to ``device``.

    Args:
        config: the run's validated config (dataset, loader, prefetch; ``run`` sets the
            epochs when ``epochs`` is None).
        device: where batches go.
        ranks: this process's place under torch.distributed (a disjoint shard per rank).
        start_step: steps of the run already done (a resumed run): the data path goes on
            from the next batch of the same epoch's permutation, with the same crops.
        epochs: epochs one iteration reads (None: what is left of the run's plan,
            ``run.steps`` or ``run.epochs``).
        progress: progress bars for one-off work (the default dataset, a cache conversion).
        every_image: read every image of an epoch once (validation), the last batches
            padded and masked, even where training would drop the remainder
            (``runner.data.loading.loader.drops_remainder``).
    """
    ranks = ranks or Ranks()
    check_host_dtype(config)  # before any work
    storage = open_storage(config, ranks, progress)
    page_cache = None
    if config.dataset.page_cache is PageCache.cold:
        page_cache = ColdPageCache(storage.files, storage.reopen)
    pin = pin_memory(config.loader, device)
    loader_cfg = config.loader
    drops = drops_remainder(config, ranks.world, every_image, len(storage))
    if drops != loader_cfg.drop_last:  # unset, or several ranks: what this run does
        loader_cfg = dataclasses.replace(loader_cfg, drop_last=drops)
        left = len(storage) % (loader_cfg.batch_size * ranks.world)
        if drops and ranks.main and ranks.world > 1:
            log.info("training on %d ranks: each epoch drops its last %d image(s) after the "
                     "last whole global batch of %d", ranks.world, left,
                     loader_cfg.batch_size * ranks.world)
        elif drops and ranks.main and left:
            log.info("training keeps its batches whole: each epoch leaves out its last %d "
                     "image(s) after the last whole batch of %d (other images each epoch "
                     "when shuffled; a batch of one fails BatchNorm); loader.drop_last=false "
                     "trains on them", left, loader_cfg.batch_size)
    streams = getattr(storage, "streams", False)  # an IterableDataset: read in its order
    if streams and loader_cfg.shuffle:
        loader_cfg = dataclasses.replace(loader_cfg, shuffle=False)
    order = batch_order(storage, loader_cfg, config.seed, ranks.slot, ranks.world,
                        ranks.nodes)
    check_batch_memory(config.loader, order, storage)
    kind = STORAGES[config.loader.name]
    if kind.own_loader:  # a rival's own pipeline in place of the runner's loaders
        loader = storage.own_loader(order, device)
    elif streams:
        loader = storage.stream_loader(order, loader_cfg, pin)
    else:  # encoded bytes for the GPU are not pinned: nvJPEG reads them on the host
        gpu_decodes = DECODERS[config.loader.decoder].cuda
        loader = build_loader(storage, config.loader, order, pin and not gpu_decodes)
    if DECODERS[config.loader.decoder].cuda:  # a stage above the loader: decode on the GPU
        loader = GpuDecodedBatches(loader, storage, device)
    if len(loader) == 0:
        if ranks.enabled:  # training on several ranks drops what no whole global batch holds
            raise ConfigError(
                f"the loader yields no batches: {len(storage)} images hold no whole global "
                f"batch of {ranks.world} ranks x loader.batch_size={config.loader.batch_size}"
                f"; use loader.batch_size={max(1, len(storage) // ranks.world)} or less")
        raise ConfigError(
            f"the loader yields no batches: {len(storage)} images per rank is fewer than "
            f"loader.batch_size={config.loader.batch_size} with loader.drop_last=true; use a "
            "smaller batch or loader.drop_last=false")
    start_epoch, start_batch = divmod(start_step, len(loader))
    if epochs is None:
        epochs = max(planned_epochs(config.run, len(loader)) - start_epoch, 1)
    augment, per_batch = device_crop(storage, config, order, pin)
    stream = BatchStream(loader, epochs, order=order, start_epoch=start_epoch,
                         on_epoch=page_cache, known_skipped=storage.known_skipped,
                         start_batch=start_batch, per_batch=per_batch)
    convert = host_convert(config, pin)
    if convert is not None and augment is not None:
        raise ConfigError(
            f"loader.host_dtype={config.loader.host_dtype.value} converts on the host before "
            f"the copy, but loader={config.loader.name.value} crops its decoded images on the "
            "device after it (dataset.crop=random, or a store larger than dataset.image_size): "
            "use loader.host_dtype=uint8, or a storage that decodes every epoch")
    train_augment = train_augment_for(config, ranks, start_step, cropped=augment is not None)
    host_side = stream
    if train_augment is not None and train_augment.on_host:  # task.augment.on=cpu|both
        from runner.data.device.augment import HostAugmented

        host_side = HostAugmented(stream, train_augment, pin)
    batches = build_prefetcher(config.prefetch, Converted(host_side, convert) if convert else
                               host_side, device)
    data = DataPath(storage, kind=kind, stream=stream, batches=batches, device=device, pin=pin,
                    augment=augment, page_cache=page_cache, convert=convert)
    data.train_augment = train_augment
    if train_augment is not None:
        log.info("task.augment: %s", train_augment.describe(device))
    return data


def train_augment_for(config: Config, ranks: Ranks, start_step: int, cropped: bool):
    """``task.augment`` of a training run (None: none asked); ``cropped``: the storage crops
    on the device, after the copy, so no part of it may run on the host before."""
    if not (config.task.name.trains and config.task.augment.active):
        return None
    from runner.data.device.augment import TrainAugment

    augment = TrainAugment(config.task.augment, config.seed, ranks.rank, start_step)
    if augment.on_host and cropped:
        raise ConfigError(
            f"task.augment.on={config.task.augment.on.value} augments host batches before the "
            f"copy, but loader={config.loader.name.value} crops its decoded images on the "
            "device after it (dataset.crop=random, or a store larger than dataset.image_size):"
            " use task.augment.on=device, or a storage that decodes every epoch")
    return augment
