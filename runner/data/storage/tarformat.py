"""The shard format of ``loader=shards``: WebDataset's tar layout, with an index per shard.

A shard is a POSIX tar whose members are ``<key>.jpg`` (the stored JPEG) and ``<key>.cls``
(the class index as decimal text), one pair per sample: what WebDataset, and the tools that
read its layout, read as they are. Beside each shard ``<shard>.idx.json`` holds, per sample,
its key, the byte offset and size of its JPEG inside the tar, its label, the JPEG's height
and width, its CRC-32, its source name and its position in the dataset (``positions``);
``manifest.json`` lists the shards (name, bytes, samples) with the classes, the count and
what the store was made from.

A detection set's shards (``dataset.targets``) hold a third member per sample, right after
its JPEG: ``<key>.json``, ``{"boxes": [[x1, y1, x2, y2], ...], "labels": [class id, ...],
"image_id": id, "height": h, "width": w, "source": [h, w]}``, the boxes xyxy in pixels of
the stored image (``height`` x ``width``, upright), as packed stores them (packed.py), and
the source image's upright size (where served detections go back to; the manifest's
``category_ids`` name COCO's id of each class). The index gives its
offset and size too (``box_offsets``, ``box_sizes``), so the reader takes the JPEG and
its boxes in one ``pread`` (or one range request) of the two adjacent members. A tar
someone else wrote is indexed with its ``.json`` members the same way (``BOX_EXT``).

Any other target (masks) rides as its kind's opaque blob, one member right after the JPEG:
``<key>.<blob_ext>`` (the kind's record names the extension: ``<key>.mask.png``, a PNG of
class ids at the stored image's size, which any WebDataset reader decodes as a PNG), its
offset and size in the index (``blob_offsets``, ``blob_sizes``) and the kind in the
manifest (``blobs``); the shards never look inside. A tar someone else wrote is indexed
with such members too (``blob_exts``).

The samples are written in a shuffled order (a permutation of the dataset drawn from
``shuffle_seed``, recorded in the manifest as ``shuffle``): written in dataset order, a
shard held one or two classes, so the shard shuffle and sample buffer of WebDataset (or any
tool that streams shards) gave batches of one class. The runner reads a shard set with
``positions`` back in dataset order (shards.py), so its own order, by (seed, epoch), is
unaffected.
The index makes a sample one ``pread`` (or one range request) and a shuffled, exactly
resumable order cheap, as MosaicML Streaming's ``index.json`` does.

``write_shards`` writes a packed store's JPEGs (re-encoded once at ``dataset.store_size``,
runner/data/storage/packed.py) as shards of about ``shard_bytes`` each, so DCT-scaled and
region decode and the one crop definition hold on shards as on packed. ``index_tar``
indexes a tar someone else wrote (any WebDataset shard: ``.jpg``/``.jpeg``/``.png``/...
images, an optional ``.cls``); ``loader=shards`` caches that index on first use.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from runner.common.atomic import write_json
from runner.data.decode.decoders import read_jpeg_header

FORMAT, VERSION = "runner-shards", 1
MANIFEST = "manifest.json"
SHARD_LIST = "shards"  # the manifest's list of shards
INDEX_SUFFIX = ".idx.json"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")
LABEL_EXTS = ("cls", "cls2", "label")
BOX_EXT = "json"  # a sample's boxes (detection), beside its image
DEFAULT_SHARD_BYTES = 64 << 20

log = logging.getLogger(__name__)


@dataclass
class ShardIndex:
    """One shard's samples, column by column (``<shard>.idx.json``)."""

    shard: str
    nbytes: int
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    labels: list[int]
    heights: list[int]
    widths: list[int]
    crcs: list[int]
    names: list[str]
    upright: list[bool]  # a JPEG with no EXIF rotation (the batch decode's assumption)
    positions: list[int] | None = None  # each sample's place in the dataset (None: a set
    # written in dataset order, or a tar someone else wrote)
    box_offsets: list[int] | None = None  # each sample's ``<key>.json`` (detection), where
    box_sizes: list[int] | None = None  # its data starts in the tar and its size (None: no
    # sample has one; -1 and 0: this one has none)
    blob_offsets: list[int] | None = None  # each sample's target blob (masks), the same way
    blob_sizes: list[int] | None = None

    OPTIONAL = ("positions", "box_offsets", "box_sizes", "blob_offsets", "blob_sizes")

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION,
                **{k: v for k, v in self.__dict__.items()
                   if k not in self.OPTIONAL or v is not None}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardIndex:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k not in cls.OPTIONAL}
        return cls(**fields, **{k: data.get(k) for k in cls.OPTIONAL})

    @property
    def has_blobs(self) -> bool:
        """Every sample has a target blob member."""
        return self.blob_sizes is not None and all(s > 0 for s in self.blob_sizes)

    @property
    def has_boxes(self) -> bool:
        """Every sample has a boxes member."""
        return self.box_sizes is not None and all(s > 0 for s in self.box_sizes)

    def __len__(self) -> int:
        return len(self.keys)


