"""``dataset.target=module:function``: your own torch ``Dataset`` as the run's storage.

``function()`` (imported as ``model.target`` is, from the current folder first:
runner/config/schema.py ``import_target``) returns a map-style ``Dataset`` (``__len__``,
``__getitem__``) or an ``IterableDataset`` whose items are ``(image, label)``:

- **image**: a uint8 CHW tensor (1 or 3 channels), a uint8 HWC (or HW) numpy array, or a
  PIL image (converted to RGB). A float tensor is refused, naming the fix: the runner
  normalizes on the device (``model.mean``/``model.std``), so return the bytes.
- **label**: a class index (an int, a numpy integer or a 0-d tensor); ``-1`` or ``None``
  for an unlabelled image (``task=infer`` writes what it predicts; training refuses it).

Each image whose size is not ``dataset.image_size`` is resized to it whole (antialiased
bilinear, aspect not kept), so batches stack: crop in your Dataset when you want a crop.
One grey channel is repeated to three. Class names: the Dataset's ``classes`` attribute
(a list of names, as torchvision's datasets have), else ``range(num_classes)`` from its
``num_classes`` attribute, else ``range(max label + 1)`` over its ``targets`` (or
``labels``) attribute, else over one pass reading every item (said in the log).

Everything past the storage is the runner's own: the batch order (shuffle, seed, ranks),
``loader.num_workers`` (forked workers calling ``__getitem__``; with none,
``loader.decode_threads`` threads call it, so it must be thread-safe, or set
``loader.decode_threads=0``), ``loader.batched``, ``prefetch=``, ``amp=``, ``compile=``,
the verdict (its stages: ``getitem``, your ``__getitem__`` alone, and ``collate``),
``task=infer``'s outputs (files are named by their index, ``000123``) and ``resume=``.
What does not apply is said in one log line: ``loader=`` itself (the storage is yours),
``loader.decoder``/``draft``, and the ``dataset.*`` keys of an image folder (``path``,
``manifest``, ``labels``, ``crop``, ``crop_fraction``, ``store_*``, ``page_cache``);
``dataset.val_fraction`` is refused (``dataset.val_path``, an image folder of the same
classes, validates).

**Labels** are checked against the classes: beyond the ones the Dataset names (``classes``
or ``num_classes``) refused, naming the item; counted from the labels (``0..max``), classes
that no item has are said once (a stray 100 among 0..2 would size a 101-class head), and
``model.num_classes`` below the count is refused before training.

**Faults** are one line naming the item, what was wrong and the line of your code it came
through (``raised_in_your_code``): your module failing to import, your function raising,
a ``__len__`` that raises or is negative. An item whose ``__getitem__`` raises (an
``IndexError`` from a ``__len__`` larger than the items too) or whose image is empty is,
with ``dataset.on_corrupt=skip`` (the default), skipped and counted in ``skipped_files``
as ``000123``, as an undecodable file is; with ``fail``, the run stops on that line.

**An IterableDataset** has no index: its epoch is read in its own order (``loader.shuffle``
does not apply), its length is ``dataset.length`` or ``len()`` when it has one, else
counted by iterating it once when the run starts, with a bound (``count_stream``): with
``run.steps``, the larger of what it reads and ``COUNT_FLOOR`` (a stream still going there
is an epoch of that many, said); without, refused past ``COUNT_CAP`` (an endless stream). With ``loader.num_workers=n > 0`` each worker iterates it and converts
every n-th item (worker k: items k, k+n, ...), which the DataLoader takes in turn, so the
order is the Dataset's: a Dataset that splits itself by ``get_worker_info()`` gives fewer
items than its length, which is refused in one line (use ``loader.num_workers=0``; a
stream shorter than its length without workers ends the epoch, said once). An epoch
stops after its length. Ranks take
every ``world``-th item; a resume re-reads the epoch up to where it stopped (the order
must be the same each time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from runner.common.errors import ConfigError, raised_in_your_code
from runner.config.schema import (
    DatasetConfig,
    Decoder,
    LoaderConfig,
    OnCorrupt,
    StorageName,
    import_target,
    keys_where,
)
from runner.data.order import BatchOrder, split_padding, unpad
from runner.data.protocol import (
    Probe,
    Sample,
    SkippedFile,
    StorageKind,
    StoreFootprint,
    cycle_rows,
    stack_images,
)
from runner.data.sources.listing import UNLABELLED
from runner.measure import timeline

log = logging.getLogger(__name__)

KEY = "dataset.target"
# the keys of the runner's own reading of images that your Dataset replaces (said once):
# declared on each field (``key(..., own_reading=True)``, runner/config/schema.py)
NOT_APPLYING = tuple("loader= (the storage is your Dataset)" if k == "loader.name" else k
                     for k in keys_where("own_reading"))


class ItemError(ConfigError):
    """An item of the user's Dataset that is not ``(image, label)`` of a kind it takes."""


