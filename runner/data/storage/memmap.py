"""``loader=memmap``: decode an image folder once into a uint8 MemoryMappedTensor cache.

A cache folder holds ``images.memmap`` (N, 3, H, W) uint8 and ``labels.memmap`` (N,) int64,
both tensordict ``MemoryMappedTensor`` files, ``sources.bin`` (each source file's size,
mtime, ctime, inode and a content hash, as read during the conversion) and ``meta.json``
(settings, the folder's layout, count, skipped files). Slot ``i`` holds file ``i`` of the
folder in ImageFolder order; an undecodable file leaves its slot zero and is listed as
skipped.

Conversion (``ensure_cache``):
- decodes with the folder loader itself (same decoder, resize, class indices), in worker
  processes, one chunk of images per task, with a progress bar; a worker that dies fails
  the conversion at once (``WorkerDied``), never hangs it;
- reserves the cache's disk space before writing a pixel (``posix_fallocate``): a disk that
  is too small fails at once with the bytes needed and free (``DiskFull``);
- builds in ``<key>.partial``, whose ``done.jsonl`` records finished chunks after their
  pixels are synced to disk, so a rerun after a kill (or a worker death) resumes and gives
  the same bytes;
- publishes by renaming the finished folder into place, ``meta.json`` included: a folder
  without a valid ``meta.json`` is never taken for a cache.

Opening (``valid_cache``) takes no lock, so a valid cache on a read-only filesystem is
usable; it checks the metadata, the file sizes and the source: the folder's layout
(relative names and classes, so the same folder spelled differently is the same source)
and every file's stat. A file whose stat changed (a rewrite keeps the mtime with ``cp -p``,
``rsync -a`` or tar, but never the ctime) is hashed again; a content change rebuilds the
cache. The content hash costs about 6% of the conversion's decode time (BLAKE2b at
about 1 GB/s against about 1.3 ms to decode an 85 KB JPEG here). A damaged cache is a
``CacheError`` that says how to rebuild it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from tensordict import MemoryMappedTensor
from tqdm import tqdm

from runner.atomic import write_json
from runner.config import OnCorrupt
from runner.data.pool import parallel_imap
from runner.data.storage.base import SkippedFile, image_nbytes
from runner.data.storage.decode import CorruptFileStop
from runner.data.storage.decoded import DecodedStorage
from runner.data.storage.folder import FolderStorage, printable, read_file
from runner.errors import UserError

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: per-file stats and content hashes (sources.bin)
IMAGES, LABELS, SOURCES = "images.memmap", "labels.memmap", "sources.bin"
META, PLAN, DONE = "meta.json", "plan.json", "done.jsonl"
CHUNK = 64  # images per conversion task: the unit of progress and of resumption
GiB = 1024**3

# One row per source file, as it was when the conversion read it.
SOURCE_DTYPE = np.dtype([("size", "<i8"), ("mtime", "<i8"), ("ctime", "<i8"), ("ino", "<u8"),
                         ("hash", "<u8")])
STAT_FIELDS = ("size", "mtime", "ctime", "ino")


class CacheError(UserError, RuntimeError):
    """A cache that exists but cannot be trusted; the message says how to rebuild it."""


class DiskFull(UserError, OSError):
    """Not enough free space for the cache; the message gives the bytes needed and free."""


@dataclass(frozen=True)
class CacheSpec:
    """What a cache's pixels depend on; each distinct spec gets its own folder."""

    source: Path
    image_size: tuple[int, int]  # as stored (dataset.store_size, else dataset.image_size)
    decoder: str
    draft: bool

    kind = "memmap"  # the cache's sub-folder and its name in messages
    version = CACHE_VERSION

    def settings(self) -> dict[str, Any]:
        return {"source": str(self.source), "image_size": list(self.image_size),
                "decoder": self.decoder, "draft": self.draft}

    def folder(self, cache_root: Path) -> Path:
        digest = hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode())
        h, w = self.image_size
        name = f"{self.source.name}-{h}x{w}-{self.decoder}{'-draft' if self.draft else ''}"
        return Path(cache_root).expanduser() / "memmap" / f"{name}-{digest.hexdigest()[:10]}"

    def rebuild_command(self) -> str:
        h, w = self.image_size
        draft = " loader.draft=true" if self.draft else ""
        return (f"python -m runner.prepare memmap --rebuild dataset.path={self.source} "
                f"dataset.image_size=[{h},{w}] loader.decoder={self.decoder}{draft}")

    def damaged(self, folder: Path, what: str) -> CacheError:
        return CacheError(f"the {self.kind} cache {folder} is damaged: {what}. Rebuild it "
                          f"with: {self.rebuild_command()}  (or delete the folder)")

    def file_sizes(self, folder: Path, meta: dict[str, Any]) -> dict[str, int]:
        """The bytes each file of a valid cache holds (CacheError when ``meta`` disagrees
        with this spec)."""
        if meta.get("image_size") != list(self.image_size):
            raise self.damaged(folder, f"its image size {meta.get('image_size')} is not "
                                       f"{list(self.image_size)}")
        count = meta["count"]
        return {IMAGES: count * image_nbytes(self.image_size), LABELS: count * 8,
                SOURCES: count * SOURCE_DTYPE.itemsize}

    def convert(self, folder_storage: FolderStorage, partial: Path, progress: bool
                ) -> dict[str, Any]:
        """Build the cache in ``partial`` (resuming what a killed conversion left there);
        returns its metadata."""
        return _convert(folder_storage, self, partial, progress)


