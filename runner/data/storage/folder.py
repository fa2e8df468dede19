"""``loader=folder``: a folder of images (or a manifest), every image read and decoded on
every epoch; which images and labels, and what reads their bytes (this machine's files, a
far disk's, a store's objects): runner/data/sources/files.py."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from runner.common.text import printable
from runner.config.schema import Crop, DatasetConfig, Decoder, LoaderConfig, OnCorrupt, StorageName
from runner.data.decode.decoders import (
    DECODERS,
    FALLBACK,
    CorruptFileStop,
    CorruptImageError,
    ImageDecoder,
    check_decoder,
)
from runner.data.decode.encoded import ReadBytes
from runner.data.order import unpad
from runner.data.protocol import (
    Probe,
    Sample,
    SkippedFile,
    StorageKind,
    StoreFootprint,
    cycle_rows,
)
from runner.data.sources.files import Files, open_files
from runner.data.sources.listing import DatasetError, open_image_folder
from runner.data.targets import TARGETS, batch_fields
from runner.measure import timeline

UNREADABLE = "unreadable"  # how the error of a file that could not be read begins


class FolderStorage(torch.utils.data.Dataset):
    """Decodes one image per item from the bytes its ``Files`` reads (the ``Storage``
    protocol, runner/data/protocol.py): where the bytes come from (this machine's files, a
    far disk's, a store's objects) is the Files' (runner/data/sources/files.py).

    Args:
        source: the images and what reads them (``open_files``), or a folder (class
            folders, or unlabelled images) read as local files.
        decode: bytes -> CHW uint8 tensor of the output size (an ``ImageDecoder``), or
            ``ReadBytes`` when the GPU decodes (loader.decoder=nvjpeg).
        on_corrupt: skip (return a SkippedFile, counted by the loop) or fail (raise with the path).
    """

    decodes_per_epoch = True
    image_bytes = None  # one file per image

    targets = None  # detection: each image's boxes (DetectionTargets; packed's and shards'
    # their own, read from the store: packed.py, shards.py); a rival's carries none
    # loader.group_aspect: each item's output (height, width), int64 [N, 2], its aspect
    # bin's (runner/data/order.py: ``bin_shapes``); None: every item's is ``item_shape``'s
    item_shapes: torch.Tensor | None = None

    def __init__(self, source: Files | str | Path, decode: ImageDecoder | ReadBytes,
                 on_corrupt: OnCorrupt):
        if not isinstance(source, Files):
            source = Files(open_image_folder(source))
        self.source = source
        listing = source.listing
        self.root, self.classes, self.samples = listing.root, listing.classes, listing.samples
        self.decode = decode
        self.on_corrupt = on_corrupt
        # detection: each image's boxes (runner/data/sources/detection.py), or None
        self.targets = listing.targets
        # files the listing left out (a FIFO, a socket: a read would wait forever), and
        # a detection set's bad labels
        self.known_skipped: list[SkippedFile] = [SkippedFile(p, f"{UNREADABLE}: {why}")
                                                 for p, why in listing.skipped]
        if self.targets is not None:
            self.known_skipped += self.targets.skipped

    def _serve(self, folder: FolderStorage, keep: list[int], skipped: list[SkippedFile]
               ) -> None:
        """Set up a storage built from ``folder`` (a cache or a rival's pipeline over it) to
        serve the files ``keep``, ``skipped`` listed as undecodable: the folder's root,
        classes, decoder and ``on_corrupt`` without listing the folder again (its files, if
        read at all, read as local files: ``Files.kept``)."""
        self.source = folder.source.kept(keep)
        self.root, self.classes, self.samples = folder.root, folder.classes, self.source.samples
        self.decode, self.on_corrupt = folder.decode, folder.on_corrupt
        self.targets = None  # a store with boxes sets its own (packed.py's StoredTargets)
        self.known_skipped = list(skipped)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def files(self) -> list[str]:
        """Every local file an epoch reads (none for a store's objects)."""
        return self.source.files

    @property
    def item_shape(self) -> tuple[int, ...] | None:
        return self.decode.item_shape

    def set_item_shapes(self, shapes: torch.Tensor) -> None:
        """Decode item ``i`` at ``shapes[i]`` (height, width) instead of the decoder's size
        (``loader.group_aspect``: each aspect bin's batch shape, a batch of one bin at a
        time), its letterbox (or whole image) fitted there and its boxes following. The
        decoder's size stays the largest shape, which the batch buffers are sized by."""
        self.item_shapes = shapes
        self._decoders = {shape: dataclasses.replace(self.decode, size=shape)
                          for shape in map(tuple, shapes.unique(dim=0).tolist())}

    def decoder_for(self, index: int) -> ImageDecoder | ReadBytes:
        """What decodes item ``index``: the decoder, at its bin's shape under
        ``set_item_shapes``."""
        if self.item_shapes is None:
            return self.decode
        return self._decoders[tuple(self.item_shapes[index].tolist())]

    def reopen(self) -> None:
        """Nothing to do: files are opened and closed per read."""

    def name_of(self, index: int) -> str:
        return self.source.name_of(index)

    def names(self) -> list[str]:
        """Every file's path relative to the root, in storage order."""
        return [self.name_of(i) for i in range(len(self))]

    def label_tensor(self) -> torch.Tensor:
        """Every file's class index, in storage order."""
        return torch.tensor([label for _, label in self.samples], dtype=torch.int64)

    @property
    def random_crops(self) -> bool:
        """Whether each image gets its own random crop (``dataset.crop=random``)."""
        return self.decode.image_decoder.crop is Crop.random

    def __getitem__(self, index: int | tuple[int, int]) -> Sample | SkippedFile:
        """Item ``index``; ``(index, crop_seed)`` draws its random crop from that seed (the
        batch order gives each image of each epoch one, so every path crops alike)."""
        return self._item(index)

    def _item(self, index: int | tuple[int, int], out: torch.Tensor | None = None
              ) -> Sample | SkippedFile:
        """``__getitem__``'s item, its image decoded into ``out`` when given."""
        seed = None
        if isinstance(index, tuple):
            index, seed = index
        index, valid = unpad(index)
        t0 = time.perf_counter()
        try:
            data = self.read(index)
        except OSError as e:  # deleted, moved or unreadable since the folder was listed
            return self.unreadable(index, e)
        t1 = time.perf_counter()
        item = (self.decode_data(index, data, valid, seed) if out is None  # a store's own
                else self.decode_data(index, data, valid, seed, out))
        if timeline.enabled():
            timeline.record("read", t0, t1)
            timeline.record("decode", t1, time.perf_counter())
        return item

    def will_need(self, index: torch.Tensor) -> None:
        """A hint that the items of ``index`` are read soon: a read engine starts fetching
        them (a packed store starts reading them)."""
        self.source.will_need(index)

    def read(self, index: int) -> bytearray | memoryview:
        """The encoded bytes of item ``index``, as its Files reads them."""
        return self.source.read(index)

    def figures(self) -> dict:
        """The read engine's requests, bytes, retries, window and round trip (nothing for
        local files)."""
        return self.source.figures()

    def close(self) -> None:
        self.source.close()

    def check_stored(self, index: int, data: bytes | bytearray) -> None:
        """Nothing to check for a folder's own file (a store checks its copy's checksum)."""

    def decode_data(self, index: int, data: bytearray | None, valid: bool = True,
                    seed: int | None = None, out: torch.Tensor | None = None
                    ) -> Sample | SkippedFile:
        """Item ``index`` from its file's bytes (None: the file could not be read); a
        random crop from the image's crop ``seed``; with detection targets, its boxes
        through the window and flip the decoder made the image of. ``out``: the batch
        slot a CPU decoder writes the image into (``decode_slice``)."""
        path, label = self.samples[index]
        try:
            if not data:
                raise CorruptImageError("empty file" if data is not None else "unreadable")
            decode = self.decoder_for(index)
            if (out is not None and isinstance(decode, ImageDecoder)
                    and tuple(out.shape[-2:]) == tuple(decode.size)):
                image, window, flip, hw = decode.decode_window(data, seed, out)
                if self.targets is None:
                    return Sample(image, label, index, valid)
            elif self.targets is None:
                return Sample(decode(data, seed), label, index, valid)
            else:
                image, window, flip, hw = decode.decode_window(data, seed)
        except (CorruptImageError, OSError) as e:
            return self.undecodable(path, e, index)
        # the target through the same window and flip: its kind's record says how
        fields = TARGETS[self.targets.kind].sample_fields(self.targets, index, window, flip,
                                                          image.shape[-2:], hw)
        return Sample(image, label, index, valid, **fields)

    def unreadable(self, index: int, error: OSError) -> SkippedFile:
        """Item ``index``'s file could not be read (deleted, moved, no permission): a skip
        (or, with on_corrupt=fail, an error) that says so."""
        return self.undecodable(self.samples[index][0],
                                OSError(f"{UNREADABLE}: {error.strerror or error}"), index)

    def undecodable(self, path: str, error: Exception, index: int) -> SkippedFile:
        """A file nothing could decode: a SkippedFile to count, or (on_corrupt=fail) an error
        with its path."""
        if self.on_corrupt is OnCorrupt.fail:
            raise CorruptFileStop(
                f"cannot decode {printable(path)}: {error} (dataset.on_corrupt=skip skips "
                "such files)") from error
        return SkippedFile(path, str(error), index)

    def __getitems__(self, indices: list[int]) -> list[Sample | SkippedFile]:
        return [self[i] for i in indices]

    def decode_slice(self, out: torch.Tensor, positions: range, indices: list
                    ) -> list[Sample | SkippedFile]:
        """Items ``indices[k]`` for ``k`` in ``positions`` decoded into ``out[k]`` (the
        decode threads' unit of work, ``ThreadedBatches``); the Samples carry no image."""
        items = []
        # a CPU decoder writes each image into its slot (no image of its own, no copy
        # after); a subclass's own items are taken as it makes them
        into = (type(self).__getitem__ is FolderStorage.__getitem__
                and type(self).decode_data is FolderStorage.decode_data)
        for k in positions:
            item = self._item(indices[k], out[k]) if into else self[indices[k]]
            if isinstance(item, Sample):
                if item.image.data_ptr() != out[k].data_ptr():
                    out[k].copy_(item.image)
                item = dataclasses.replace(item, image=None)
            items.append(item)
        return items

    def pack(self, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.decode.pack(images)

    def gather(self, index: torch.Tensor, out: torch.Tensor | None = None, rows=None
               ) -> tuple[dict | None, list[SkippedFile]]:
        """One batch decoded in this process, each image written into ``out`` (when given);
        decoding threads are the threaded loader's (``rows`` is for gathers)."""
        items = self.__getitems__(index.tolist())
        samples = [s for s in items if isinstance(s, Sample)]
        skipped = [s for s in items if isinstance(s, SkippedFile)]
        if not samples:
            return None, skipped
        if out is not None and samples[0].image.shape == out.shape[1:]:
            pixels = {"image": torch.stack([s.image for s in samples], out=out[: len(samples)])}
        else:
            pixels = self.pack([s.image for s in samples])
        return {**pixels, **batch_fields(samples)}, skipped

    def example(self, n: int, items: range | None = None) -> torch.Tensor:
        """``n`` decoded images (the first decodable files, or of ``items``, repeated to
        fill ``n``)."""
        decoder = self.decode.image_decoder
        images, missing, broken = [], [], []
        items = items if items is not None else range(min(2 * n, len(self)))
        tried = len(items)
        for index in items:
            try:
                images.append(decoder(self.read(index)))
            except FileNotFoundError:
                missing.append(os.path.normpath(os.path.join(self.root, self.name_of(index))))
                continue
            except (CorruptImageError, OSError) as e:
                broken.append(f"{self.name_of(index)}: {e}")
                continue
            if len(images) == n:
                break
        if not images:  # say why: files that are not there are not undecodable ones
            why = [f"{len(missing)} do not exist (e.g. {missing[0]})" if missing else "",
                   f"{len(broken)} cannot be decoded (e.g. {broken[0]})" if broken else ""]
            raise DatasetError(f"none of the first {tried} images of {self.root} can be "
                               f"read: {'; '.join(w for w in why if w)}")
        return cycle_rows(torch.stack(images), n)

    def probes(self, batch_size: int, device: torch.device | None = None
               ) -> dict[str, Probe]:
        """Reading one file, decoding one image, collating one batch (each on one core)."""
        items = list(range(min(len(self), max(batch_size, 32))))
        data = self._decodable(items)
        counter = iter(range(10**12))

        def read() -> int:
            self.read(items[next(counter) % len(items)])
            return 1

        probes: dict[str, Probe] = {"read": read}
        if data and isinstance(self.decode, ImageDecoder):  # nvjpeg decodes on the GPU
            def decode() -> int:
                self.decode(data[next(counter) % len(data)])
                return 1

            samples = [Sample(self.decode(data[0]), 0, i) for i in range(batch_size)]

            def collate() -> int:
                self.pack([s.image for s in samples])
                batch_fields(samples)
                return batch_size

            probes.update(decode=decode, collate=collate)
        return probes

    def _decodable(self, items: list[int], want: int = 16) -> list[bytearray | memoryview]:
        """Bytes of up to ``want`` items the decoder can read (corrupt ones left out)."""
        found = []
        for index in items:
            try:
                data = self.read(index)
                self.decode.image_decoder(data)
            except (CorruptImageError, OSError):
                continue
            found.append(data)
            if len(found) == want:
                break
        return found


def open_folder(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True, decode: ImageDecoder | None = None) -> FolderStorage:
    """The images at ``path`` (a folder or a manifest), each decoded on every epoch with
    ``loader.decoder`` at ``dataset.image_size`` and ``dataset.crop`` (or with ``decode``:
    a store built from the folder decodes its own way)."""
    decode = decode or folder_decoder(loader, dataset)
    # listed (by its kind's labels, if its kind has any), and read from where they are,
    # decided once
    files = open_files(dataset, path, TARGETS[dataset.targets.kind].list_labelled)
    return FolderStorage(files, decode, dataset.on_corrupt)


def folder_decoder(loader: LoaderConfig, dataset: DatasetConfig) -> ImageDecoder | ReadBytes:
    """What decodes a folder's images: ``loader.decoder`` at ``dataset.image_size`` and
    ``dataset.crop`` (bytes read for the GPU's decode)."""
    check_decoder(loader.decoder)
    decode = ImageDecoder(loader.decoder, tuple(dataset.image_size), dataset.crop,
                          loader.draft, dataset.crop_fraction)
    if DECODERS[loader.decoder].cuda:  # read bytes; the GPU decodes (nvjpeg.py)
        decode = ReadBytes(ImageDecoder(FALLBACK, decode.size, decode.crop,
                                        fraction=decode.fraction))
    return decode


def source_footprint(dataset: DatasetConfig, folder: FolderStorage) -> StoreFootprint:
    if not folder.source.local:
        return StoreFootprint("the source objects (remote)", 0, on_disk=False)
    total = sum(os.path.getsize(p) for p in folder.files if os.path.exists(p))
    return StoreFootprint("the source files", total, on_disk=False)


KIND = StorageKind(
    name=StorageName.folder,
    open=open_folder,
    storage=FolderStorage,
    summary="an image folder, every image read and decoded on every epoch",
    decoders=frozenset(Decoder),
    knobs=("loader.decoder", "loader.draft", "loader.num_workers"),
    advice={"decode": "loader=packed (re-encoded once at dataset.store_size: less to decode)"},
    bench={"folder_simplejpeg_draft": ("loader=folder", "loader.decoder=simplejpeg",
                                       "loader.draft=true"),
           "folder_region": ("loader=folder", "loader.decoder=region")},
    footprint=source_footprint,
    speed_rank=3,
    urls=True,
    boxes=True,
    masks=True,
)