class ItemFault(ItemError):
    """An item the run can go on without (an empty image): skipped and counted with
    ``dataset.on_corrupt=skip``, as an undecodable file is."""


def to_image(image: Any, target: str, index: int) -> torch.Tensor:
    """One item's image as uint8 CHW with 3 channels; an ItemError naming the fix."""
    where = f"{KEY}={target}: item {index}'s image"
    if not isinstance(image, torch.Tensor | np.ndarray):
        try:
            from PIL import Image
        except ImportError:  # pragma: no cover - PIL is a dependency
            Image = None
        if Image is not None and isinstance(image, Image.Image):
            image = np.asarray(image.convert("RGB"))
        else:
            raise ItemError(f"{where} is a {type(image).__name__}: return a uint8 CHW tensor, "
                            "a uint8 HWC numpy array or a PIL image")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (
                image.ndim == 3 and image.shape[2] not in (1, 3)):
            raise ItemError(f"{where} is a {image.dtype} numpy array of shape "
                            f"{tuple(image.shape)}: return uint8 HWC (3 or 1 channels) or HW")
        image = torch.from_numpy(np.ascontiguousarray(image))
        image = image[None] if image.dim() == 2 else image.permute(2, 0, 1)
    elif image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] not in (1, 3):
        fix = ("; the runner normalizes on the device (model.mean/std): return the bytes, "
               "e.g. (x * 255).round().to(torch.uint8), without ToTensor/Normalize"
               if image.is_floating_point() else "")
        raise ItemError(f"{where} is a {str(image.dtype).replace('torch.', '')} tensor of "
                        f"shape {tuple(image.shape)}: return uint8 CHW (3 or 1 channels)"
                        f"{fix}")
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    if image.shape[1] == 0 or image.shape[2] == 0:
        raise ItemFault(f"{where} is empty ({image.shape[1]}x{image.shape[2]}, H x W): "
                        "return an image of at least one pixel")
    return image


def resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``image`` (uint8 CHW) at ``size`` (H, W): the whole image, antialiased bilinear."""
    if tuple(image.shape[1:]) == size:
        return image.contiguous()
    x = torch.nn.functional.interpolate(image[None].float(), size=size, mode="bilinear",
                                        align_corners=False, antialias=True)
    return x[0].round_().clamp_(0, 255).to(torch.uint8)


def to_label(label: Any, target: str, index: int) -> int:
    """One item's label as a class index, ``UNLABELLED`` (-1) for None or -1."""
    if label is None:
        return UNLABELLED
    if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
        label = label.item()
    if isinstance(label, np.integer):
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or label < UNLABELLED:
        raise ItemError(f"{KEY}={target}: item {index}'s label is {label!r}: return a class "
                        "index (0, 1, 2...), or -1 or None for an unlabelled image")
    return label


