"""``loader=shards``: WebDataset tar shards, on local disk or in a store, decoded every epoch.

``dataset.path`` is a shard set (a folder or URL prefix holding ``manifest.json`` or
``*.tar``; or the ``manifest.json`` itself) or an image folder, which is converted once:
packed at ``dataset.store_size`` (packed.py), then written as shards into the cache
(``python -m runner.prepare shards ... out=<folder or URL>`` writes them anywhere). The
format is WebDataset's, with an index per shard (tarformat.py); a tar set someone else
wrote is indexed on first use, the index cached under ``dataset.cache_dir``.

**Reading.** Samples are decoded as packed's are (the same decoders, crop, DCT-scaled and
region decode: ``PackedStorage.decode_slice``); a sample is one ``pread`` from its shard.
Every sample's bytes are checked against the CRC-32 in the index: a mismatch reads as an
unreadable file named ``<shard>/<key>``, skipped or (``dataset.on_corrupt=fail``) an error.

**Boxes** (``dataset.targets``, detection): each sample's ``<key>.json`` beside its JPEG
(tarformat.py) is read with it, in one ``pread`` (or range request) of the two adjacent
members (``sample_spans``), its boxes parsed there and handed to the crop the JPEG is
decoded with (``ShardTargets``): the same ``follow()`` of packed and folder, in the
stored image's pixels. ``prepare shards`` of a detection set writes them; a shard set
without them under ``dataset.targets`` is a DatasetError saying so, and a sample whose
member is missing or not boxes is an unreadable sample (skipped and counted). Remote sets
read the same spans through the same source.

**Any other target** (masks): each sample's ``<key>.<blob_ext>`` member (its kind's blob,
tarformat.py) is read with its JPEG in the same one ``pread`` and handed, unread, to its
kind's record (``ShardBlobs``: ``from_blob``, then ``sample_fields`` through the crop, as
on packed and folder). The member columns (``box_offsets``, ``box_sizes``) then hold the
blob's; a set without them under ``dataset.targets=masks`` is a DatasetError saying so.

**Order.** Shards are shuffled in blocks of ``SHARDS_PER_BLOCK`` and the samples of a block
among themselves (``BatchOrder`` with ``groups``): a function of (seed, epoch) and the shard
set, so a resumed run reads exactly what an uninterrupted one does, on every rank. A set
``prepare shards`` wrote holds its samples in a shuffled order with each one's place in the
dataset (the index's ``positions``): the storage numbers its samples by that place, so
sample ``i`` is the dataset's ``i`` as on packed and an unshuffled epoch reads the dataset
order, and hands the order the shards' members (``order_members``: the sample at each
place of the shards), so a shuffled epoch still reads a block of shards at a time.

**What a set holds, said.** A sample is named by its source name when the index keeps
one (shards made of a folder: ``cat/001.jpg``; a foreign tar: its member), else by
``<shard>/<key>``. A key met twice (a shard copied beside itself) is read once: the copies
are counted in one warning and in ``shard_duplicates_skipped``. A manifest's shard whose
``.idx.json`` is missing is indexed again from its tar (said once); a ``.tar`` beside a
manifest that does not list it is named in one line and not read; the files a conversion
skipped (the manifest's ``skipped``) are in the run's ``skipped_files``.

**Remote shards** (``dataset.path=s3://...``): fetched ahead of need, whole, into the
node-local cache bounded by ``dataset.cache_bytes`` (runner/data/sources/shardstream.py, shardcache.py);
a cold start's first batches, and samples the cache has no room for, by range requests.
Writing shards: shardwrite.py.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.common.text import human_bytes
from runner.config.schema import DatasetConfig, LoaderConfig, StorageName, TargetName
from runner.data.decode.decoders import DECODERS
from runner.data.order import BatchOrder, split_padding
from runner.data.protocol import SkippedFile, StorageKind, StoreFootprint
from runner.data.sources.listing import DatasetError
from runner.data.sources.shardstream import SHARDS_PER_BLOCK, RemoteShards
from runner.data.sources.url import RemoteURL, is_url
from runner.data.storage.folder import FolderStorage
from runner.data.storage.packed import PackedStorage, packed_spec
from runner.data.storage.shardwrite import build_shards, cache_folder, convert_to_shards
from runner.data.storage.tarformat import (
    BOX_EXT,
    MANIFEST,
    SHARD_LIST,
    ShardIndex,
    index_name,
    index_tar,
    load_json,
)
from runner.data.targets import TARGETS

log = logging.getLogger(__name__)

# the members a tar someone else wrote may hold a target's blob in (each kind's extension)
BLOB_EXTS = tuple(k.blob_ext for k in TARGETS.values() if k.blob_ext)
BOX_GAP = 4096  # at most this many bytes between a sample's image and its boxes read as one

# --- where the shards are -----------------------------------------------------------------

class LocalShards:
    """Shards in a local folder: a sample is one ``pread``."""

    remote = False

    def __init__(self, folder: Path, names: list[str]):
        self.folder, self.names = Path(folder), names
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "names": self.names}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"], state["names"])

    def path(self, shard: int) -> Path:
        return self.folder / self.names[shard]

    def read(self, shard: int, offset: int, size: int, index: int) -> bytes:
        fd = self._fds.get(shard)
        if fd is None:
            with self._lock:  # one descriptor per shard, however many threads ask at once
                fd = self._fds.get(shard)
                if fd is None:
                    fd = self._fds[shard] = os.open(self.path(shard), os.O_RDONLY)
        return os.pread(fd, size, offset)

    def will_need(self, index: list[int]) -> None:
        """Nothing: the page cache reads ahead on its own."""

    def figures(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# --- the storage --------------------------------------------------------------------------

class ShardsStorage(PackedStorage):
    """The samples of a shard set (the ``Storage`` protocol), decoded per epoch as packed's
    stored JPEGs are.

    Args:
        root: the shard set's location (a folder or a URL).
        indexes: each shard's index.
        classes: class names by index.
        decode: the decoder (the folder's ``ImageDecoder`` or ``ReadBytes``).
        on_corrupt: skip or fail on a sample that does not decode or fails its CRC.
        source: where the bytes come from (``LocalShards`` or ``RemoteShards``).
    """

    group_block = SHARDS_PER_BLOCK
    # a shard set written elsewhere may hold rotated, CMYK or PNG images (its index says
    # which): the GPU decode parses each header, as for a folder
    stored_upright = False

    def __init__(self, root: str | Path, indexes: list[ShardIndex], classes: list[str],
                 decode, on_corrupt, source: LocalShards | RemoteShards,
                 skipped: list[SkippedFile] = (), duplicates: int = 0, boxes: bool = False,
                 category_ids: list[int] | None = None, blobs: str | None = None):
        self.root, self.classes = root, classes
        self.decode, self.on_corrupt = decode, on_corrupt
        self.known_skipped = list(skipped)  # what the conversion to shards skipped
        self.duplicates = duplicates  # samples of a key met before, not read
        self.samples, self.offsets, self.sizes = [], [], []
        self.heights, self.widths, self.crcs, self.shard_of = [], [], [], []
        # the target's member (boxes' .json, or a kind's blob); what a read takes
        self.box_offsets, self.box_sizes, self.spans = [], [], []
        self.order_groups = [0]
        self.order_members = None  # the sample at each place of the shards (None: in order)
        upright = True
        for k, index in enumerate(indexes):
            self.samples += [(f"{index.shard}/{key}", label)
                             for key, label in zip(index.keys, index.labels)]
            self.offsets += index.offsets
            self.sizes += index.sizes
            self.heights += index.heights
            self.widths += index.widths
            self.crcs += index.crcs
            offsets, sizes = member_columns(index, blobs)
            self.box_offsets += offsets or [-1] * len(index)
            self.box_sizes += sizes or [0] * len(index)
            self.spans += sample_spans(index, boxes, blobs)
            self.shard_of += [k] * len(index)
            self.order_groups.append(len(self.samples))
            upright = upright and all(index.upright)
        self.upright = upright
        names = [n for index in indexes for n in index.names]
        inverse = dataset_order(indexes)
        if inverse is not None:  # numbered by place in the dataset
            for column in ("samples", "offsets", "sizes", "heights", "widths", "crcs",
                           "shard_of", "box_offsets", "box_sizes", "spans"):
                values = getattr(self, column)
                setattr(self, column, [values[k] for k in inverse])
            names = [names[k] for k in inverse]
            self.order_members = torch.tensor([p for i in indexes for p in i.positions])
        # the source names where the index keeps them, one per sample
        self.source_names = names if all(names) and len(set(names)) == len(names) else None
        self.source = source
        self.spec, self.cache = None, None
        self.data_bytes = sum(self.sizes)
        self.path = None
        self._last = threading.local()  # per decode thread: the boxes of the sample it read
        self.targets = ShardTargets(self, category_ids) if boxes else None
        if blobs is not None:  # another kind's targets, as its blobs
            self.targets = ShardBlobs(self, TargetName(blobs), category_ids)
        # per sample, once its boxes were read: its id and upright source size (for the
        # detections a run serves; -1: not read yet)
        self.served = np.full((len(self.samples), 3), -1, dtype=np.int64) if boxes else None

    def __del__(self) -> None:
        pass  # the source owns the descriptors

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_last"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._last = threading.local()

    def name_of(self, index: int) -> str:
        """The sample's source name (what predictions name it by), else ``<shard>/<key>``."""
        if getattr(self, "source_names", None) is not None:
            return self.source_names[index]
        return self.samples[index][0]

    def follow(self, order: BatchOrder) -> None:
        """The batch order this storage is read in (its blocks of shards, to fetch ahead)."""
        self.source.order = order

    def example(self, n: int, items: range | None = None) -> torch.Tensor:
        """``n`` decoded images of the shard this rank reads first: on several nodes, none
        fetches a shard of another node's lanes to trace or verify a model."""
        order = getattr(self.source, "order", None)
        if items is None and order is not None:
            blocks = order.group_blocks(order.coming_epoch)
            if blocks and blocks[0]:
                shard = blocks[0][0]
                start = self.order_groups[shard]
                items = range(start, min(self.order_groups[shard + 1], start + 2 * n))
                if self.order_members is not None:
                    items = self.order_members[items.start:items.stop].tolist()
        return super().example(n, items)

    @property
    def files(self) -> list[str]:
        if self.source.remote:
            return []
        return [str(self.source.path(k)) for k in range(len(self.source.names))]

    @property
    def native_batches(self) -> bool:
        return self.upright and PackedStorage.native_batches.func(self)

    def will_need(self, index: torch.Tensor) -> None:
        self.source.will_need(split_padding(index)[0].tolist())

    def read(self, index: int) -> bytes:
        """Sample ``index``'s JPEG, checked against its CRC-32 (a mismatch is an OSError
        naming ``<shard>/<key>``: skipped, or with on_corrupt=fail an error)."""
        size = self.sizes[index]
        start, length = self.spans[index]
        data = self.source.read(self.shard_of[index], start, length, index)
        if self.targets is not None and len(data) == length:  # the JPEG and its boxes
            at, box_at, box_size = self.offsets[index] - start, \
                self.box_offsets[index] - start, self.box_sizes[index]
            if 0 <= box_at and box_at + box_size <= length:  # read with the JPEG
                boxes = data[box_at:box_at + box_size]
            else:  # not beside it (a tar written another way): a read of its own
                boxes = self.source.read(self.shard_of[index], self.box_offsets[index],
                                         box_size, index) if box_size > 0 else b""
            self._last.item = (index, self.parse_boxes(index, boxes)
                               if isinstance(self.targets, ShardTargets)
                               else self.check_blob(index, boxes))
            data = data[at:at + size]
        if len(data) != size or zlib.crc32(data) != self.crcs[index]:
            raise OSError(f"{self.root}/{self.samples[index][0]}: its bytes fail the CRC-32 "
                          "of the shard's index (a damaged or changed shard)")
        return data

    def last_target(self, index: int):
        """Sample ``index``'s target as ``read`` left it for this decode thread (its boxes
        parsed, or its kind's blob checked), read again when the thread's last read was
        another sample."""
        last = getattr(self._last, "item", None)
        if last is None or last[0] != index:
            self.read(index)
            last = self._last.item
        return last[1]

    def parse_boxes(self, index: int, data: bytes):
        """Sample ``index``'s ``<key>.json`` as its ``ImageTargets`` in pixels of its stored
        image (boxes given for another ``height`` x ``width`` scaled to it); an OSError
        naming the member when it is missing or not boxes (an unreadable sample)."""
        from runner.data.sources.labels import ImageTargets

        where = f"{self.root}/{self.samples[index][0]}.{BOX_EXT}"
        if not data:
            raise OSError(f"{where} is missing: a detection sample needs its boxes beside "
                          "its image")
        try:
            entry = json.loads(data)
            boxes = torch.tensor(entry["boxes"], dtype=torch.float32).reshape(-1, 4)
            labels = torch.tensor(entry["labels"], dtype=torch.int64).reshape(-1)
            if len(boxes) != len(labels):
                raise ValueError(f"{len(boxes)} boxes and {len(labels)} labels")
            h, w = int(entry.get("height", 0)), int(entry.get("width", 0))
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise OSError(f"{where} is not boxes ({type(e).__name__}: {e}): it needs "
                          '{"boxes": [[x1, y1, x2, y2], ...], "labels": [...]} in pixels of '
                          "the image") from e
        sh, sw = self.heights[index], self.widths[index]
        if h and w and (h, w) != (sh, sw) and self.upright:  # to the pixels decoded
            boxes = boxes * torch.tensor([sw / w, sh / h] * 2, dtype=torch.float32)
            h, w = sh, sw
        image_id = int(entry.get("image_id", index))
        source = entry.get("source") or (h, w)  # the stored size, for a set without it
        self.served[index] = (image_id, int(source[0]), int(source[1]))
        return ImageTargets(boxes, labels, h, w, image_id)

    def check_blob(self, index: int, data: bytes) -> bytes:
        """Sample ``index``'s target blob as read; an OSError naming the member when it is
        missing (an unreadable sample)."""
        if not data:
            ext = TARGETS[self.targets.kind].blob_ext
            raise OSError(f"{self.root}/{self.samples[index][0]}.{ext} is missing: a "
                          f"{self.targets.kind.value} sample needs its blob beside its image")
        return bytes(data)

    def check_stored(self, index: int, data: bytes | bytearray) -> None:
        """Nothing more: ``read`` checked the CRC already."""

    def figures(self) -> dict[str, Any]:
        out = self.source.figures()
        if self.duplicates:
            out["shard_duplicates_skipped"] = self.duplicates
        return out

    def close(self) -> None:
        self.source.close()


class ShardTargets:
    """A shard set's boxes, as the storage's ``targets``: ``targets[i]`` is the boxes of
    sample ``i`` that the decode thread asking for them has just read with its JPEG
    (``ShardsStorage.read``), else read again."""

    format = "shards"
    skipped: list[SkippedFile] = []  # the labels' bad input: the manifest's skipped files
    kind = TargetName.boxes  # what they are: runner/data/targets/' record

    def __init__(self, storage: ShardsStorage, category_ids: list[int] | None = None):
        self.storage = storage
        self.category_ids = category_ids  # COCO's id of each class (the manifest's)

    def _served(self, index: int) -> np.ndarray:
        row = self.storage.served[index]
        if row[0] < 0:  # not read in this process yet
            self.storage.read(index)
        return row

    def image_id(self, index: int) -> int:
        return int(self._served(index)[0])

    def source_size(self, index: int) -> tuple[int, int]:
        """Sample ``index``'s upright source size (its ``<key>.json``'s ``source``; the
        stored size for a set written without it)."""
        row = self._served(index)
        return int(row[1]), int(row[2])

    def __len__(self) -> int:
        return len(self.storage)

    def __getitem__(self, index: int):
        return self.storage.last_target(index)


class ShardBlobs:
    """A shard set's targets kept as their kind's blobs (masks), as the storage's
    ``targets``: ``target(i)`` is sample ``i``'s, from the blob the decode thread asking
    has just read with its JPEG (``ShardsStorage.read``), else read again, given back by
    the kind's ``from_blob``. Its size is the stored image's, which is its source size here
    (the shards keep no other), and its id its place."""

    format = "shards"
    skipped: list[SkippedFile] = []

    def __init__(self, storage: ShardsStorage, kind: TargetName,
                 category_ids: list[int] | None = None):
        self.storage, self.kind, self.category_ids = storage, kind, category_ids

    def __len__(self) -> int:
        return len(self.storage)

    def target(self, index: int):
        return TARGETS[self.kind].from_blob(self.storage.last_target(index))

    def source_size(self, index: int) -> tuple[int, int]:
        return self.storage.heights[index], self.storage.widths[index]

    def image_id(self, index: int) -> int:
        return index


# --- opening a shard set ------------------------------------------------------------------

def member_columns(index: ShardIndex, blobs: str | None
                   ) -> tuple[list[int] | None, list[int] | None]:
    """The (offsets, sizes) of each sample's target member: its blob's with ``blobs`` (a
    target kind kept as blobs), else its boxes'."""
    if blobs is not None:
        return index.blob_offsets, index.blob_sizes
    return index.box_offsets, index.box_sizes


def sample_spans(index: ShardIndex, boxes: bool, blobs: str | None = None
                 ) -> list[tuple[int, int]]:
    """(offset, size) of what one read of each sample of ``index`` takes: its image, and
    with ``boxes`` (or ``blobs``) its target's member too when the two are near (adjacent
    in shards the runner writes: one header block between them)."""
    offsets, sizes = member_columns(index, blobs)
    if not (boxes or blobs) or offsets is None:
        return list(zip(index.offsets, index.sizes))
    spans = []
    for o, s, bo, bs in zip(index.offsets, index.sizes, offsets, sizes):
        start, end = min(o, bo), max(o + s, bo + bs)
        near = bs > 0 and bo >= 0 and end - start <= s + bs + BOX_GAP
        spans.append((start, end - start) if near else (o, s))
    return spans


def check_blobs(indexes: list[ShardIndex], dataset: DatasetConfig, where: str | Path
                ) -> str | None:
    """The target kind whose blobs the samples carry (``dataset.targets`` of a kind kept
    as blobs: masks), or None; a DatasetError when the set holds none to read."""
    kind = TARGETS[dataset.targets.kind]
    if kind.to_blob is None:
        return None
    without = [i.shard for i in indexes if i.blob_sizes is None
               or not any(s > 0 for s in i.blob_sizes)]
    if without:
        raise DatasetError(
            f"dataset.targets={dataset.targets.value}: the shards at {where} hold no "
            f"{kind.name.value} (no <key>.{kind.blob_ext} member beside the images of "
            f"{without[0]}{f' and {len(without) - 1} more' if len(without) > 1 else ''}): "
            "write the shards of your set with python -m runner.prepare shards "
            f"dataset.targets={dataset.targets.value} dataset.path=<its folder> "
            "out=<folder or URL>, or leave dataset.targets=none")
    return kind.name.value


def check_boxes(indexes: list[ShardIndex], dataset: DatasetConfig, where: str | Path) -> bool:
    """Whether the samples' boxes are read (``dataset.targets``); a DatasetError when the
    set holds none to read."""
    if not dataset.targets.boxes:
        return False
    without = [i.shard for i in indexes if i.box_sizes is None
               or not any(s > 0 for s in i.box_sizes)]
    if without:
        raise DatasetError(
            f"dataset.targets={dataset.targets.value}: the shards at {where} hold no boxes "
            f"(no <key>.{BOX_EXT} member beside the images of {without[0]}"
            f"{f' and {len(without) - 1} more' if len(without) > 1 else ''}): write the "
            "shards of your detection set with python -m runner.prepare shards "
            f"dataset.targets={dataset.targets.value} dataset.path=<its folder> "
            "out=<folder or URL>, or leave dataset.targets=none")
    return True


def dataset_order(indexes: list[ShardIndex]) -> list[int] | None:
    """The place in the shards of each sample of the dataset, in dataset order, when every
    index records its samples' ``positions`` and together they number the dataset once
    (else None: the samples are numbered as the shards hold them)."""
    if not indexes or any(i.positions is None or len(i.positions) != len(i) for i in indexes):
        return None
    positions = [p for i in indexes for p in i.positions]
    inverse = [-1] * len(positions)
    for place, p in enumerate(positions):
        if not 0 <= p < len(positions) or inverse[p] != -1:
            return None
        inverse[p] = place
    return inverse


def _local_set(folder: Path, dataset: DatasetConfig
               ) -> tuple[list[ShardIndex], list[str], list[SkippedFile], list[int] | None]:
    """The indexes, classes, the conversion's skipped files and a detection set's COCO
    category ids of a local shard set (its manifest, else its ``*.tar`` indexed now and
    cached)."""
    manifest = folder / MANIFEST
    cache = cache_folder(dataset, "index", str(folder.resolve()))
    if manifest.is_file():
        meta = load_json(manifest.read_text(), str(manifest))
        indexes = [_manifest_index(folder, s, cache) for s in meta[SHARD_LIST]]
        listed = {s["name"] for s in meta[SHARD_LIST]}
        foreign = sorted(p.name for p in folder.glob("*.tar") if p.name not in listed)
        if foreign:
            log.warning("dataset.path=%s: %s beside its %s %s not listed there and not read "
                        "(list it, or move it to a folder of its own)", folder,
                        ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more"
                                                  if len(foreign) > 5 else ""),
                        MANIFEST, "is" if len(foreign) == 1 else "are")
        return indexes, list(meta.get("classes", [])), _skipped_of(meta), \
            meta.get("category_ids")
    tars = sorted(p.name for p in folder.glob("*.tar"))
    cache.mkdir(parents=True, exist_ok=True)
    return [_cached_index(folder / name, cache) for name in tars], [], [], None


