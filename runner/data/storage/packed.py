"""``loader=packed``: every image re-encoded once at a stored size into one file of JPEGs.

For datasets too big to keep decoded: ``dataset.store_size`` (the shorter side, or with
``dataset.store_side=longer`` the longer side at most; never enlarged) keeps what a crop
to ``dataset.image_size`` needs, at ``dataset.store_quality``. Each epoch decodes the
stored JPEGs again (random crops are real random-resized crops of the whole stored image),
with the in-process decode threads, one ``pread`` per image from one open file: no file
opened per image. With ``loader.decoder=region`` (the default) only the crop's window is decoded.

A cache folder holds ``images.bin`` (the JPEGs back to back), ``index.bin`` (per source
file: offset, size, stored height and width, label; size 0 for an undecodable file),
``sources.bin`` and ``meta.json``. It has every guarantee of the memmap cache (memmap.py):
built in parallel with a progress bar, in ``<key>.partial`` and published by a rename,
resumable after a kill (``done.jsonl`` records each chunk after its bytes and index rows
are on disk), the source fingerprinted (a changed file rebuilds), undecodable files
listed in the metadata and reported by every run, opened without a lock (read-only caches
work). Its size is not known before encoding, so the conversion first encodes a sample,
reserves the estimate (a disk too small fails at once) and reserves more if it runs over.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image, ImageOps
from tqdm import tqdm

from runner.atomic import write_json
from runner.config import StoreSide
from runner.data.order import split_padding
from runner.data.pool import parallel_imap
from runner.data.storage.base import SkippedFile
from runner.data.storage.decode import CorruptImageError, ImageDecoder, read_jpeg_header
from runner.data.storage.folder import FolderStorage
from runner.data.storage.memmap import (
    DONE,
    META,
    PLAN,
    SOURCE_DTYPE,
    SOURCES,
    CacheSpec,
    check_skipped,
    chunk_ranges,
    disk_full,
    ensure_cache,
    file_record,
    layout_fingerprint,
    open_partial,
    skipped_files,
)

log = logging.getLogger(__name__)

PACKED_VERSION = 1
DATA, INDEX = "images.bin", "index.bin"
INDEX_DTYPE = np.dtype([("offset", "<i8"), ("size", "<i8"), ("height", "<i4"),
                        ("width", "<i4"), ("label", "<i8")])
SAMPLE = 32  # images encoded up front to estimate the store's size


def stored_hw(height: int, width: int, size: int, side: StoreSide) -> tuple[int, int]:
    """An upright image's stored (height, width): ``size`` along ``side``, aspect kept,
    never larger than it is."""
    scale = size / (min(height, width) if side is StoreSide.shorter else max(height, width))
    if scale >= 1:
        return height, width
    return max(1, round(height * scale)), max(1, round(width * scale))


@dataclass(frozen=True)
class PackedSpec:
    """What a packed store's bytes depend on; each distinct spec gets its own folder."""

    source: Path
    store_size: int
    side: StoreSide
    quality: int

    kind = "packed"
    version = PACKED_VERSION
    damaged = CacheSpec.damaged

    def settings(self) -> dict[str, Any]:
        return {"source": str(self.source), "store_size": self.store_size,
                "side": self.side.value, "quality": self.quality}

    def folder(self, cache_root: Path) -> Path:
        digest = hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode())
        name = (f"{self.source.name}-{self.side.value}{self.store_size}-q{self.quality}-"
                f"{digest.hexdigest()[:10]}")
        return Path(cache_root).expanduser() / "packed" / name

    def rebuild_command(self) -> str:
        return (f"python -m runner.prepare packed --rebuild dataset.path={self.source} "
                f"dataset.store_size={self.store_size} dataset.store_side={self.side.value} "
                f"dataset.store_quality={self.quality}")

    def file_sizes(self, folder: Path, meta: dict[str, Any]) -> dict[str, int]:
        if not isinstance(meta.get("data_bytes"), int):
            raise self.damaged(folder, f"its {META} lacks or mistypes: data_bytes")
        count = meta["count"]
        return {DATA: meta["data_bytes"], INDEX: count * INDEX_DTYPE.itemsize,
                SOURCES: count * SOURCE_DTYPE.itemsize}

    def convert(self, folder_storage: FolderStorage, partial: Path, progress: bool
                ) -> dict[str, Any]:
        return _convert(folder_storage, self, partial, progress)


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
            img = ImageOps.exif_transpose(img).convert("RGB")
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
        rows.append((source, encoded, h, w, label))
    return chunk, rows, skipped


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


class _Reserved:
    """The data file's disk space, reserved ahead of the bytes written into it."""

    def __init__(self, fd: int, path: Path, reserved: int):
        self.fd, self.path, self.reserved = fd, path, 0
        self.grow(reserved)

    def grow(self, size: int) -> None:
        if size <= self.reserved:
            return
        try:
            os.posix_fallocate(self.fd, self.reserved, size - self.reserved)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise disk_full(self.path, size, estimated=True, also="lower "
                                "dataset.store_size or dataset.store_quality, ") from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        self.reserved = size