def split_item(item: Any, target: str, index: int) -> tuple[Any, Any]:
    """(image, label) of one item; an ItemError when it is no pair."""
    if isinstance(item, tuple | list) and len(item) == 2:
        return item[0], item[1]
    what = (f"a {type(item).__name__} of {len(item)}" if isinstance(item, tuple | list)
            else f"a {type(item).__name__}")
    raise ItemError(f"{KEY}={target}: item {index} is {what}: return (image, label), the "
                    "label -1 or None when there is none")


def class_names(dataset: Any, labels: list[int] | None) -> list[str] | None:
    """The Dataset's class names from what it says about itself (None: nothing does)."""
    names = getattr(dataset, "classes", None)
    if isinstance(names, list | tuple) and names:
        return [str(n) for n in names]
    count = getattr(dataset, "num_classes", None)
    if isinstance(count, int) and count >= 1:
        return [str(k) for k in range(count)]
    if labels is not None:
        top = max(labels, default=UNLABELLED)
        return [str(k) for k in range(top + 1)]
    return None


def known_labels(dataset: Any, n: int) -> list[int] | None:
    """Every item's label from a ``targets`` or ``labels`` attribute of ``n`` entries."""
    for name in ("targets", "labels"):
        values = getattr(dataset, name, None)
        try:
            if values is not None and len(values) == n:
                return [int(v) for v in (values.tolist() if hasattr(values, "tolist")
                                         else values)]
        except (TypeError, ValueError):
            continue
    return None