def _cached_index(tar: Path, cache: Path) -> ShardIndex:
    """The index of the tar ``tar`` (made now, or the one cached for its size and time)."""
    st = tar.stat()
    saved = cache / f"{index_name(tar.name)}.{st.st_size}.{st.st_mtime_ns}"
    if saved.is_file():
        return ShardIndex.from_json(json.loads(saved.read_text()))
    with open(tar, "rb") as f:
        index = index_tar(f, tar.name, st.st_size, BLOB_EXTS)
    saved.write_text(json.dumps(index.to_json()))
    return index


def _manifest_index(folder: Path, entry: dict, cache: Path) -> ShardIndex:
    """The index a manifest lists for a shard; indexed again from the tar (cached, and
    said) when its ``.idx.json`` is missing or unreadable, a DatasetError when the tar is
    missing too."""
    path = folder / entry["index"]
    problem = "is missing"
    if path.is_file():
        try:
            return ShardIndex.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as e:  # cut short, or not an index
            problem = f"cannot be read ({type(e).__name__})"
    tar = folder / entry["name"]
    if not tar.is_file():
        raise DatasetError(f"dataset.path={folder}: its {MANIFEST} lists {entry['name']}, "
                           "which is not there; restore it, or write the shards again "
                           "(python -m runner.prepare shards ... out=<folder>)")
    log.warning("dataset.path=%s: %s %s: %s indexed again from the tar (its source names "
                "are lost; write the shards again to keep them)", folder, entry["index"],
                problem, entry["name"])
    cache.mkdir(parents=True, exist_ok=True)
    return _cached_index(tar, cache)