def layout_fingerprint(folder: FolderStorage) -> str:
    """Changes when a file is added, removed or renamed, or a class renamed; the names are
    relative to the root, so the same folder spelled differently has the same layout."""
    digest = hashlib.sha256("\n".join(folder.classes).encode())
    for path, label in folder.samples:
        digest.update(b"\n" + os.fsencode(os.path.relpath(path, folder.root)) + b"\t%d" % label)
    return digest.hexdigest()


def content_hash(data: bytes | bytearray) -> int:
    """A 64-bit BLAKE2b digest of a file's bytes."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def stat_row(path: str) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode); zeros for a file that cannot be stat-ed."""
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0, 0)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def file_record(path: str) -> tuple[tuple[int, int, int, int, int], bytearray | None]:
    """The file's stat and content hash as one sources row, and its bytes (None: unreadable)."""
    stat = stat_row(path)  # before reading: a change after this is seen on the next open
    try:
        data = read_file(path)
    except OSError:
        return (*stat, 0), None
    return (*stat, content_hash(data)), data


def chunk_ranges(count: int) -> list[tuple[int, int]]:
    """[start, end) of each conversion task."""
    return [(s, min(s + CHUNK, count)) for s in range(0, count, CHUNK)]


def image_shape(count: int, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
    return (count, 3, *image_size)


# --- opening ------------------------------------------------------------------------------

def read_meta(folder: Path, spec: CacheSpec) -> dict[str, Any] | None:
    """The cache's metadata: None when there is no cache folder; CacheError when there is
    one whose metadata is unreadable or not of the shape this version writes."""
    if not folder.exists():
        return None
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise spec.damaged(folder, f"its {META} cannot be read ({e})") from e
    if not isinstance(meta, dict):
        raise spec.damaged(folder, f"its {META} holds a {type(meta).__name__}, not an object")
    if not {"version", "settings"} <= set(meta):
        raise spec.damaged(folder, f"its {META} has no version or settings")
    if meta.get("version") != spec.version or meta.get("settings") != spec.settings():
        return meta  # another version or settings: rebuilt, not refused
    problems = [key for key, kind in (("count", int), ("layout", str), ("skipped", list),
                                      ("classes", list))
                if not isinstance(meta.get(key), kind)]
    skipped_ok = isinstance(meta.get("skipped"), list) and all(
        isinstance(s, dict) and {"index", "path", "error"} <= set(s) for s in meta["skipped"])
    if problems or not skipped_ok:
        what = ", ".join(problems) or "skipped"
        raise spec.damaged(folder, f"its {META} lacks or mistypes: {what}")
    return meta


def check_cache(folder: Path, meta: dict[str, Any], spec: CacheSpec) -> None:
    """Raise CacheError unless the files are exactly as large as ``meta`` says."""
    for name, size in spec.file_sizes(folder, meta).items():
        path = folder / name
        actual = path.stat().st_size if path.exists() else None
        if actual != size:
            what = "is missing" if actual is None else f"holds {actual} bytes"
            raise spec.damaged(folder, f"{name} {what}, its metadata says {size} bytes")


def open_images(folder: Path, meta: dict[str, Any], writable: bool = False) -> MemoryMappedTensor:
    shape = image_shape(meta["count"], tuple(meta["image_size"]))
    # mode "r" maps copy-on-write: a reader can never change the cache on disk
    return MemoryMappedTensor.from_filename(folder / IMAGES, dtype=torch.uint8,
                                            shape=torch.Size(shape), mode="r+" if writable else "r")


def open_labels(folder: Path, meta: dict[str, Any]) -> torch.Tensor:
    labels = MemoryMappedTensor.from_filename(folder / LABELS, dtype=torch.int64,
                                              shape=torch.Size([meta["count"]]), mode="r")
    return labels.clone()  # small: keep it in RAM


def changed_files(folder: Path, meta: dict[str, Any], source: FolderStorage) -> list[str]:
    """Source files whose content differs from what the cache was built from.

    A stat that still matches is trusted (the cheap check); a file whose stat changed is
    read and hashed again, and counts as changed only if its bytes did.
    """
    recorded = np.fromfile(folder / SOURCES, dtype=SOURCE_DTYPE, count=meta["count"])
    now = np.array([stat_row(p) for p in source.files],
                   dtype=[(f, SOURCE_DTYPE[f]) for f in STAT_FIELDS])
    moved = np.nonzero(np.any([recorded[f] != now[f] for f in STAT_FIELDS], axis=0))[0]
    changed, refreshed = [], {}
    for i in moved.tolist():
        row, _ = file_record(source.files[i])
        if row[4] != int(recorded["hash"][i]) or row[0] != int(recorded["size"][i]):
            changed.append(source.files[i])
        else:
            refreshed[i] = row
    if refreshed and not changed:
        _refresh(folder / SOURCES, refreshed)
    return changed


def _refresh(path: Path, rows: dict[int, tuple]) -> None:
    """Record the new stats of files whose content did not change (so the next open does
    not hash them again); a read-only cache keeps the old ones."""
    try:
        table = np.memmap(path, dtype=SOURCE_DTYPE, mode="r+")
    except OSError:
        return
    for i, row in rows.items():
        table[i] = row
    table.flush()
    del table


def valid_cache(folder: Path, spec: CacheSpec, source: FolderStorage) -> dict[str, Any] | None:
    """The metadata of a cache that matches spec and source; None if there is none to use.

    Raises CacheError when a cache for this spec exists but its files are damaged. Takes
    no lock and writes nothing that must succeed: it works on a read-only filesystem.
    """
    meta = read_meta(folder, spec)
    if meta is None:
        return None
    if meta.get("version") != spec.version or meta.get("settings") != spec.settings():
        log.info("%s cache %s was built by another version or settings: rebuilding",
                 spec.kind, folder)
        return None
    if meta["layout"] != layout_fingerprint(source) or meta["count"] != len(source):
        log.info("files were added, removed or renamed in the source since %s was built: "
                 "rebuilding", folder)
        return None
    check_cache(folder, meta, spec)
    changed = changed_files(folder, meta, source)
    if changed:
        log.info("%d source files changed since %s was built (e.g. %s): rebuilding",
                 len(changed), folder, printable(changed[0]))
        return None
    return meta


def skipped_files(meta: dict[str, Any]) -> list[SkippedFile]:
    """The undecodable files a cache's metadata lists."""
    return [SkippedFile(s["path"], s["error"], s["index"]) for s in meta["skipped"]]


def check_skipped(meta: dict[str, Any], source: FolderStorage) -> None:
    """``dataset.on_corrupt=fail`` holds for a cache too: refuse one that lists files it
    could not decode."""
    if source.on_corrupt is OnCorrupt.fail and meta["skipped"]:
        first = meta["skipped"][0]
        raise CorruptFileStop(
            f"the cache lists {len(meta['skipped'])} undecodable source files, e.g. cannot "
            f"decode {printable(first['path'])}: {first['error']} (dataset.on_corrupt=skip "
            "skips such files)")


def open_cache(folder: FolderStorage, spec: CacheSpec, cache_root: Path,
               progress: bool = True) -> DecodedStorage:
    """The memmap cache of ``folder`` as a storage (converted first if there is no valid one)."""
    cache, meta = ensure_cache(folder, spec, cache_root, progress)
    check_skipped(meta, folder)
    return DecodedStorage(open_images(cache, meta), open_labels(cache, meta),
                          skipped_files(meta), folder.classes, folder.names(), folder.root,
                          files=[str(cache / IMAGES)], reopen=lambda: open_images(cache, meta))


# --- conversion ---------------------------------------------------------------------------

def ensure_cache(folder_storage: FolderStorage, spec: CacheSpec, cache_root: Path,
                 progress: bool = True, rebuild: bool = False) -> tuple[Path, dict[str, Any]]:
    """The folder and metadata of a valid cache for ``spec``, converting first if needed.

    A valid cache is opened without a lock (it may sit on a read-only filesystem); only a
    conversion locks, so concurrent callers convert once and the others wait and reuse it.
    """
    final = spec.folder(cache_root)
    if not rebuild:
        meta = valid_cache(final, spec, folder_storage)
        if meta is not None:
            return final, meta
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(final) + ".lock")
        lock.acquire()
    except OSError as e:
        raise CacheError(f"cannot build the {spec.kind} cache in {final.parent}: "
                         f"{e.strerror or e}. Point RUNNER_CACHE (dataset.cache_dir) at a "
                         "writable folder, or build the cache where it can be written with "
                         f"{spec.rebuild_command()}") from e
    try:
        meta = None if rebuild else valid_cache(final, spec, folder_storage)
        if meta is None:  # nobody converted it while this process waited for the lock
            partial = final.with_name(final.name + ".partial")
            meta = spec.convert(folder_storage, partial, progress)
            old = final.with_name(final.name + ".old")
            if final.exists():
                os.replace(final, old)
            os.replace(partial, final)  # the publish: meta.json arrives with the pixels
            shutil.rmtree(old, ignore_errors=True)
            log.info("%s cache ready: %s (%d images, %d skipped)", spec.kind, final,
                     meta["count"], len(meta["skipped"]))
    finally:
        lock.release()
    return final, meta