class UserStorage(Dataset):
    """A map-style Dataset of the user's as a storage (the ``Storage`` protocol, runner/data/protocol.py).

    Args:
        dataset: the user's map-style Dataset.
        target: ``dataset.target`` (for messages).
        size: (H, W) every image is resized to.
        classes: class names by index (empty: unlabelled).
        labels: every item's label where known (from the Dataset, or one pass), else None.
        on_corrupt: an item whose ``__getitem__`` raises, or whose image is empty: skipped
            and counted in ``skipped_files`` (named ``000123``, as its outputs are), or
            (fail) the run stops on it; either way one line naming the item, what was wrong
            and the line of your code it came from.
    """

    decodes_per_epoch = True  # every epoch calls your __getitem__
    random_crops = False
    image_bytes = None
    streams = False

    def __init__(self, dataset: Any, target: str, size: tuple[int, int], classes: list[str],
                 labels: list[int] | None = None, count: int | None = None,
                 on_corrupt: OnCorrupt = OnCorrupt.skip):
        self.dataset, self.target, self.size = dataset, target, size
        self.classes = classes
        self.labels = labels
        self.root = Path.cwd()
        self.known_skipped: list[SkippedFile] = []
        self.count = len(dataset) if count is None else count
        self.on_corrupt = on_corrupt

    def __len__(self) -> int:
        return self.count

    @property
    def files(self) -> list[str]:
        return []  # the Dataset reads what it reads: no files to evict (page_cache)

    @property
    def item_shape(self) -> tuple[int, ...]:
        return (3, *self.size)

    def reopen(self) -> None:
        """Nothing the runner mapped."""

    def name_of(self, index: int) -> str:
        return f"{index:06d}"

    def label_tensor(self) -> torch.Tensor:
        """Every item's label where the Dataset says them without reading (else -1s: the
        data's fingerprint then holds its length and classes)."""
        labels = self.labels if self.labels is not None else [UNLABELLED] * len(self)
        return torch.tensor(labels, dtype=torch.int64)

    @property
    def labels_unknown(self) -> bool:
        """No label is known before the items are read (the -1s above are not "unlabelled":
        training takes them as they come, and refuses an item without one then)."""
        return self.labels is None

    def convert(self, item: Any, index: int, valid: bool = True) -> Sample:
        image, label = split_item(item, self.target, index)
        label = to_label(label, self.target, index)
        if self.classes and label >= len(self.classes):  # a head this size cannot learn it
            raise ItemError(beyond_classes(self.target, index, label, self.classes))
        return Sample(resize(to_image(image, self.target, index), self.size), label, index,
                      valid)

    def fault(self, index: int, why: str) -> SkippedFile:
        """Item ``index`` cannot be read (``why``): a SkippedFile to count (the loop names
        it once), or, with ``dataset.on_corrupt=fail``, the one line that stops the run."""
        if self.on_corrupt is OnCorrupt.fail:
            raise ItemError(f"{KEY}={self.target}: item {index}: {why}; fix it in your "
                            "Dataset, or set dataset.on_corrupt=skip to skip such items "
                            "(counted in metrics.json's skipped_files)")
        return SkippedFile(self.name_of(index), f"item {index}: {why}", index)

    def read(self, index: int) -> Any:
        """Your ``__getitem__(index)``; what it raises, as ``ItemRaised`` naming your line."""
        try:
            return self.dataset[index]
        except Exception as e:
            hint = (f"; your __len__ says {self.count}: does it count more items than there "
                    "are?" if isinstance(e, IndexError) else "")
            raise ItemRaised(f"your Dataset's __getitem__ raised {raised_in_your_code(e)}"
                             f"{hint}") from e

    def __getitem__(self, index: int) -> Sample | SkippedFile:
        index, valid = unpad(index)
        t0 = time.perf_counter() if timeline.enabled() else 0.0
        try:
            sample = self.convert(self.read(index), index, valid)
        except ItemRaised as e:
            return self.fault(index, str(e))
        except ItemFault as e:
            return self.fault(index, str(e).split(": ", 1)[-1])
        if timeline.enabled():
            timeline.record("getitem", t0, time.perf_counter())
        return sample

    def __getitems__(self, indices: list[int]) -> list[Sample]:
        return [self[i] for i in indices]

    def will_need(self, index: torch.Tensor) -> None:
        """Nothing to start ahead."""

    def decode_slice(self, out: torch.Tensor, positions: range, indices: list
                     ) -> list[Sample]:
        """Items ``indices[k]`` for ``k`` in ``positions`` into ``out[k]`` (the threaded
        loader's unit of work); the Samples carry no image."""
        items = []
        for k in positions:
            item = self[indices[k]]
            if isinstance(item, Sample):
                out[k].copy_(item.image)
                item = Sample(None, item.label, item.index, item.valid)
            items.append(item)
        return items

    def pack(self, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return stack_images(images)

    def gather(self, index: torch.Tensor, out: torch.Tensor | None = None, rows: Any = None
               ) -> tuple[dict | None, list[SkippedFile]]:
        from runner.data.targets import batch_fields

        items = self.__getitems__(index.tolist())
        samples = [s for s in items if isinstance(s, Sample)]
        skipped = [s for s in items if isinstance(s, SkippedFile)]
        if not samples:
            return None, skipped
        images = [s.image for s in samples]
        pixels = ({"image": torch.stack(images, out=out[: len(samples)])} if out is not None
                  else self.pack(images))
        return {**pixels, **batch_fields(samples)}, skipped

    def first_items(self, n: int) -> list[Sample]:
        """The first ``n`` items that read (a skipped one left out)."""
        items = (self[i] for i in range(min(2 * n, len(self))))
        return [s for s in items if isinstance(s, Sample)][:n]

    def example(self, n: int) -> torch.Tensor:
        samples = self.first_items(n)
        if not samples:
            raise ConfigError(f"{KEY}={self.target} returned an empty Dataset")
        return cycle_rows(torch.stack([s.image for s in samples]), n)

    def probes(self, batch_size: int, device: torch.device | None = None
               ) -> dict[str, Probe]:
        """Your ``__getitem__`` alone (with the resize), and collating one batch."""
        samples = self.first_items(min(batch_size, 32))
        counter = iter(range(10**12))
        span = max(1, min(len(self), 256))

        def getitem() -> int:
            self[next(counter) % span]
            return 1

        batch = [samples[k % len(samples)] for k in range(batch_size)]

        def collate() -> int:
            from runner.data.targets import batch_fields

            self.pack([s.image for s in batch])
            batch_fields(batch)
            return batch_size

        return {"getitem": getitem, "collate": collate}


class ItemRaised(Exception):
    """Your ``__getitem__`` raised (the message says what, and where in your code)."""


def beyond_classes(target: str, index: int, label: int, classes: list[str]) -> str:
    """The line refusing a label at or beyond the classes the Dataset names."""
    names = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
    return (f"{KEY}={target}: item {index}'s label is {label}, but your Dataset names "
            f"{len(classes)} classes ({names}): a label is a class index 0..{len(classes) - 1}"
            "; fix the label, or name its class in classes/num_classes")


def check_labels(target: str, labels: list[int] | None, names: list[str],
                 named: bool) -> None:
    """Labels against the classes: beyond classes the Dataset ``named`` (its classes or
    num_classes attribute), refused naming the item; classes counted from the labels
    (``0..max``) that no item has, said once (a stray label, e.g. 100 among 0..2, would
    otherwise size a 101-class head without a word)."""
    if not labels:
        return
    if named:
        bad = next((k for k, v in enumerate(labels) if v >= len(names)), None)
        if bad is not None:
            raise ConfigError(beyond_classes(target, bad, labels[bad], names))
        return
    used = set(labels) - {UNLABELLED}
    empty = [k for k in range(len(names)) if k not in used]
    if used and empty:
        top = max(used)
        lonely = sorted(used, key=lambda v: (labels.count(v), -v))[0]
        log.warning("%s: your Dataset's labels run 0..%d, so the model gets %d classes, but "
                    "%d of them have no item (%s); the rarest label, %d, is item %d's. A "
                    "stray label? Give your Dataset a classes attribute (its class names) "
                    "and a label beyond them is refused", f"{KEY}={target}", top, top + 1,
                    len(empty), ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5
                                                                   else ""),
                    lonely, labels.index(lonely))