def _skipped_of(meta: dict) -> list[SkippedFile]:
    """The files a conversion to shards skipped (the manifest's ``skipped``)."""
    return [SkippedFile(str(s.get("path", "")), str(s.get("error", "")),
                        label=bool(s.get("label")))
            for s in meta.get("skipped", []) if isinstance(s, dict)]


def _without_duplicates(indexes: list[ShardIndex], root: str | Path
                        ) -> tuple[list[ShardIndex], int]:
    """The indexes with every sample whose key, source name, size and CRC were met in an
    earlier shard left out: a shard copied beside itself is read once. The copies are
    counted and said in one warning."""
    seen: set[tuple] = set()
    dropped: dict[str, int] = {}
    out = []
    for index in indexes:
        keep = []
        # a copy repeats the key, the name, the size and the bytes' CRC: foreign tars whose
        # keys restart in each shard (cat.tar and dog.tar both holding 0001.jpg) differ there
        for k, sample in enumerate(zip(index.keys, index.names, index.sizes, index.crcs)):
            if sample in seen:
                dropped[index.shard] = dropped.get(index.shard, 0) + 1
            else:
                seen.add(sample)
                keep.append(k)
        if len(keep) < len(index):
            columns = {f: [getattr(index, f)[k] for k in keep]
                       for f in index.__dataclass_fields__
                       if isinstance(getattr(index, f), list)}
            index = ShardIndex(**{**index.__dict__, **columns})
        if len(index):  # a shard wholly a copy is not read at all
            out.append(index)
    count = sum(dropped.values())
    if count:
        log.warning("dataset.path=%s: %d sample(s) repeat a key of an earlier shard (%s): "
                    "each is read once (a shard copied beside itself? remove the copy)",
                    root, count, ", ".join(f"{s}: {n}" for s, n in sorted(dropped.items())))
    return out, count


