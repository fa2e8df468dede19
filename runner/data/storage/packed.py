"""``loader=packed``: every image re-encoded once at a stored size into one file of JPEGs.

For datasets too big to keep decoded: ``dataset.store_size`` (the shorter side, or with
``dataset.store_side=longer`` the longer side at most; never enlarged) keeps what a crop
to ``dataset.image_size`` needs, at ``dataset.store_quality`` (unset: 256 for 224 at
``dataset.crop_fraction=0.875``, so the centre crop is a 224 window of the stored image).
Each epoch decodes the stored JPEGs again (random crops are real random-resized crops of
the whole stored image), with the in-process decode threads, one ``pread`` per image from
one open file: no file opened per image. With ``loader.decoder=region`` (the default) each
thread hands a slice of the batch to the runner's libjpeg binding in one call, without
the GIL: each crop's window decoded at its DCT scale straight into its slot of the batch
(CHW), enlarged there when it is smaller than the output (``PackedStorage.decode_slice``).
The batch stays NCHW, the layout of every storage and of ``runner.pipeline``'s batches:
the binding writes the planes as it decodes each row. (Measured: the same windows decoded
into HWC slots of a 256-image batch took about a fifth less time than into CHW slots,
though one image into one buffer takes the same either way; an NHWC hand-over would move
the transpose into the model's input layer, in float, and is not done.)

A store holds ``images.bin`` (the JPEGs back to back, in dataset order), ``index.bin`` (per
source file: offset, size, stored height and width, label and a CRC-32 of its bytes; size 0
for an undecodable file) beside the engine's ``sources.bin`` and ``meta.json``
(runner/data/storage/convert.py: keyed, fingerprinted, resumable, reserved, published
atomically, checked). The JPEGs are encoded by worker processes and written in index
order, so two builds of the same folder are the same bytes. A stored image that no
longer decodes is checked against its CRC: damage to the store is named as such, with the
command that rebuilds it, instead of blaming a healthy source file. The store's size is
not known before encoding, so the conversion first encodes a sample, reserves the
estimate (a disk too small fails at once) and reserves more if it runs over.

**Detection** (``dataset.targets``): the store holds each image's boxes beside its JPEG,
so a run reads them from the store with the images, not one label file per image.
``boxes.bin`` holds every box, image after image in index order (``BOX_DTYPE``: xyxy
float32 in pixels of the *stored* image, upright, as the listing's source-size boxes
scaled by the stored size over the source size; its int64 class id), and ``targets.bin``
per source file where its boxes start in ``boxes.bin``, how many there are, the image's
id (COCO's, or its place in the label set) and its upright source size (the frame served
detections go back to; ``meta.json`` keeps COCO's category ids); an undecodable file has
none. Both are written
with the JPEGs, chunk by chunk in index order, so two builds are the same bytes. The
store's key has the labels' format (``settings``: a store of the same folder without boxes
is another folder) and its plan the digest of the boxes as the listing parsed them
(convert.py's ``targets_fingerprint``): an edited label file rebuilds the store. The
listing still reads the label files at start-up (to list the images and compare that
digest); the batches' boxes are the store's. For a YOLO layout (not split by
``dataset.val_fraction``) the store also keeps the stats of the files its labels were read
from (``labels.bin``: every label file and class-name file, stat-ed before the listing read
them; their names' digest and the labels' bad input in ``meta.json``), and a run opens a
valid store without reading a label file (``open_without_labels``): the images listed as
the listing lists them, one ``stat`` per label file, the store's metadata checked as the
engine checks it; anything that differs (a label file edited, added or removed, an image
changed) falls back to the full listing, whose digest decides whether to rebuild.

**Any other target** (masks): kept as its kind's opaque blob, the store never knowing
what it is (FFCV's fields): ``blobs.bin`` holds each image's blob back to back, in index
order, as its kind's record wrote it for the stored image's size (``TargetKind.to_blob``:
a mask resized NEAREST to it, a lossless PNG), and ``blobindex.bin`` per source file its
offset and size, the image's id and its upright source size (``BLOB_DTYPE``); the
record's ``from_blob`` gives it back (``StoredBlobs``) and its ``sample_fields`` moves it
through the crop the stored JPEG is cut by, as on a folder. The store's key names the kind
(``settings``: ``blobs``), its plan the kind's ``fingerprint`` (an edited mask rebuilds
it). Boxes keep their own layout above, older than the blobs: fixed-size rows a run and
the YOLO shortcut read as arrays, and stores already built keep their key.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import io
import logging
import math
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image
from tqdm import tqdm

from runner.config.schema import (
    Crop,
    DatasetConfig,
    LoaderConfig,
    StorageName,
    StoreSide,
    TargetName,
)
from runner.data.decode.decoders import (
    DECODERS,
    CorruptImageError,
    ImageDecoder,
    JpegHeader,
    batch_dest,
    read_jpeg_header,
    region_window,
    slot_dest,
    source_window,
    upright_rgb,
    window_dest,
)
from runner.data.order import split_padding, unpad
from runner.data.pool import parallel_imap
from runner.data.protocol import Probe, Sample, SkippedFile, StorageKind, StoreFootprint
from runner.data.storage.convert import (
    META,
    SOURCE_DTYPE,
    SOURCES,
    STAT_FIELDS,
    CacheError,
    Journal,
    StoreSpec,
    changed_files,
    check_files,
    check_skipped,
    chunk_ranges,
    ensure_cache,
    file_record,
    layout_fingerprint,
    read_meta,
    reserve,
    skipped_files,
)
from runner.data.storage.folder import FolderStorage, folder_decoder, open_folder
from runner.data.targets import TARGETS as KINDS  # (TARGETS: the boxes' file)
from runner.measure import timeline

log = logging.getLogger(__name__)

PACKED_VERSION = 2  # 2: a CRC-32 per stored image, written in dataset order
DATA, INDEX = "images.bin", "index.bin"
BOXES, TARGETS = "boxes.bin", "targets.bin"  # detection: the boxes, and each image's
LABELS = "labels.bin"  # detection, YOLO: the stats of the label files read
BOX_DTYPE = np.dtype([("box", "<f4", (4,)), ("label", "<i8")])
# per image: where its boxes start and how many, its id, and its upright source size (the
# frame served detections are mapped back to)
TARGET_DTYPE = np.dtype([("start", "<i8"), ("count", "<i8"), ("image_id", "<i8"),
                         ("source_height", "<i4"), ("source_width", "<i4")])
BLOBS, BLOB_INDEX = "blobs.bin", "blobindex.bin"  # another kind's targets, as blobs
# per image: where its blob starts and its size, its id and its upright source size
BLOB_DTYPE = np.dtype([("offset", "<i8"), ("size", "<i8"), ("image_id", "<i8"),
                       ("source_height", "<i4"), ("source_width", "<i4")])
INDEX_DTYPE = np.dtype([("offset", "<i8"), ("size", "<i8"), ("height", "<i4"),
                        ("width", "<i4"), ("label", "<i8"), ("crc", "<u4"), ("pad", "<u4")])
SAMPLE = 32  # images encoded up front to estimate the store's size
GEOMETRIES = 4096  # crops kept worked out (``fixed_geometry``): one per stored size


def default_store_size(dataset: DatasetConfig) -> int:
    """``dataset.store_size``, else ``image_size``'s larger side / ``dataset.crop_fraction``
    (256 for 224 at 0.875): a centre crop is then a window of the stored image, cut without a
    resize."""
    return int(dataset.store_size or
               math.ceil(round(max(dataset.image_size) / dataset.crop_fraction, 6)))


def stored_hw(height: int, width: int, size: int, side: StoreSide) -> tuple[int, int]:
    """An upright image's stored (height, width): ``size`` along ``side``, aspect kept,
    never larger than it is."""
    scale = size / (min(height, width) if side is StoreSide.shorter else max(height, width))
    if scale >= 1:
        return height, width
    return max(1, round(height * scale)), max(1, round(width * scale))


@dataclass(frozen=True)
class PackedSpec(StoreSpec):
    """What a packed store's bytes depend on; each distinct spec gets its own folder.

    ``selected_by``: the overrides that chose it (its rebuild command), not part of the key.
    """

    source: Path
    store_size: int
    side: StoreSide
    quality: int
    selected_by: tuple[str, ...] = field(default=(), compare=False)
    targets: str | None = None  # detection: the labels' format (the store holds boxes)
    blobs: str | None = None  # the target kind whose blobs it holds (masks)

    kind = StorageName.packed.value
    version = PACKED_VERSION

    def settings(self) -> dict[str, Any]:
        out = {"source": str(self.source), "store_size": self.store_size,
               "side": self.side.value, "quality": self.quality}
        if self.targets is not None:  # a store with boxes is not the one without
            out["targets"] = self.targets
        if self.blobs is not None:  # nor one with masks
            out["blobs"] = self.blobs
        return out

    def label(self) -> str:
        boxes = f"-{self.targets}" if self.targets is not None else ""
        blobs = f"-{self.blobs}" if self.blobs is not None else ""
        return f"{self.side.value}{self.store_size}-q{self.quality}{boxes}{blobs}"

    def overrides(self) -> list[str]:
        return list(self.selected_by) or [
            f"dataset.path={self.source}", f"dataset.store_size={self.store_size}",
            f"dataset.store_side={self.side.value}", f"dataset.store_quality={self.quality}",
            *([f"dataset.targets={self.targets}"] if self.targets is not None else []),
            *([f"dataset.targets={self.blobs}"] if self.blobs is not None else [])]

    def file_sizes(self, folder: Path, meta: dict[str, Any]) -> dict[str, int]:
        if not isinstance(meta.get("data_bytes"), int):
            raise self.damaged(folder, f"its {META} lacks or mistypes: data_bytes")
        sizes = {DATA: meta["data_bytes"], INDEX: meta["count"] * INDEX_DTYPE.itemsize}
        if self.targets is not None:
            if not isinstance(meta.get("boxes"), int):
                raise self.damaged(folder, f"its {META} lacks or mistypes: boxes")
            sizes[BOXES] = meta["boxes"] * BOX_DTYPE.itemsize
            sizes[TARGETS] = meta["count"] * TARGET_DTYPE.itemsize
            if isinstance(meta.get("label_inputs"), dict):
                sizes[LABELS] = meta["label_inputs"].get("count", -1) * SOURCE_DTYPE.itemsize
        if self.blobs is not None:
            if not isinstance(meta.get("blob_bytes"), int):
                raise self.damaged(folder, f"its {META} lacks or mistypes: blob_bytes")
            sizes[BLOBS] = meta["blob_bytes"]
            sizes[BLOB_INDEX] = meta["count"] * BLOB_DTYPE.itemsize
        return sizes

    def convert(self, folder_storage: FolderStorage, journal: Journal, progress: bool
                ) -> dict[str, Any]:
        return _convert(folder_storage, self, journal, progress)


def packed_spec(loader: LoaderConfig, dataset: DatasetConfig, path: Path) -> PackedSpec:
    """What ``loader=packed`` stores: ``dataset.store_size`` (unset:
    ``default_store_size``) at ``dataset.store_quality``."""
    source = Path(path).expanduser().resolve()
    size = default_store_size(dataset)
    picked = (f"dataset.path={source}",
              f"dataset.image_size=[{','.join(str(int(v)) for v in dataset.image_size)}]",
              f"dataset.store_size={size}", f"dataset.store_side={dataset.store_side.value}",
              f"dataset.store_quality={dataset.store_quality}")
    if KINDS[dataset.targets.kind].batch_keys:  # boxes, masks
        picked += (f"dataset.targets={dataset.targets.value}",)
    return PackedSpec(source, size, dataset.store_side, dataset.store_quality,
                      selected_by=picked)


def with_targets(spec: PackedSpec, folder: FolderStorage) -> PackedSpec:
    """``spec`` for ``folder``: keyed by its labels' format when it lists boxes, by the
    target kind when it lists a kind kept as blobs (masks)."""
    format, blobs = None, None
    if folder.targets is not None:
        kind = KINDS[folder.targets.kind]
        if kind.to_blob is not None:
            blobs = kind.name.value
        else:
            format = folder.targets.format
    if (spec.targets, spec.blobs) == (format, blobs):
        return spec
    return dataclasses.replace(spec, targets=format, blobs=blobs)


def keeps_blobs(folder: FolderStorage) -> bool:
    """Whether ``folder``'s targets are kept as their kind's blobs (masks), not boxes."""
    return folder.targets is not None and KINDS[folder.targets.kind].to_blob is not None


# --- encoding -----------------------------------------------------------------------------

def encode_stored(data: bytes | bytearray, spec: PackedSpec) -> tuple[bytes, int, int]:
    """One source file as a stored JPEG: upright (EXIF orientation applied), at the stored
    size, at the spec's quality; a plain JPEG already that small is kept byte for byte.
    Returns (bytes, height, width); raises CorruptImageError when it cannot be decoded."""
    header = read_jpeg_header(data)
    if (header is not None and header.orientation == 1 and header.components in (1, 3)
            and stored_hw(header.height, header.width, spec.store_size, spec.side)
            == (header.height, header.width)):
        return bytes(data), header.height, header.width
    try:
        with Image.open(io.BytesIO(data)) as img:
            swap = img.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # EXIF orientation
            w, h = img.size
            th, tw = stored_hw(*((w, h) if swap else (h, w)), spec.store_size, spec.side)
            img.draft("RGB", (th, tw) if swap else (tw, th))  # JPEG: the DCT scale >= target
            img = upright_rgb(img)
            if img.size != (tw, th):
                img = img.resize((tw, th), Image.Resampling.BILINEAR)
            pixels = np.ascontiguousarray(np.asarray(img))
    except Exception as e:  # PIL raises many kinds for a broken file
        raise CorruptImageError(f"{type(e).__name__}: {e}") from e
    out = simplejpeg.encode_jpeg(pixels, quality=spec.quality, colorspace="RGB",
                                 colorsubsampling="420")
    return out, pixels.shape[0], pixels.shape[1]


def estimate_bytes(folder_storage: FolderStorage, spec: PackedSpec, sample: int = SAMPLE
                   ) -> int:
    """The store's size, extrapolated from ``sample`` images spread over the dataset."""
    n = len(folder_storage)
    picks = sorted({round(k * (n - 1) / max(sample - 1, 1)) for k in range(min(sample, n))})
    sizes = []
    for i in picks:
        try:
            sizes.append(len(encode_stored(folder_storage.read(i), spec)[0]))
        except (CorruptImageError, OSError):
            continue
    return int(np.mean(sizes) * n) if sizes else 0