def has_names(dataset: Any) -> bool:
    """Whether the Dataset names its classes itself (classes or num_classes)."""
    names, count = getattr(dataset, "classes", None), getattr(dataset, "num_classes", None)
    return (isinstance(names, list | tuple) and bool(names)) or (
        isinstance(count, int) and count >= 1)


class Items(IterableDataset):
    """An IterableDataset's items converted (in the DataLoader's workers, when it has any)."""

    def __init__(self, storage: UserStream):
        self.storage = storage

    def __iter__(self) -> Iterator[Sample]:
        worker = get_worker_info()
        share, count = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        for position, item in enumerate(stream_items(self.storage.dataset,
                                                     self.storage.target)):
            if position % count == share:  # the DataLoader takes the workers in turn
                yield self.storage.convert(item, position)


class StreamBatches:
    """Batches of an IterableDataset in its own order: each batch of the batch order (not
    shuffled: positions ascending) takes the items at its positions as they come, so ranks,
    a resume's skipped batches and the epoch's length follow the runner's order."""

    def __init__(self, storage: UserStream, order: BatchOrder, cfg: LoaderConfig,
                 pin_memory: bool):
        self.storage, self.order, self.cfg, self.pin = storage, order, cfg, pin_memory

    def __len__(self) -> int:
        return len(self.order)

    def items(self) -> Iterator[Sample]:
        if self.cfg.num_workers == 0:
            return iter(Items(self.storage))
        loader = DataLoader(Items(self.storage), batch_size=None,
                            num_workers=self.cfg.num_workers,
                            prefetch_factor=self.cfg.prefetch_factor,
                            multiprocessing_context="fork")
        return iter(loader)

    def ended_short(self, got: int) -> None:
        """The stream gave ``got`` of its ``count`` items. With workers, a Dataset that
        splits itself by ``get_worker_info()`` (each worker already takes every n-th item
        here) would silently train on a fraction: refused in one line. Without, its length
        changed: said once, and the epoch ends there."""
        want, target = self.storage.count, self.storage.target
        if self.cfg.num_workers > 0:
            raise ConfigError(f"{KEY}={target}: your IterableDataset gave {got} of its {want} "
                              f"items with loader.num_workers={self.cfg.num_workers}: it "
                              "splits itself by get_worker_info(), and the runner already "
                              "gives each worker every n-th item; stop splitting in it, or "
                              "set loader.num_workers=0")
        if not getattr(self, "_said", False):
            self._said = True
            log.warning("%s: your IterableDataset gave %d of its %d items this epoch (its "
                        "length changed?): the epoch ends there", KEY, got, want)

    def __iter__(self) -> Iterator[tuple[dict | None, list[SkippedFile]]]:
        from runner.data.targets import batch_fields

        items = self.items()
        current = next(items, None)
        position = 0
        try:
            for index in self.order.batches():
                read, valid = split_padding(index)
                samples: list[Sample] = []
                for k, want in enumerate(read.tolist()):
                    while current is not None and position < want:  # another rank's
                        current, position = next(items, None), position + 1
                    if current is None:  # the stream ended before its length
                        self.ended_short(position)
                        break  # with workers 0 and a warning said: the epoch ends
                    counts = valid is None or bool(valid[k])
                    samples.append(Sample(current.image, current.label, want, counts))
                if not samples:
                    return
                images = stack_images([s.image for s in samples])
                if self.pin:
                    images = {"image": images["image"].pin_memory()}
                yield {**images, **batch_fields(samples)}, []
                if current is None:
                    return
        finally:
            close = getattr(items, "_shutdown_workers", None)
            if close is not None:
                close()