def _classes_of(indexes: list[ShardIndex]) -> list[str]:
    top = max((max(i.labels, default=-1) for i in indexes), default=-1)
    return [str(k) for k in range(top + 1)]


def is_shard_set(path: Path) -> bool:
    return (path / MANIFEST).is_file() or any(path.glob("*.tar"))


def _remote_set(url: RemoteURL, dataset: DatasetConfig, engine, cache
                ) -> tuple[list[ShardIndex], list[str], list[SkippedFile], list[int] | None]:
    """As ``_local_set``, of a shard set in a store: its manifest and indexes
    (fetched together; a shard whose index is not in the store indexed from its tar, and
    said), else its ``*.tar`` fetched through the cache and indexed once."""
    store = engine.store
    objects = {o.key: o for o in store.list(url.prefix)}
    manifest_key = url.key(MANIFEST)
    if manifest_key in objects:
        meta = load_json(store.get(manifest_key), str(url.child(MANIFEST)))
        entries = meta[SHARD_LIST]
        lost = [e for e in entries if url.key(e["index"]) not in objects]
        for e in lost:
            if url.key(e["name"]) not in objects:
                raise DatasetError(f"dataset.path={url}: its {MANIFEST} lists {e['name']}, "
                                   "which is not there; restore it, or write the shards "
                                   "again (python -m runner.prepare shards ... out=<URL>)")
            log.warning("dataset.path=%s: %s is missing: %s indexed again from the tar (its "
                        "source names are lost; write the shards again to keep them)", url,
                        e["index"], e["name"])
        found = iter(_node_indexes(url, {**meta, SHARD_LIST: [e for e in entries
                                                              if e not in lost]},
                                   objects, engine, cache))
        indexes = [_remote_tar_index(url, url.key(e["name"]), objects, engine, cache)
                   if e in lost else next(found) for e in entries]
        return indexes, list(meta.get("classes", [])), _skipped_of(meta), \
            meta.get("category_ids")
    tars = sorted(k for k in objects if k.endswith(".tar"))
    if not tars:
        raise DatasetError(f"dataset.path={url} holds no {MANIFEST} and no .tar shards")
    indexes = [_remote_tar_index(url, key, objects, engine, cache) for key in tars]
    return indexes, _classes_of(indexes), [], None