# Worker processes are forked with this set (the folder storage and spec, not pickled).
_JOB: tuple[FolderStorage, PackedSpec] | None = None


def _encode_chunk(chunk: tuple[int, int]) -> tuple[tuple[int, int], list, list[SkippedFile]]:
    folder_storage, spec = _JOB
    rows, skipped = [], []
    for i in range(*chunk):
        path, label = folder_storage.samples[i]
        source, data = file_record(path)
        try:
            if not data:
                raise CorruptImageError("empty file" if data is not None else "unreadable")
            encoded, h, w = encode_stored(data, spec)
        except CorruptImageError as e:
            skipped.append(folder_storage.undecodable(path, e, i))  # on_corrupt=fail raises
            encoded, h, w = b"", 0, 0
        boxes = None
        if keeps_blobs(folder_storage):  # its kind's blob, for the stored image's size
            boxes = stored_blob(folder_storage.targets, i, h, w)
        elif folder_storage.targets is not None:  # detection: its boxes at the stored size
            boxes = stored_boxes(folder_storage.targets[i], h, w, data)
        rows.append((source, encoded, h, w, label, boxes))
    return chunk, rows, skipped


def append_side(fd: int, table: np.ndarray, first: int, rows: list, end: int, unit: int,
                encode: Callable[[Any], bytes]) -> int:
    """A chunk's side parts (each row's sixth field: the part, its image id, its source
    size), boxes or a kind's blobs, after the ones before in index order: each row's start
    and length (in ``unit``-byte items) in ``table`` from row ``first``, their bytes at
    ``end`` items into ``fd``, both on disk before the chunk is recorded; the new end."""
    start = end
    for k, row in enumerate(rows):
        part, image_id, (sh, sw) = row[5]
        table[first + k] = (end, len(part), image_id, sh, sw)
        end += len(part)
    os.pwrite(fd, b"".join(encode(r[5][0]) for r in rows), start * unit)
    table.flush()
    os.fdatasync(fd)
    return end