class UserStream(UserStorage):
    """An IterableDataset of the user's as a storage: read in its own order, its length
    from ``len()`` or from counting it once (the module docstring)."""

    streams = True

    def __init__(self, dataset: Any, target: str, size: tuple[int, int], classes: list[str],
                 labels: list[int] | None, count: int):
        self.dataset, self.target, self.size = dataset, target, size
        self.classes, self.labels, self.count = classes, labels, count
        self.root = Path.cwd()
        self.known_skipped = []

    def __getitem__(self, index: int) -> Sample:
        raise TypeError("an IterableDataset has no index: its batches come from stream_loader")

    def stream_loader(self, order: BatchOrder, cfg: LoaderConfig, pin_memory: bool
                   ) -> StreamBatches:
        return StreamBatches(self, order, cfg, pin_memory)

    def first_items(self, n: int) -> list[Sample]:
        out = []
        for position, item in enumerate(stream_items(self.dataset, self.target)):
            if position >= n:
                break
            out.append(self.convert(item, position))
        return out

    def probes(self, batch_size: int, device: torch.device | None = None
               ) -> dict[str, Probe]:
        """Your iterator alone (with the resize), and collating one batch."""
        probes = super().probes(batch_size, device)
        state = {"items": iter(Items(self))}

        def getitem() -> int:
            item = next(state["items"], None)
            if item is None:  # the stream's end: start it again
                state["items"] = iter(Items(self))
                next(state["items"])
            return 1

        probes["getitem"] = getitem
        return probes


def check_target(target: str) -> Any:
    """The function ``dataset.target`` names, imported (a ConfigError when it is not there
    or not callable)."""
    function = import_target(target, KEY)
    if not callable(function):
        raise ConfigError(f"{KEY}={target} is a {type(function).__name__}, not a function: "
                          "name a function (or class) that returns your torch Dataset")
    return function


# an IterableDataset without __len__ is counted up to COUNT_CAP items; with run.steps, up to
# the larger of what it reads and COUNT_FLOOR (count_stream)
COUNT_CAP = 1_000_000
COUNT_FLOOR = 10_000


def call_factory(target: str) -> Any:
    """The Dataset ``dataset.target``'s function returns; what it raises, one line naming
    your line."""
    function = check_target(target)
    try:
        return function()
    except Exception as e:
        raise ConfigError(f"{KEY}={target}: calling it raised {raised_in_your_code(e)}; fix "
                          "it there") from e