def _remote_tar_index(url: RemoteURL, key: str, objects: dict, engine, cache) -> ShardIndex:
    """The index of the tar ``key`` in the store, fetched and indexed once (cached by its
    size and etag)."""
    name = key[len(url.prefix) + 1:] if url.prefix else key
    info = objects[key]
    saved = cache.folder / f"{index_name(name).replace('/', '__')}.{info.size}.{info.etag}"
    if saved.is_file():
        return ShardIndex.from_json(json.loads(saved.read_text()))
    with tempfile.TemporaryFile(dir=cache.folder) as f:
        f.write(bytes(engine.get(key, info.size).result()))
        f.seek(0)
        index = index_tar(f, name, info.size, BLOB_EXTS)
    saved.write_text(json.dumps(index.to_json()))
    return index


def _node_indexes(url: RemoteURL, meta: dict, objects: dict, engine, cache
                  ) -> list[ShardIndex]:
    """The indexes a shard set's manifest lists, fetched once per node into its cache
    folder (under a file lock: the ranks of a node and concurrent jobs share one copy; an
    index whose size or etag changed is fetched again). Saved as ``.json``: outside the
    shards' byte bound and never evicted."""
    from filelock import FileLock

    paths = []
    for entry in meta[SHARD_LIST]:
        info = objects.get(url.key(entry["index"]))
        tag = "".join(c for c in f"{info.size}.{info.etag}" if c.isalnum() or c in ".-_") \
            if info is not None else "unlisted"
        paths.append(cache.folder / f"{entry['index'].replace('/', '__')}.{tag}.json")
    with FileLock(str(cache.folder / "indexes.lock")):
        missing = [k for k, path in enumerate(paths) if not path.is_file()]
        futures = {k: engine.get(url.key(meta[SHARD_LIST][k]["index"])) for k in missing}
        for k, future in futures.items():
            tmp = paths[k].with_name(f"{paths[k].stem}.{os.getpid()}.tmp.json")
            tmp.write_bytes(bytes(future.result()))
            os.replace(tmp, paths[k])  # whole or not at all
    return [ShardIndex.from_json(json.loads(path.read_text())) for path in paths]