def disk_full(path: Path, size: int, held: int = 0, estimated: bool = False,
              also: str = "") -> DiskFull:
    """The error for a cache file at ``path`` that needs ``size`` bytes (``held`` of them
    already allocated to it): the bytes needed and free, and what to do."""
    free = shutil.disk_usage(path.parent).free + held
    about = "about " if estimated else ""
    source = ", estimated from a sample" if estimated else ""
    return DiskFull(
        errno.ENOSPC,
        f"not enough disk space for the cache in {path.parent}: it needs {about}"
        f"{size / GiB:.2f} GiB ({size:,} bytes{source}), {free / GiB:.2f} GiB are free there. "
        f"Free some space, {also}or put the cache on a larger disk with RUNNER_CACHE=/path "
        "(dataset.cache_dir)")


def reserve(path: Path, size: int) -> None:
    """Allocate ``size`` bytes of ``path`` on disk now, so a full disk fails here, at
    once, and not as a SIGBUS in a worker writing into a sparse mapping later."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if size > 0:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise disk_full(path, size, os.fstat(fd).st_blocks * 512) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, as before
    finally:
        os.close(fd)


def _convert(folder_storage: FolderStorage, spec: CacheSpec, partial: Path,
             progress: bool) -> dict[str, Any]:
    count = len(folder_storage)
    plan = {"version": CACHE_VERSION, "settings": spec.settings(),
            "layout": layout_fingerprint(folder_storage), "count": count}
    done = open_partial(partial, plan)
    reserve(partial / IMAGES, count * image_nbytes(spec.image_size))  # zeros until decoded
    reserve(partial / SOURCES, count * SOURCE_DTYPE.itemsize)
    if not done:
        (partial / LABELS).write_bytes(folder_storage.label_tensor().numpy().tobytes())
        write_json(partial / PLAN, plan)
    chunks = chunk_ranges(count)
    todo = [c for c in chunks if c[0] not in done]
    if done:
        log.info("resuming the conversion in %s: %d of %d chunks already done", partial,
                 len(done), len(chunks))
    images = open_images(partial, {"count": count, "image_size": spec.image_size}, writable=True)
    sources = np.memmap(partial / SOURCES, dtype=SOURCE_DTYPE, mode="r+", shape=(count,))
    with open(partial / IMAGES, "rb+") as pixels, open(partial / DONE, "a") as record:
        def on_chunk(chunk: tuple[int, int], skipped: list[SkippedFile]) -> None:
            sources.flush()
            os.fdatasync(pixels.fileno())  # the pixels reach the disk before the record does
            entry = {"start": chunk[0], "skipped": [[s.index, s.path, s.error] for s in skipped]}
            record.write(json.dumps(entry) + "\n")
            record.flush()
            os.fsync(record.fileno())
            done[chunk[0]] = entry["skipped"]

        decode_into(images, folder_storage, todo, progress, on_chunk, total=count,
                    already=count - sum(e - s for s, e in todo), sources=sources)
    sources.flush()
    del images
    skipped = sorted((s for entries in done.values() for s in entries), key=lambda s: s[0])
    meta = {**plan, "image_size": list(spec.image_size), "dtype": "uint8",
            "classes": folder_storage.classes,
            "skipped": [{"index": i, "path": p, "error": e} for i, p, e in skipped]}
    write_json(partial / META, meta)
    for name in (PLAN, DONE):
        (partial / name).unlink()
    return meta


def open_partial(partial: Path, plan: dict[str, Any]) -> dict[int, list]:
    """The chunks an interrupted conversion of the same ``plan`` finished in ``partial``
    (their skipped files by chunk start); an empty ``partial`` to start over when there is
    nothing to resume."""
    done = _resume(partial, plan)
    if done is None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        done = {}
    return done


def _resume(partial: Path, plan: dict[str, Any]) -> dict[int, list] | None:
    """Chunks a previous, interrupted conversion of the same plan finished, or None."""
    try:
        if json.loads((partial / PLAN).read_text()) != plan:
            return None
    except (OSError, ValueError):
        return None
    done: dict[int, list] = {}
    try:
        lines = (partial / DONE).read_text().splitlines()
    except OSError:
        return done
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # the last line of a killed writer may be cut short
            continue
        done[entry["start"]] = [tuple(s) for s in entry["skipped"]]
    return done


# Worker processes are forked with this set: they inherit the target mapping and the
# folder storage instead of receiving them by pickling.
_JOB: tuple[torch.Tensor, FolderStorage, np.ndarray | None] | None = None


def _decode_chunk(chunk: tuple[int, int]) -> tuple[tuple[int, int], list[SkippedFile]]:
    target, folder_storage, sources = _JOB
    skipped = []
    for i in range(*chunk):
        row, data = file_record(folder_storage.samples[i][0])
        # decodes, or raises with the path for on_corrupt=fail
        item = folder_storage.decode_data(i, data)
        if sources is not None:
            sources[i] = row
        if isinstance(item, SkippedFile):
            skipped.append(item)
        else:
            target[i] = item.image
    return chunk, skipped


def _init_worker() -> None:
    torch.set_num_threads(1)  # one process per core already


def decode_into(target: torch.Tensor, folder_storage: FolderStorage,
                chunks: list[tuple[int, int]], progress: bool, on_chunk=None,
                total: int | None = None, already: int = 0,
                sources: np.ndarray | None = None) -> list[SkippedFile]:
    """Decode ``chunks`` of ``folder_storage`` into rows of ``target`` with every core,
    recording each file's stat and content hash in ``sources`` when given.

    ``target`` (and ``sources``) must be shared with forked children: a file mapping, or
    shared memory. A worker that dies fails this at once (``runner.data.pool.WorkerDied``).
    """
    global _JOB
    skipped: list[SkippedFile] = []
    bar = tqdm(total=total or len(folder_storage), initial=already, unit="img",
               desc="decoding", disable=not progress)
    _JOB = (target, folder_storage, sources)
    try:
        for chunk, chunk_skipped in parallel_imap(_decode_chunk, chunks, initializer=_init_worker):
            skipped += chunk_skipped
            if on_chunk is not None:
                on_chunk(chunk, chunk_skipped)
            bar.update(chunk[1] - chunk[0])
    finally:
        _JOB = None
        bar.close()
    return skipped