def _convert(folder_storage: FolderStorage, spec: PackedSpec, partial: Path,
             progress: bool) -> dict[str, Any]:
    count = len(folder_storage)
    plan = {"version": PACKED_VERSION, "settings": spec.settings(),
            "layout": layout_fingerprint(folder_storage), "count": count}
    done = open_partial(partial, plan)
    # bytes past the last recorded chunk (a kill before its record) are overwritten
    end = max(_recorded_ends(partial), default=0) if done else 0
    estimate = estimate_bytes(folder_storage, spec)
    if not done:
        for name, rows in ((INDEX, count), (SOURCES, count)):
            with open(partial / name, "wb") as f:
                f.truncate(rows * (INDEX_DTYPE if name == INDEX else SOURCE_DTYPE).itemsize)
        write_json(partial / PLAN, plan)
    chunks = chunk_ranges(count)
    todo = [c for c in chunks if c[0] not in done]
    if done:
        log.info("resuming the conversion in %s: %d of %d chunks already done", partial,
                 len(done), len(chunks))
    index = np.memmap(partial / INDEX, dtype=INDEX_DTYPE, mode="r+", shape=(count,))
    sources = np.memmap(partial / SOURCES, dtype=SOURCE_DTYPE, mode="r+", shape=(count,))
    fd = os.open(partial / DATA, os.O_RDWR | os.O_CREAT, 0o644)
    bar = tqdm(total=count, initial=count - sum(e - s for s, e in todo), unit="img",
               desc="packing", disable=not progress)
    global _JOB
    _JOB = (folder_storage, spec)
    try:
        space = _Reserved(fd, partial / DATA, max(end, int(estimate * 1.1)))
        with open(partial / DONE, "a") as record:
            for chunk, rows, skipped in parallel_imap(_encode_chunk, todo,
                                                      initializer=_init_worker):
                blob = b"".join(r[1] for r in rows)
                space.grow(end + len(blob) if end + len(blob) <= space.reserved
                           else math.ceil((end + len(blob)) * 1.25))
                os.pwrite(fd, blob, end)
                offset = end
                for k, (source, encoded, h, w, label) in enumerate(rows):
                    index[chunk[0] + k] = (offset, len(encoded), h, w, label)
                    sources[chunk[0] + k] = source
                    offset += len(encoded)
                end = offset
                index.flush()
                sources.flush()
                os.fdatasync(fd)  # bytes and rows reach the disk before the record does
                entry = {"start": chunk[0], "end": end,
                         "skipped": [[s.index, s.path, s.error] for s in skipped]}
                record.write(json.dumps(entry) + "\n")
                record.flush()
                os.fsync(record.fileno())
                done[chunk[0]] = entry["skipped"]
                bar.update(chunk[1] - chunk[0])
        os.ftruncate(fd, end)
        os.fsync(fd)
    finally:
        _JOB = None
        bar.close()
        os.close(fd)
    del index, sources
    skipped = sorted((s for entries in done.values() for s in entries), key=lambda s: s[0])
    meta = {**plan, "data_bytes": end, "classes": folder_storage.classes,
            "skipped": [{"index": i, "path": p, "error": e} for i, p, e in skipped]}
    write_json(partial / META, meta)
    for name in (PLAN, DONE):
        (partial / name).unlink()
    return meta


def _recorded_ends(partial: Path) -> list[int]:
    """Where each recorded chunk's bytes end in the data file."""
    ends = []
    try:
        lines = (partial / DONE).read_text().splitlines()
    except OSError:
        return ends
    for line in lines:
        try:
            ends.append(int(json.loads(line)["end"]))
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            continue
    return ends


# --- reading ------------------------------------------------------------------------------

class PackedStorage(FolderStorage):
    """The stored JPEGs of a packed cache, decoded per epoch like an image folder (the
    ``Storage`` protocol): item ``i`` is the ``i``-th decodable source file, read as a
    ``pread`` from one open file.

    Args:
        folder: the source folder (names, classes and labels; never read again).
        cache: the packed cache folder.
        meta: its metadata.
        decode: the decoder that crops and resizes each stored JPEG.
    """

    def __init__(self, folder: FolderStorage, cache: Path, meta: dict[str, Any],
                 decode: ImageDecoder):
        table = np.fromfile(cache / INDEX, dtype=INDEX_DTYPE, count=meta["count"])
        keep = np.nonzero(table["size"] > 0)[0]
        self.root, self.classes = folder.root, folder.classes
        self.samples = [folder.samples[i] for i in keep.tolist()]
        self.offsets = table["offset"][keep].tolist()
        self.sizes = table["size"][keep].tolist()
        self.stored_hw = np.stack([table["height"][keep], table["width"][keep]], 1)
        self.decode = decode
        self.on_corrupt = folder.on_corrupt
        self.known_skipped = skipped_files(meta)
        self.path = cache / DATA
        self.data_bytes = meta["data_bytes"]
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

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
        if not hasattr(os, "posix_fadvise"):
            return
        for i in unpad_all(index):
            os.posix_fadvise(self._fd, self.offsets[i], self.sizes[i], os.POSIX_FADV_WILLNEED)

    def read(self, index: int) -> bytes:
        """Item ``index``'s stored JPEG: one ``pread`` of exactly its bytes from the open
        data file (no open per image; no readahead of its neighbours, as a page fault in a
        mapping would read: with a cold page cache that read 2.3x the bytes needed)."""
        size = self.sizes[index]
        data = os.pread(self._fd, size, self.offsets[index])
        if len(data) != size:
            raise OSError(errno.EIO, f"{self.path} ends before image {index}'s {size} bytes")
        return data


def unpad_all(index: torch.Tensor) -> list[int]:
    """The storage indices of a batch's rows, padding rows mapped back to theirs."""
    return split_padding(index)[0].tolist()


def open_packed_cache(folder: FolderStorage, spec: PackedSpec, cache_root: Path,
                      decode: ImageDecoder, progress: bool = True) -> PackedStorage:
    """The packed store of ``folder`` (converted first if there is no valid one)."""
    cache, meta = ensure_cache(folder, spec, cache_root, progress)
    check_skipped(meta, folder)
    return PackedStorage(folder, cache, meta, decode)