def open_remote_shards(loader: LoaderConfig, dataset: DatasetConfig, text: str,
                       decode) -> ShardsStorage:
    from runner.data.sources.objectstore import ObjectStore
    from runner.data.sources.readengine import ReadEngine
    from runner.data.sources.shardcache import ShardCache

    url = RemoteURL.parse(text)
    if url.prefix.endswith(MANIFEST):
        url = RemoteURL(url.scheme, url.bucket, url.prefix[: -len(MANIFEST)].rstrip("/"))
    engine = ReadEngine(ObjectStore(url, dataset.endpoint_url))
    bound = dataset.cache_bytes
    cache = ShardCache(cache_folder(dataset, "remote", f"{url}|{dataset.endpoint_url}"),
                       bound)
    indexes, classes, skipped, category_ids = _remote_set(url, dataset, engine, cache)
    indexes, duplicates = _without_duplicates(indexes, url)
    boxes, blobs = check_boxes(indexes, dataset, url), check_blobs(indexes, dataset, url)
    shard_of = [k for k, i in enumerate(indexes) for _ in range(len(i))]
    spans = [span for i in indexes for span in sample_spans(i, boxes, blobs)]
    inverse = dataset_order(indexes)
    if inverse is not None:  # numbered as ShardsStorage numbers them
        shard_of, spans = [shard_of[k] for k in inverse], [spans[k] for k in inverse]
    largest = max((i.nbytes for i in indexes), default=0)
    if bound < SHARDS_PER_BLOCK * largest:
        log.warning("dataset.cache_bytes=%d holds fewer than a block of shards (%d x %s): "
                    "samples outside it are read by range requests each epoch",
                    bound, SHARDS_PER_BLOCK, human_bytes(largest))
    source = RemoteShards(url, engine, [i.shard for i in indexes], [i.nbytes for i in indexes],
                          cache, shard_of, spans)
    return ShardsStorage(str(url), indexes, classes, decode, dataset.on_corrupt, source,
                         skipped, duplicates, boxes, category_ids, blobs)