def stored_boxes(target, height: int, width: int, data: bytes | None = None
                 ) -> tuple[np.ndarray, int, tuple[int, int]]:
    """An image's boxes (its ``ImageTargets``, at its source size) as ``BOX_DTYPE`` rows in
    pixels of its stored ``height`` x ``width`` image (none for an image not stored), its
    id, and its upright source size (the labels', else read from its file's ``data``)."""
    rows = np.zeros(len(target.labels) if height else 0, dtype=BOX_DTYPE)
    if len(rows):
        boxes = target.boxes.to(torch.float32)
        if target.height and target.width and (target.height, target.width) != (height, width):
            boxes = boxes * torch.tensor([width / target.width, height / target.height] * 2,
                                         dtype=torch.float32)
        rows["box"], rows["label"] = boxes.numpy(), target.labels.numpy()
    source = (target.height, target.width)
    if not (source[0] and source[1]) and height and data:  # a YOLO image without boxes
        from runner.data.sources.labels import upright_size

        try:
            source = upright_size(io.BytesIO(data))
        except (OSError, ValueError):  # stored, so it decoded: its header reads too
            source = (0, 0)
    return rows, int(target.image_id), source


def stored_blob(targets, index: int, height: int, width: int
                ) -> tuple[bytes, int, tuple[int, int]]:
    """Image ``index``'s target as its kind's blob (``to_blob``) for its stored ``height``
    x ``width`` image (none for an image not stored), its id and its upright source size."""
    blob = KINDS[targets.kind].to_blob(targets, index, (height, width)) if height else b""
    return blob, int(targets.image_id(index)), tuple(targets.source_size(index))


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _convert(folder_storage: FolderStorage, spec: PackedSpec, journal: Journal,
             progress: bool) -> dict[str, Any]:
    """Encode every image into ``journal.folder``, in index order, resuming what a killed
    conversion left there; returns the store's metadata."""
    count, partial = len(folder_storage), journal.folder
    chunks = chunk_ranges(count)
    todo = journal.todo(chunks)
    # chunks are recorded in index order, so what is done is a prefix and the data file
    # ends where its last record says (bytes past it, from a kill, are overwritten)
    end = max((e["end"] for e in journal.done.values()), default=0)
    reserved = max(end, int(estimate_bytes(folder_storage, spec) * 1.1))
    also = "lower dataset.store_size or dataset.store_quality, "
    reserve(partial / DATA, reserved, estimated=True, also=also)
    reserve(partial / INDEX, count * INDEX_DTYPE.itemsize)
    reserve(partial / SOURCES, count * SOURCE_DTYPE.itemsize)
    blobs = keeps_blobs(folder_storage)
    detection = folder_storage.targets is not None and not blobs
    box_end = max((e.get("boxes", 0) for e in journal.done.values()), default=0)
    blob_end = max((e.get("blob_bytes", 0) for e in journal.done.values()), default=0)
    if detection:  # at most every listed box (an image not stored keeps none)
        most = sum(len(folder_storage.targets[i].labels) for i in range(count))
        reserve(partial / BOXES, max(most, box_end) * BOX_DTYPE.itemsize)
        reserve(partial / TARGETS, count * TARGET_DTYPE.itemsize)
    if blobs:  # the blobs' bytes are not known before they are made: the file grows
        reserve(partial / BLOB_INDEX, count * BLOB_DTYPE.itemsize)
        (partial / BLOBS).touch()
    if not journal.done:
        journal.start()
    index = np.memmap(partial / INDEX, dtype=INDEX_DTYPE, mode="r+", shape=(count,))
    sources = np.memmap(partial / SOURCES, dtype=SOURCE_DTYPE, mode="r+", shape=(count,))
    if detection:
        per_image = np.memmap(partial / TARGETS, dtype=TARGET_DTYPE, mode="r+", shape=(count,))
        box_fd = os.open(partial / BOXES, os.O_RDWR)
    if blobs:
        blob_index = np.memmap(partial / BLOB_INDEX, dtype=BLOB_DTYPE, mode="r+",
                               shape=(count,))
        blob_fd = os.open(partial / BLOBS, os.O_RDWR)
    fd = os.open(partial / DATA, os.O_RDWR)
    bar = tqdm(total=count, initial=count - sum(e - s for s, e in todo), unit="img",
               desc="packing", disable=not progress)
    global _JOB
    _JOB = (folder_storage, spec)
    waiting: dict[int, tuple] = {}  # finished out of order: written when their turn comes
    queue = iter(todo)
    turn = next(queue, None)
    try:
        for chunk, rows, skipped in parallel_imap(_encode_chunk, todo, initializer=_init_worker):
            waiting[chunk[0]] = (chunk, rows, skipped)
            while turn is not None and turn[0] in waiting:
                chunk, rows, skipped = waiting.pop(turn[0])
                blob = b"".join(r[1] for r in rows)
                if end + len(blob) > reserved:
                    grown = math.ceil((end + len(blob)) * 1.25)
                    reserve(partial / DATA, grown - reserved, offset=reserved, estimated=True,
                            also=also)
                    reserved = grown
                os.pwrite(fd, blob, end)
                offset = end
                for k, (source, encoded, h, w, label, _) in enumerate(rows):
                    index[chunk[0] + k] = (offset, len(encoded), h, w, label,
                                           zlib.crc32(encoded), 0)
                    sources[chunk[0] + k] = source
                    offset += len(encoded)
                end = offset
                index.flush()
                sources.flush()
                extra = {}
                if detection:  # the chunk's boxes after the ones before, in index order
                    box_end = append_side(box_fd, per_image, chunk[0], rows, box_end,
                                          BOX_DTYPE.itemsize, lambda boxes: boxes.tobytes())
                    extra["boxes"] = box_end
                if blobs:  # the chunk's blobs after the ones before, in index order
                    blob_end = append_side(blob_fd, blob_index, chunk[0], rows, blob_end, 1,
                                           lambda blob: blob)
                    extra["blob_bytes"] = blob_end
                os.fdatasync(fd)  # bytes and rows reach the disk before the record does
                journal.record(chunk[0], skipped, end=end, **extra)
                bar.update(chunk[1] - chunk[0])
                turn = next(queue, None)
        os.ftruncate(fd, end)
        os.fsync(fd)
        if detection:
            os.ftruncate(box_fd, box_end * BOX_DTYPE.itemsize)
            os.fsync(box_fd)
        if blobs:  # bytes past the end, from a killed conversion, go
            os.ftruncate(blob_fd, blob_end)
            os.fsync(blob_fd)
    finally:
        _JOB = None
        bar.close()
        os.close(fd)
        if detection:
            os.close(box_fd)
        if blobs:
            os.close(blob_fd)
    del index, sources
    extra = {"boxes": box_end} if detection else {}
    if blobs:
        del blob_index
        extra = {"blobs": folder_storage.targets.kind.value, "blob_bytes": blob_end}
    if folder_storage.targets is not None and \
            folder_storage.targets.category_ids is not None:  # COCO's own ids
        extra["category_ids"] = list(folder_storage.targets.category_ids)
    if detection and folder_storage.targets.inputs is not None:
        extra.update(label_record(folder_storage, partial))
    return journal.finish(data_bytes=end, classes=folder_storage.classes, **extra)