def open_user(loader: LoaderConfig, dataset: DatasetConfig, path: Any = None,
              progress: bool = True, needed: int | None = None) -> UserStorage:
    """The Dataset ``dataset.target``'s function returns, as a storage; the first item is
    converted at once, so a wrong item is one line before any work. ``needed``: the items
    the run's steps read (``run.steps``), the most an IterableDataset without ``__len__``
    is counted to."""
    target = dataset.target
    if target is None:
        raise ConfigError("loader=user reads the Dataset dataset.target names: set "
                          "dataset.target=module:function (it replaces loader=)")
    data = call_factory(target)
    if not isinstance(data, Dataset):
        raise ConfigError(f"{KEY}={target} returned a {type(data).__name__}, not a torch "
                          "Dataset: return a torch.utils.data.Dataset (map-style) or "
                          "IterableDataset of (image, label)")
    size = tuple(int(v) for v in dataset.image_size)
    log.info("%s: your Dataset's items are resized to dataset.image_size=%s; these do not "
             "apply to it: %s", f"{KEY}={target}", list(size), ", ".join(NOT_APPLYING))
    if isinstance(data, IterableDataset):
        return open_stream(data, target, size, dataset.length, needed)
    try:
        count = len(data)
    except TypeError as e:
        if "__len__" not in str(e) and "len()" not in str(e):
            raise ConfigError(f"{KEY}={target}: your Dataset's __len__ raised "
                              f"{raised_in_your_code(e)}") from e
        raise ConfigError(f"{KEY}={target} returned a map-style Dataset with no __len__: "
                          "give it one, or make it an IterableDataset") from e
    except Exception as e:  # a negative length (ValueError), or __len__ itself failing
        raise ConfigError(f"{KEY}={target}: your Dataset's __len__ raised "
                          f"{raised_in_your_code(e)}; it must return the number of items "
                          "(0 or more)") from e
    storage = UserStorage(data, target, size, [], None, count, dataset.on_corrupt)
    if count == 0:
        raise ConfigError(f"{KEY}={target} returned an empty Dataset (len 0)")
    try:
        storage.convert(storage.read(0), 0)  # the first item: a wrong kind is said now
    except ItemRaised as e:
        raise ConfigError(f"{KEY}={target}: item 0: {e}") from e
    labels = known_labels(data, count)
    names = class_names(data, labels)
    if names is None:  # nothing tells: one pass over every item's label
        log.info("%s: reading every item once for its label (give your Dataset a classes "
                 "attribute, or targets, to skip this)", f"{KEY}={target}")
        labels = [storage_label(storage, i) for i in range(count)]
        names = class_names(data, labels)
    check_labels(target, labels, names, has_names(data))
    storage.classes, storage.labels = unlabelled_or(names, labels), labels
    return storage


def storage_label(storage: UserStorage, index: int) -> int:
    """Item ``index``'s label for the pass over every item; an item that cannot be read is
    counted as skipped (``known_skipped``), its label 0 (it is never trained on: it is
    skipped again when read), or with ``dataset.on_corrupt=fail`` stops the run."""
    try:
        item = storage.read(index)
    except ItemRaised as e:
        storage.known_skipped.append(storage.fault(index, str(e)))
        return 0
    return to_label(split_item(item, storage.target, index)[1], storage.target, index)


def unlabelled_or(names: list[str], labels: list[int] | None) -> list[str]:
    """No classes when every label known is -1 (an unlabelled Dataset)."""
    if labels is not None and labels and max(labels) == UNLABELLED:
        return []
    return names


def stream_items(data: IterableDataset, target: str) -> Iterator[Any]:
    """Your IterableDataset's items; what its iterator raises, one line naming your line."""
    position = 0
    try:
        for position, item in enumerate(data):  # noqa: B007 - the position is said below
            yield item
    except Exception as e:
        raise ConfigError(f"{KEY}={target}: your IterableDataset raised "
                          f"{raised_in_your_code(e)} after item {position}") from e