def open_shards(loader: LoaderConfig, dataset: DatasetConfig, path: Path | str,
                progress: bool = True) -> ShardsStorage:
    """The shard set at ``path`` (a folder, URL or manifest), or an image folder's shards
    (converted once into the cache)."""
    decode = _decoder(loader, dataset)
    if is_url(path):
        return open_remote_shards(loader, dataset, str(path), decode)
    folder = Path(path).expanduser()
    if folder.name == MANIFEST and folder.is_file():
        folder = folder.parent
    if not (folder.is_dir() and is_shard_set(folder)):
        folder = convert_to_shards(loader, dataset, folder, progress)
    indexes, classes, skipped, category_ids = _local_set(folder, dataset)
    if not classes:
        classes = _classes_of(indexes)
    indexes, duplicates = _without_duplicates(indexes, folder)
    if not indexes:
        raise DatasetError(f"dataset.path={folder} holds no samples in its shards")
    boxes, blobs = check_boxes(indexes, dataset, folder), check_blobs(indexes, dataset, folder)
    source = LocalShards(folder, [i.shard for i in indexes])
    return ShardsStorage(folder, indexes, classes, decode, dataset.on_corrupt, source,
                         skipped, duplicates, boxes, category_ids, blobs)


def _decoder(loader: LoaderConfig, dataset: DatasetConfig):
    """The decoder a folder of ``dataset`` would use (its size, crop and fallbacks)."""
    from runner.data.decode.decoders import FALLBACK, ImageDecoder, check_decoder
    from runner.data.decode.encoded import ReadBytes

    check_decoder(loader.decoder)
    decode = ImageDecoder(loader.decoder, tuple(dataset.image_size), dataset.crop,
                          loader.draft, dataset.crop_fraction)
    if DECODERS[loader.decoder].cuda:
        decode = ReadBytes(ImageDecoder(FALLBACK, decode.size, decode.crop,
                                        fraction=decode.fraction))
    return decode


def shards_footprint(dataset: DatasetConfig, folder: FolderStorage) -> StoreFootprint:
    from runner.data.storage.packed import estimate_bytes

    spec = packed_spec(None, dataset, folder.root)
    return StoreFootprint(f"tar shards of JPEG q{spec.quality} at {spec.store_size}",
                          estimate_bytes(folder, spec), estimated=True)


KIND = StorageKind(
    name=StorageName.shards,
    open=open_shards,
    storage=ShardsStorage,
    summary="WebDataset tar shards (local or a URL, cached on the node), decoded every epoch",
    decoders=frozenset(DECODERS),
    knobs=("loader.decoder", "loader.draft"),
    autotune=False,
    advice={"decode": "a smaller dataset.store_size (fewer pixels to decode per image)"},
    build=build_shards,
    build_options=("out", "shard_mb", "shuffle_seed"),
    footprint=shards_footprint,
    speed_rank=2,
    urls=True,
    boxes=True,
    masks=True,  # as its kind's blob member beside each JPEG (ShardBlobs)
)