def inputs_digest(inputs: list[str], root: Path | str) -> str:
    """The label files' names, relative to the listing's root (one folder spelled two ways
    is one)."""
    return hashlib.sha256("\n".join(os.path.relpath(p, root) for p in inputs).encode()
                          ).hexdigest()


def label_record(folder_storage: FolderStorage, partial: Path) -> dict[str, Any]:
    """``labels.bin`` (the label files' stats, as the listing took them before reading
    them) and the metadata that goes with it: their names' digest and count, and the
    labels' bad input (reported by a run that does not read them)."""
    targets = folder_storage.targets
    rows = np.zeros(len(targets.inputs), dtype=SOURCE_DTYPE)
    for field_name, column in zip(STAT_FIELDS, zip(*targets.input_stats)):
        rows[field_name] = column
    rows.tofile(partial / LABELS)
    return {"label_inputs": {"digest": inputs_digest(targets.inputs, folder_storage.root),
                             "count": len(rows)},
            "label_skipped": [[s.path, s.error] for s in targets.skipped]}


# --- reading ------------------------------------------------------------------------------

def crop_geometry(decoder: ImageDecoder, hw: tuple[int, int], seed: int | None
                  ) -> tuple[bool, tuple[int, int, int, int, int], tuple]:
    """An upright stored image's crop at size ``hw``: whether it is flipped, the window the
    binding decodes (denominator, top, left, height, width) and the window of the source the
    output shows."""
    box, flip = decoder.box_for(*hw, seed)
    window = region_window(JpegHeader(*hw, 3), box, decoder.needed(box))
    denom, ch, cw = window[0], window[3], window[4]
    cut = source_window(box, hw, (-(-hw[0] // denom), -(-hw[1] // denom)))
    return flip, window, decoder.shows(cut, (ch, cw))


@functools.lru_cache(maxsize=GEOMETRIES)
def fixed_geometry(decoder: ImageDecoder, hw: tuple[int, int]
                   ) -> tuple[bool, tuple[int, int, int, int, int], tuple]:
    """``crop_geometry`` of a crop with no randomness (centre, whole, letterbox): it depends on the
    decoder and the size alone, so it is worked out once per pair (a store at one size is
    one entry; measured: a quarter of the Python an image costs in ``decode_slice``)."""
    return crop_geometry(decoder, hw, None)


class PackedStorage(FolderStorage):
    """The stored JPEGs of a packed store, decoded per epoch like an image folder (the
    ``Storage`` protocol): item ``i`` is the ``i``-th decodable source file, read as a
    ``pread`` from one open file.

    Args:
        folder: the source folder (names, classes, labels and the decoder that crops and
            resizes each stored JPEG; its files are never read again).
        cache: the packed store's folder.
        meta: its metadata.
        spec: its spec (names it, with the rebuild command, when a stored image is damaged).
    """

    engine = None  # the read engine, for a store on a far disk (``read_through``)
    # every stored image is an upright RGB JPEG of the index's size (the GPU decode trusts
    # the index instead of parsing each header)
    stored_upright = True

    def __init__(self, folder: FolderStorage, cache: Path, meta: dict[str, Any],
                 spec: PackedSpec | None = None):
        table = np.fromfile(cache / INDEX, dtype=INDEX_DTYPE, count=meta["count"])
        keep = np.nonzero(table["size"] > 0)[0]
        self._serve(folder, keep.tolist(), skipped_files(meta))
        self.offsets = table["offset"][keep].tolist()
        self.sizes = table["size"][keep].tolist()
        self.heights, self.widths = table["height"][keep].tolist(), table["width"][keep].tolist()
        self.crcs = table["crc"][keep].tolist()
        self.path, self.cache, self.spec = cache / DATA, cache, spec
        if isinstance(meta.get("boxes"), int):  # detection: the boxes the store holds
            try:
                self.targets = StoredTargets.load(cache, meta, keep, self.heights,
                                                  self.widths, folder.targets)
            except ValueError as e:
                raise self.damaged(str(e)) from e
            self.known_skipped += self.targets.skipped  # bad labels, as the folder says
        elif isinstance(meta.get("blobs"), str):  # another kind's targets, as its blobs
            try:
                self.targets = StoredBlobs.load(cache, meta, keep, folder.targets)
            except ValueError as e:
                raise self.damaged(str(e)) from e
            self.known_skipped += self.targets.skipped
        self.targets_digest = meta.get("targets")
        self.data_bytes = meta["data_bytes"]
        self._fd = os.open(self.path, os.O_RDONLY)

    def read_through(self, engine) -> None:
        """Read the store through the read engine ``engine`` (over this machine's files:
        runner/data/sources/fardisk.py): the store is on a far disk, where one blocking
        ``pread`` per decode thread would wait a round trip each, and a network mount
        serves one file's small reads one at a time. Its images are read in blocks of the
        file and its order is one of blocks (runner/data/sources/blockreads.py); a coming
        batch's blocks are started by ``will_need``."""
        from runner.data.sources import blockreads
        from runner.data.sources.readengine import Ahead

        self.engine, self.ahead = engine, Ahead()
        self._key = os.path.abspath(self.path).lstrip("/")
        # read in blocks of the file, in an order of blocks (runner/data/sources/blockreads.py)
        bounds = blockreads.block_bounds(self.offsets, self.sizes, blockreads.BLOCK_BYTES)
        self.blocks = blockreads.BlockReads(engine, self._key, self.offsets, self.sizes, bounds,
                                            3 * blockreads.BLOCKS_MIXED)
        self.order_groups, self.group_block = bounds, blockreads.BLOCKS_MIXED

    def follow(self, order) -> None:
        """The batch order of a far store's blocks: nothing more to do (the loader's
        ``will_need`` starts each batch's blocks a few batches ahead)."""

    def _span(self, index: int) -> tuple[int, int]:
        return self.offsets[index], self.offsets[index] + self.sizes[index]

    def figures(self) -> dict[str, Any]:
        """A far store's fetches (the read engine's figures); nothing for a local one."""
        if self.engine is None:
            return {}
        return {**self.engine.stats.figures(), **self.blocks.figures()}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if isinstance(self.targets, StoredBlobs):
            self.targets.close()
        self._close_fd()

    def __del__(self) -> None:
        self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # its file system went away first (a network mount)
                pass

    def __getstate__(self) -> dict:  # a worker process opens the file itself
        return {k: v for k, v in self.__dict__.items() if k != "_fd"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fd = os.open(self.path, os.O_RDONLY)

    @property
    def files(self) -> list[str]:
        return [str(self.path)]

    @property
    def image_bytes(self) -> int:
        """Mean stored bytes per image (the cold read's images/s)."""
        return max(1, self.data_bytes // max(len(self), 1))

    def reopen(self) -> None:
        """Nothing to drop: reads go through one descriptor, not a mapping."""

    def will_need(self, index: torch.Tensor) -> None:
        """Ask the kernel to start reading a coming batch's bytes now, so a cold page cache
        is read while the threads decode the batches before it."""
        if self.engine is not None:  # far: the batch's blocks, else its ranges, in flight
            items = unpad_all(index)
            if not self.blocks.will_need(items):
                self.ahead.start(items, lambda todo: self.engine.get_ranges(
                    self._key, [self._span(i) for i in todo]))
            return
        if not hasattr(os, "posix_fadvise"):
            return
        for i in unpad_all(index):
            os.posix_fadvise(self._fd, self.offsets[i], self.sizes[i], os.POSIX_FADV_WILLNEED)

    def read(self, index: int) -> bytes:
        """Item ``index``'s stored JPEG: one ``pread`` of exactly its bytes from the open
        data file (no open per image; no readahead of its neighbours, as a page fault in a
        mapping would read: with a cold page cache that read 2.3x the bytes needed)."""
        size = self.sizes[index]
        if self.engine is not None:  # far: fetched by the engine (started by will_need)
            try:
                data = self.blocks.read(index)
                if data is None:  # not in a block being read: its own range
                    data = bytes(self.ahead.take(index, lambda i: self.engine.get_range(
                        self._key, *self._span(i))).result())
            except Exception as e:  # the engine gave up
                raise OSError(errno.EIO, f"{self.path}: image {index}: {type(e).__name__} "
                              f"after {self.engine.attempts} tries") from e
        elif self._fd is None:
            raise OSError(errno.EBADF, f"{self.path}: read after the store was closed")
        else:
            data = os.pread(self._fd, size, self.offsets[index])
        if len(data) != size:
            raise OSError(errno.EIO, f"{self.path} ends before image {index}'s {size} bytes")
        return data

    @functools.cached_property
    def native_batches(self) -> bool:
        """Whether slices of a batch are decoded by the libjpeg binding in one call each
        (``decode_slice``): ``loader.decoder=region`` (packed's default), when built."""
        decoder = self.decode
        return (isinstance(decoder, ImageDecoder) and DECODERS[decoder.decoder].region
                and DECODERS[decoder.decoder].available())

    @property
    def channels_last(self) -> bool:
        """Whether the threaded loader's batches should be channels-last (buffers.py's
        ``BufferPool``): where the binding decodes each window of the output size straight
        into its slot (``native_batches``; a letterbox's picture, a centre crop, a whole
        image at its stored size), it writes HWC rows there with no split into planes
        (``slot_dest``). Random crops stay CHW: nearly all are enlargements, which the
        binding's upsampler writes as CHW planes."""
        return self.native_batches and self.decode.crop is not Crop.random

    def decode_slice(self, out: torch.Tensor, positions: range, indices: list
                     ) -> list[Sample | SkippedFile]:
        """Items ``indices[k]`` for ``k`` in ``positions`` decoded into ``out[k]``: with the
        libjpeg binding (``native_batches``), the whole slice in one call without the GIL.

        What the per-image path does in Python under the GIL, done once per slice or not
        at all: no header parse (the stored size is in the index; packed images are
        stored upright), the window of each crop at its DCT scale, a window of the output
        size decoded straight into its slot of the batch (the centre crop of a store at 256
        for 224 at crop fraction 0.875; a letterbox's picture stored at its size, inside its
        pads: no resize, no copy), as HWC rows in the channels-last batches the threaded
        loader gives this storage (``channels_last``), as CHW planes in a contiguous one,
        the crop's geometry worked out once per stored size (``fixed_geometry``); any other
        window (random crops) into its own buffer, then resized (and flipped) into the
        slot. A stored image the binding cannot decode goes through the per-image path:
        PIL's fallback, the checksum that names damage to the store, the skip."""
        if not self.native_batches:
            return super().decode_slice(out, positions, indices)
        from runner.data.decode import _jpegregion

        t0 = time.perf_counter()
        items: list[Sample | SkippedFile | None] = []
        jobs, todo = [], []
        fields: dict[int, dict[str, torch.Tensor]] = {}  # each image's target's
        kind = KINDS[self.targets.kind] if self.targets is not None else None
        places: dict = {}  # (decoder, window size) -> where in a slot (``direct``), per call
        batch = batch_dest(out)  # the batch's bytes, for every slot's destination
        for k in positions:
            index, seed = indices[k] if isinstance(indices[k], tuple) else (indices[k], None)
            index, valid = unpad(index)
            decoder: ImageDecoder = self.decoder_for(index)  # its bin's shape: group_aspect
            size = tuple(decoder.size)
            try:
                data = self.read(index)
            except OSError as e:
                items.append(self.unreadable(index, e))
                continue
            hw = (self.heights[index], self.widths[index])  # stored upright
            flip, (denom, top, left, ch, cw), shown = (
                fixed_geometry(decoder, hw) if seed is None and decoder.crop is not Crop.random
                else crop_geometry(decoder, hw, seed))
            if kind is not None:  # the target through the window decoded at 1/denom
                fields[k] = kind.sample_fields(self.targets, index, shown, flip, size, hw)
            key = (decoder, ch, cw, flip)  # the slots are alike: one answer per window size
            if key not in places:
                places[key] = decoder.direct(out[k], (ch, cw), flip)  # straight into its slot
            where = places[key]
            if where is None:  # an HWC image of its own
                tail = (bytearray(ch * cw * 3), False)
            elif batch is not None:  # its place's, from the batch's bytes
                tail = window_dest(batch, k, *where[:2])
            else:
                tail = slot_dest(out[k], *where[:2])
            jobs.append((data, denom, top, left, ch, cw, *tail))
            todo.append((len(items), k, index, valid, seed, flip, where))
            items.append(None)
        t1 = time.perf_counter()
        errors = _jpegregion.decode_batch(jobs)
        for error, job, (slot, k, index, valid, seed, flip, where) in zip(errors, jobs, todo):
            data, ch, cw, dest = job[0], job[4], job[5], job[6]
            if error is not None:  # PIL's fallback, the checksum, or a skip
                item = self.decode_data(index, data, valid, seed)
                if isinstance(item, Sample):
                    out[k].copy_(item.image)
                    item = dataclasses.replace(item, image=None)
            else:
                if where is None:
                    img = torch.frombuffer(dest, dtype=torch.uint8).view(ch, cw, 3)
                    self.decoder_for(index).place(out[k], img.permute(2, 0, 1), flip)
                else:  # a letterbox's pads around its picture
                    ImageDecoder.pad(out[k], *where)
                item = Sample(None, self.samples[index][1], index, valid, **fields.get(k, {}))
            items[slot] = item
        if timeline.enabled():
            timeline.record("read", t0, t1)
            timeline.record("decode", t1, time.perf_counter())
        return items

    def probes(self, batch_size: int, device: torch.device | None = None
               ) -> dict[str, Probe]:
        """The folder's probes, with the decode the threads really run: a slice of stored
        images through ``decode_slice`` (the binding's batch decode, when it is used)."""
        probes = super().probes(batch_size, device)
        if "decode" in probes and self.native_batches:
            n = min(len(self), 16)
            out = torch.empty((n, *self.item_shape), dtype=torch.uint8)
            counter = iter(range(10**12))

            def decode() -> int:
                first = next(counter) * n
                indices = [(first + k) % len(self) for k in range(n)]
                return sum(isinstance(item, Sample)
                           for item in self.decode_slice(out, range(n), indices)) or 1

            probes["decode"] = decode
        return probes

    def decode_data(self, index: int, data: bytes | None, valid: bool = True,
                    seed: int | None = None) -> Sample | SkippedFile:
        """A stored image that does not decode is either damage to the store (its CRC no
        longer matches: a CacheError naming the store and its rebuild) or a source that was
        already undecodable as stored (reported as a skipped file, as a folder would)."""
        item = super().decode_data(index, data, valid, seed)
        if isinstance(item, SkippedFile) and data is not None:
            self.check_stored(index, data)
        return item

    def check_stored(self, index: int, data: bytes | bytearray) -> None:
        """A CacheError naming the store when image ``index``'s bytes are not those
        stored (damage since packing), not a skip blamed on a healthy source."""
        if zlib.crc32(data) != self.crcs[index]:
            raise self.damaged(f"the bytes of image {index} ({self.name_of(index)}) no "
                               "longer match their checksum")

    def damaged(self, what: str) -> CacheError:
        if self.spec is not None:
            return self.spec.damaged(self.cache, what)
        return CacheError(f"the packed store {self.cache} is damaged: {what}; delete it to "
                          "rebuild it")


class StoredTargets:
    """The boxes a packed store holds, per stored image (``DetectionTargets``' reading side:
    ``store.targets[i]`` is image ``i``'s ``ImageTargets``, at its stored size, cut from the
    store's arrays when asked for).

    Args:
        boxes: float32 [total, 4], every stored image's boxes, image after image.
        labels: int64 [total], their class ids.
        starts: int64 [n + 1], where image ``i``'s boxes start (and end: ``starts[i + 1]``).
        heights, widths: each image's stored size (the boxes' pixels).
        image_ids: each image's id.
        format: the labels' format ("yolo", "coco").
        skipped: the labels' bad input, as the listing reported it.
        source_sizes: each image's upright source size (height, width): the frame served
            detections go back to.
        category_ids: COCO's id of each class (None: the class index).
    """

    kind = TargetName.boxes  # what they are: runner/data/targets/' record

    def __init__(self, boxes: torch.Tensor, labels: torch.Tensor, starts: list[int],
                 heights: list[int], widths: list[int], image_ids: list[int], format: str,
                 skipped: list[SkippedFile], source_sizes: list[tuple[int, int]] | None = None,
                 category_ids: list[int] | None = None):
        self.boxes, self.labels, self.starts = boxes, labels, starts
        self.heights, self.widths, self.image_ids = heights, widths, image_ids
        self.format, self.skipped = format, skipped
        self.source_sizes = source_sizes or list(zip(heights, widths))
        self.category_ids = category_ids

    def source_size(self, index: int) -> tuple[int, int]:
        """Image ``index``'s upright source size (height, width)."""
        return self.source_sizes[index]

    def image_id(self, index: int) -> int:
        return self.image_ids[index]

    @classmethod
    def load(cls, cache: Path, meta: dict[str, Any], keep: np.ndarray, heights: list[int],
             widths: list[int], listed=None) -> StoredTargets:
        """The store's boxes of its stored images ``keep`` (positions in its index);
        ``listed``: the folder's targets (their format and the bad input they reported)."""
        rows = np.fromfile(cache / BOXES, dtype=BOX_DTYPE, count=meta["boxes"])
        per_image = np.fromfile(cache / TARGETS, dtype=TARGET_DTYPE, count=meta["count"])[keep]
        if len(rows) != meta["boxes"] or (per_image["start"] + per_image["count"]
                                          > len(rows)).any():
            raise ValueError(f"{BOXES} holds fewer boxes than its {TARGETS} says")
        # every kept image's boxes, back to back (as stored: an image left out has none)
        counts = per_image["count"]
        starts = np.concatenate([[0], np.cumsum(counts)])
        take = np.repeat(per_image["start"] - starts[:-1], counts) + np.arange(starts[-1])
        if len(take) != len(rows) or (take != np.arange(len(rows))).any():
            rows = rows[take]
        starts = starts.tolist()
        return cls(torch.from_numpy(np.ascontiguousarray(rows["box"])),
                   torch.from_numpy(np.ascontiguousarray(rows["label"])), starts, heights,
                   widths, per_image["image_id"].tolist(),
                   listed.format if listed is not None else "stored",
                   list(listed.skipped) if listed is not None else [],
                   list(zip(per_image["source_height"].tolist(),
                            per_image["source_width"].tolist())),
                   meta.get("category_ids"))

    def __len__(self) -> int:
        return len(self.heights)

    def __getitem__(self, index: int):
        from runner.data.sources.labels import ImageTargets

        a, b = self.starts[index], self.starts[index + 1]
        return ImageTargets(self.boxes[a:b], self.labels[a:b], self.heights[index],
                            self.widths[index], self.image_ids[index])


class StoredBlobs:
    """The targets a packed store keeps as their kind's blobs (masks), read per image with
    one ``pread`` and given back by the kind's ``from_blob``: ``target(i)`` is stored image
    ``i``'s, at its stored size, as the kind's ``sample_fields`` reads it. The store does
    not know what they are.

    Args:
        path: ``blobs.bin``.
        rows: ``BLOB_DTYPE`` rows of the stored images, in storage order.
        kind: their ``TargetName``.
        format: the labels' format; skipped: the labels' bad input, as listed.
        category_ids: COCO's id of each class (None: the class index).
    """

    def __init__(self, path: Path, rows: np.ndarray, kind: TargetName, format: str,
                 skipped: list[SkippedFile], category_ids: list[int] | None = None):
        self.path, self.kind, self.format, self.skipped = path, kind, format, skipped
        self.offsets, self.sizes = rows["offset"].tolist(), rows["size"].tolist()
        self.image_ids = rows["image_id"].tolist()
        self.source_sizes = list(zip(rows["source_height"].tolist(),
                                     rows["source_width"].tolist()))
        self.category_ids = category_ids
        self._fd = os.open(self.path, os.O_RDONLY)

    @classmethod
    def load(cls, cache: Path, meta: dict[str, Any], keep: np.ndarray, listed=None
             ) -> StoredBlobs:
        """The blobs of the store's stored images ``keep`` (positions in its index);
        ``listed``: the folder's targets (their format and the bad input they reported)."""
        rows = np.fromfile(cache / BLOB_INDEX, dtype=BLOB_DTYPE, count=meta["count"])[keep]
        if len(rows) and (rows["offset"] + rows["size"] > meta["blob_bytes"]).any():
            raise ValueError(f"{BLOBS} holds fewer bytes than its {BLOB_INDEX} says")
        return cls(cache / BLOBS, rows, TargetName(meta["blobs"]),
                   listed.format if listed is not None else "stored",
                   list(listed.skipped) if listed is not None else [],
                   meta.get("category_ids"))

    def __getstate__(self) -> dict:  # a worker process opens the file itself
        return {k: v for k, v in self.__dict__.items() if k != "_fd"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.offsets)

    def blob(self, index: int) -> bytes:
        """Stored image ``index``'s blob, as its kind wrote it."""
        if self._fd is None:
            raise OSError(errno.EBADF, f"{self.path}: read after the store was closed")
        data = os.pread(self._fd, self.sizes[index], self.offsets[index])
        if len(data) != self.sizes[index]:
            raise OSError(errno.EIO, f"{self.path} ends before blob {index}'s bytes")
        return data

    def target(self, index: int):
        """Stored image ``index``'s target, from its blob (its kind's ``from_blob``)."""
        return KINDS[self.kind].from_blob(self.blob(index))

    def source_size(self, index: int) -> tuple[int, int]:
        """Image ``index``'s upright source size (height, width)."""
        return self.source_sizes[index]

    def image_id(self, index: int) -> int:
        return self.image_ids[index]

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):  # its file system gone first; never opened
            pass


def unpad_all(index: torch.Tensor) -> list[int]:
    """The storage indices of a batch's rows, padding rows mapped back to theirs."""
    return split_padding(index)[0].tolist()


def open_packed_cache(folder: FolderStorage, spec: PackedSpec, cache_root: Path,
                      progress: bool = True) -> PackedStorage:
    """The packed store of ``folder`` (converted first if there is no valid one)."""
    spec = with_targets(spec, folder)
    cache, meta = ensure_cache(folder, spec, cache_root, progress)
    refresh_labels(cache, meta, folder)
    return PackedStorage(folder, cache, meta, spec)


def refresh_labels(cache: Path, meta: dict[str, Any], folder: FolderStorage) -> None:
    """A valid store whose label files' stats moved while their boxes and bad input did
    not (a label file rewritten as it was): record the new stats, so the next open reads
    no label file again (a read-only store keeps the old ones)."""
    targets, record = folder.targets, meta.get("label_inputs")
    if getattr(targets, "inputs", None) is None or not isinstance(record, dict) or \
            record.get("digest") != inputs_digest(targets.inputs, folder.root) or \
            meta.get("label_skipped") != [[s.path, s.error] for s in targets.skipped]:
        return
    try:
        table = np.memmap(cache / LABELS, dtype=SOURCE_DTYPE, mode="r+")
    except OSError:
        return
    if len(table) == len(targets.input_stats):
        for field_name, column in zip(STAT_FIELDS, zip(*targets.input_stats)):
            if (table[field_name] != np.array(column)).any():
                table[field_name] = column
        table.flush()
    del table


def open_packed(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                progress: bool = True) -> PackedStorage:
    """The packed store of the folder at ``path`` (packed first if there is no valid one),
    each stored JPEG decoded per epoch with ``loader.decoder``."""
    storage = open_without_labels(loader, dataset, path) if dataset.targets.boxes else None
    if storage is None:
        folder = open_folder(loader, dataset, path, progress)
        storage = open_packed_cache(folder, packed_spec(loader, dataset, path),
                                    Path(dataset.cache_dir), progress)
    read_far(storage, dataset.far_disk)
    return storage


def open_without_labels(loader: LoaderConfig, dataset: DatasetConfig, path: Path
                        ) -> PackedStorage | None:
    """A valid detection store of the YOLO layout at ``path``, opened without reading a
    label file (the module's docstring); None when that cannot be shown so (then the full
    listing decides)."""
    from runner.data.sources.detection import DetectionTargets, quick_detection
    from runner.data.sources.files import Files
    from runner.data.sources.listing import Listing

    quick = quick_detection(dataset, path)
    if quick is None:
        return None
    listing, inputs, stats = quick
    spec = dataclasses.replace(packed_spec(loader, dataset, path), targets="yolo")
    cache = spec.folder(Path(dataset.cache_dir))
    try:
        meta = read_meta(cache, spec)
    except CacheError:
        return None
    record = meta.get("label_inputs") if meta is not None else None
    if meta is None or meta.get("version") != spec.version or \
            meta.get("settings") != spec.settings() or not isinstance(record, dict) or \
            record.get("digest") != inputs_digest(inputs, listing.root) or \
            record.get("count") != len(inputs) or \
            not isinstance(meta.get("label_skipped"), list):
        return None
    skipped = [SkippedFile(str(p), str(e), label=True) for p, e in meta["label_skipped"]]
    listing = Listing(listing.root, list(meta["classes"]), listing.samples, listing.how, [],
                      DetectionTargets([], "yolo", skipped, inputs, stats))
    folder = FolderStorage(Files(listing), folder_decoder(loader, dataset), dataset.on_corrupt)
    if meta["count"] != len(folder) or meta["layout"] != layout_fingerprint(folder):
        return None
    try:
        check_files(cache, meta, spec)
    except CacheError:
        return None
    recorded = np.fromfile(cache / LABELS, dtype=SOURCE_DTYPE, count=len(inputs))
    now = np.array(stats, dtype=[(f, SOURCE_DTYPE[f]) for f in STAT_FIELDS]).reshape(-1)
    if len(recorded) != len(now) or any((recorded[f] != now[f]).any() for f in STAT_FIELDS):
        return None  # a label file changed (or was touched): the full listing decides
    if changed_files(cache, meta, folder):
        return None
    check_skipped(meta, folder)
    log.info("%s: the boxes stored in %s, no label file read", path, cache)
    return PackedStorage(folder, cache, meta, spec)


def read_far(storage: PackedStorage, setting: bool | None) -> None:
    """A store on a far disk (``dataset.far_disk``, else a few of its images' ``pread``s
    timed: runner/data/sources/fardisk.py) is read through the read engine."""
    from runner.data.sources.fardisk import is_far, spread

    spans = list(zip(spread(storage.offsets), spread(storage.sizes)))  # not every image's
    far, why = is_far([str(storage.path)], setting, spans)
    if far:
        from runner.data.sources.files import far_engine

        log.info("%s: %s, read through the read engine, many images in flight",
                 storage.path, why)
        storage.read_through(far_engine())


def build_packed(loader: LoaderConfig, dataset: DatasetConfig, path: Path,
                 progress: bool = True, rebuild: bool = False) -> Path:
    """The packed store's folder, packed now if there is no valid one (or ``rebuild``)."""
    folder = open_folder(loader, dataset, path, progress)
    spec = with_targets(packed_spec(loader, dataset, path), folder)
    return ensure_cache(folder, spec, Path(dataset.cache_dir), progress, rebuild)[0]


def packed_footprint(dataset: DatasetConfig, folder: FolderStorage) -> StoreFootprint:
    spec = packed_spec(None, dataset, folder.root)
    return StoreFootprint(f"JPEG q{spec.quality} at the {spec.side.value} side "
                          f"{spec.store_size}", estimate_bytes(folder, spec), estimated=True)


KIND = StorageKind(
    name=StorageName.packed,
    open=open_packed,
    storage=PackedStorage,
    summary="JPEGs re-encoded once at dataset.store_size into one file, decoded every epoch",
    # nvjpeg: each batch's stored JPEGs (one pread each) decoded batched on the GPU
    # (runner/data/device/nvjpeg.py), cropped there with the CPU path's boxes
    decoders=frozenset(DECODERS),
    knobs=("loader.decoder", "loader.draft", "loader.num_workers"),
    advice={"decode": "a smaller dataset.store_size (fewer pixels to decode per image)"},
    bench={"packed": ("loader=packed", "dataset.store_size=256")},
    build=build_packed,
    footprint=packed_footprint,
    speed_rank=1,
    boxes=True,
    masks=True,  # as its kind's blobs beside the JPEGs (StoredBlobs)
)