def count_stream(data: IterableDataset, target: str, needed: int | None
                 ) -> tuple[int, list[int]]:
    """An IterableDataset without ``__len__`` counted by iterating it: (its length, its
    labels). With ``needed`` (the items run.steps reads) the count stops at the larger of
    it and ``COUNT_FLOOR``, and a stream still going there is taken as an epoch of that many
    (said): the floor keeps a finite stream's length, and so a resume's data, whatever
    run.steps says. Without, past ``COUNT_CAP`` is refused: an endless stream with
    run.epochs has no epoch to count."""
    bound = max(needed, COUNT_FLOOR) if needed else COUNT_CAP
    log.info("%s: an IterableDataset with no __len__: counting its items by iterating it "
             "once, at most %s (dataset.length=N gives its length and skips this pass)",
             f"{KEY}={target}", f"{bound:,}" + (f" (run.steps reads {needed})"
                                                if needed else ""))
    labels: list[int] = []
    for position, item in enumerate(stream_items(data, target)):
        if position == bound:
            break
        if position == 0:  # a wrong kind is said before the pass
            image, label = split_item(item, target, 0)
            to_image(image, target, 0)
        labels.append(to_label(split_item(item, target, position)[1], target, position))
    else:
        return len(labels), labels
    if needed:
        log.warning("%s: your IterableDataset gave %s items without ending (run.steps reads "
                    "%d): counted no further, an epoch is those %s; dataset.length=N gives "
                    "its length", f"{KEY}={target}", f"{bound:,}", needed, f"{bound:,}")
        return bound, labels
    raise ConfigError(f"{KEY}={target}: your IterableDataset gave {COUNT_CAP:,} items without "
                      "ending, and has no __len__: give its epoch's length with "
                      "dataset.length=N, or the run's length with run.steps=N, or a __len__")


def open_stream(data: IterableDataset, target: str, size: tuple[int, int],
                length: int | None = None, needed: int | None = None) -> UserStream:
    """An IterableDataset: its length from ``dataset.length``, ``len()``, else counted
    (``count_stream``) with its labels."""
    labels = None
    try:
        count = length if length is not None else len(data)
    except TypeError:
        count, labels = count_stream(data, target, needed)
    stream = UserStream(data, target, size, [], labels, count)
    if count == 0:
        raise ConfigError(f"{KEY}={target} returned an empty IterableDataset")
    first = stream.first_items(1)
    if not first:
        raise ConfigError(f"{KEY}={target} returned an IterableDataset that yields nothing")
    names = class_names(data, labels)
    if names is None:  # a length and no classes: one pass for the labels
        labels = [to_label(split_item(item, target, k)[1], target, k)
                  for k, item in zip(range(count), stream_items(data, target))]
        stream.labels = labels
        names = class_names(data, labels)
    check_labels(target, labels, names, has_names(data))
    stream.classes = unlabelled_or(names, labels)
    if len(stream.label_tensor()) != count:
        stream.labels = None
    return stream


def no_footprint(dataset: DatasetConfig, folder: Any) -> StoreFootprint:
    """Nothing of an image folder's: the Dataset holds what it holds."""
    return StoreFootprint("your Dataset's own items", 0, on_disk=False)


KIND = StorageKind(
    name=StorageName.user,
    open=open_user,
    storage=UserStorage,
    summary="your own torch Dataset (dataset.target=module:function), every item read "
            "on every epoch",
    decoders=frozenset({Decoder.pil}),
    knobs=("loader.num_workers",),
    autotune=False,
    advice={"getitem": "your Dataset's __getitem__ is the limit: more loader.num_workers, "
                       "or less work per item (decode at dataset.image_size; return uint8)",
            "collate": "try loader.batched=true (one gather per batch, no collate calls)"},
    footprint=no_footprint,
    reads_path=False,
    counts_items=True,
)