def index_name(shard: str) -> str:
    return shard.removesuffix(".tar") + INDEX_SUFFIX


def image_facts(data: bytes) -> tuple[int, int, bool]:
    """(height, width, upright) of an image's bytes; JPEGs from their header alone."""
    header = read_jpeg_header(data)
    if header is not None:
        return header.height, header.width, header.orientation == 1 and \
            header.components in (1, 3)
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            return img.height, img.width, False
    except Exception:  # not an image: the decode says so, as for a file
        return 0, 0, False


# --- writing ------------------------------------------------------------------------------

class ShardWriter:
    """Writes samples into tar shards of about ``shard_bytes`` in ``folder``, and the index
    of each; ``close`` returns the shards' manifest entries."""

    def __init__(self, folder: Path, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 pattern: str = "shard-{:06d}.tar"):
        self.folder, self.shard_bytes, self.pattern = Path(folder), shard_bytes, pattern
        self.folder.mkdir(parents=True, exist_ok=True)
        self.entries: list[dict[str, Any]] = []
        self._tar: tarfile.TarFile | None = None
        self._index: ShardIndex | None = None

    def _open(self) -> None:
        name = self.pattern.format(len(self.entries))
        self._file = open(self.folder / (name + ".partial"), "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._index = ShardIndex(name, 0, [], [], [], [], [], [], [], [], [], [])

    def _member(self, name: str, data: bytes) -> int:
        """Add one member; returns the offset of its data in the tar."""
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0  # same bytes on every build
        info.uname = info.gname = ""
        offset = self._tar.offset + tarfile.BLOCKSIZE  # a USTAR header is one block
        self._tar.addfile(info, io.BytesIO(data))
        return offset

    def add(self, key: str, jpeg: bytes, label: int, height: int, width: int,
            name: str, position: int, boxes: bytes | None = None,
            blob: tuple[str, bytes] | None = None) -> None:
        """One sample: its JPEG, its boxes member right after it (``boxes``: the
        ``<key>.json`` bytes, detection only; ``box_json`` makes them) or its target's blob
        (``blob``: its extension and bytes, as its kind's record made them), its class."""
        extra = len(boxes) + 512 if boxes is not None else 0
        extra += len(blob[1]) + 512 if blob is not None else 0
        if self._tar is not None and self._tar.offset + len(jpeg) + extra + 2048 > \
                self.shard_bytes and len(self._index):
            self._finish()
        if self._tar is None:
            self._open()
        index = self._index
        offset = self._member(f"{key}.jpg", jpeg)
        if boxes is not None:
            if index.box_offsets is None:
                index.box_offsets, index.box_sizes = [], []
            index.box_offsets.append(self._member(f"{key}.{BOX_EXT}", boxes))
            index.box_sizes.append(len(boxes))
        if blob is not None:
            if index.blob_offsets is None:
                index.blob_offsets, index.blob_sizes = [], []
            index.blob_offsets.append(self._member(f"{key}.{blob[0]}", blob[1]))
            index.blob_sizes.append(len(blob[1]))
        self._member(f"{key}.cls", str(label).encode())
        for column, value in (("keys", key), ("offsets", offset), ("sizes", len(jpeg)),
                              ("labels", label), ("heights", height), ("widths", width),
                              ("crcs", zlib.crc32(jpeg)), ("names", name), ("upright", True),
                              ("positions", position)):
            getattr(index, column).append(value)

    def _finish(self) -> None:
        self._tar.close()  # writes the end-of-archive blocks
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = self._index.shard
        final = self.folder / name
        os.replace(self.folder / (name + ".partial"), final)
        self._index.nbytes = final.stat().st_size
        write_json(self.folder / index_name(name), self._index.to_json())
        self.entries.append({"name": name, "index": index_name(name),
                             "bytes": self._index.nbytes, "count": len(self._index)})
        self._tar = self._index = None

    def close(self) -> list[dict[str, Any]]:
        if self._tar is not None:
            self._finish()
        return self.entries


def box_json(boxes, labels, image_id: int, height: int, width: int,
             source: tuple[int, int] | None = None) -> bytes:
    """A sample's ``<key>.json``: its boxes (float32 [n, 4] xyxy, pixels of its
    ``height`` x ``width`` stored image), class ids, id and (``source``) its upright source
    size, as JSON (each float32 written so that it reads back the same float32)."""
    entry = {"boxes": [[float(v) for v in row] for row in boxes.tolist()],
             "labels": [int(v) for v in labels.tolist()], "image_id": int(image_id),
             "height": int(height), "width": int(width)}
    if source is not None:
        entry["source"] = [int(source[0]), int(source[1])]
    return json.dumps(entry, separators=(",", ":")).encode()


def write_manifest(folder: Path, entries: list[dict[str, Any]], classes: list[str],
                   **facts: Any) -> dict[str, Any]:
    manifest = {"format": FORMAT, "version": VERSION, "classes": classes,
                "count": sum(e["count"] for e in entries), SHARD_LIST: entries, **facts}
    write_json(Path(folder) / MANIFEST, manifest)
    return manifest


# --- indexing a tar someone else wrote ----------------------------------------------------

def split_key(member: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of its last part, the
    extension the rest (``a/b.c.jpg`` -> ``a/b``, ``c.jpg``)."""
    folder, base = posixpath.split(member)
    stem, _, ext = base.partition(".")
    return posixpath.join(folder, stem) if folder else stem, ext.lower()


def index_tar(fileobj: BinaryIO, shard: str, nbytes: int,
              blob_exts: tuple[str, ...] = ()) -> ShardIndex:
    """The index of a WebDataset tar: per key, its image member (the first of
    ``IMAGE_EXTS``), its label (``.cls``; -1 when there is none), its boxes (``.json``)
    and its target blob (a member of ``blob_exts``, a kind's extension). A tar cut short is
    indexed as far as its member headers go (said once); a sample whose bytes it lost
    stays in the index and reads as unreadable (its size is not there), so it is counted
    in ``skipped_files``."""
    images: dict[str, tuple[int, int, str]] = {}
    labels: dict[str, int] = {}
    boxes: dict[str, tuple[int, int]] = {}
    blobs: dict[str, tuple[int, int]] = {}
    order: list[str] = []
    with tarfile.open(fileobj=fileobj, mode="r:") as tar:
        try:
            for info in _members(tar):
                key, ext = split_key(info.name)
                if ext in blob_exts and key not in blobs:  # before the images: mask.png
                    blobs[key] = (info.offset_data, info.size)
                elif ext in IMAGE_EXTS and key not in images:
                    images[key] = (info.offset_data, info.size, info.name)
                    order.append(key)
                elif ext in LABEL_EXTS and key not in labels:
                    text = tar.extractfile(info).read().decode("utf-8", "replace").strip()
                    labels[key] = int(text) if text.lstrip("-").isdigit() else -1
                elif ext == BOX_EXT and key not in boxes:
                    boxes[key] = (info.offset_data, info.size)
        except (tarfile.ReadError, EOFError) as e:
            log.warning("%s is cut short (%s) after %d sample(s): those past its end are not "
                        "in its index, the last one's bytes read as unreadable", shard, e,
                        len(order))
    index = ShardIndex(shard, nbytes, [], [], [], [], [], [], [], [], [])
    if boxes:
        index.box_offsets = [boxes.get(k, (-1, 0))[0] for k in order]
        index.box_sizes = [boxes.get(k, (-1, 0))[1] for k in order]
    if blobs:
        index.blob_offsets = [blobs.get(k, (-1, 0))[0] for k in order]
        index.blob_sizes = [blobs.get(k, (-1, 0))[1] for k in order]
    for key in order:
        offset, size, name = images[key]
        fileobj.seek(offset)
        data = fileobj.read(size)
        height, width, upright = image_facts(data)
        for column, value in (("keys", key), ("offsets", offset), ("sizes", size),
                              ("labels", labels.get(key, -1)), ("heights", height),
                              ("widths", width), ("crcs", zlib.crc32(data)),
                              ("names", name), ("upright", upright)):
            getattr(index, column).append(value)
    return index


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    for info in tar:
        if info.isfile():
            yield info


def load_json(data: bytes | str, what: str) -> dict[str, Any]:
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"{what} holds a {type(value).__name__}, not an object")
    return value
