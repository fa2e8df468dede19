"""``loader=memmap``: decode an image folder once into a uint8 MemoryMappedTensor cache.

A cache folder holds ``images.memmap`` (N, 3, H, W) uint8 and ``labels.memmap`` (N,) int64,
both tensordict ``MemoryMappedTensor`` files, and ``meta.json`` (source fingerprint, image
size, decoder, count, skipped files). Slot ``i`` holds file ``i`` of the folder in
ImageFolder order; an undecodable file leaves its slot zero and is listed as skipped.

Conversion (``ensure_cache``):
- decodes with the folder loader itself (same decoder, resize, class indices), in worker
  processes, one chunk of images per task, with a progress bar;
- builds in ``<key>.partial``, whose ``done.jsonl`` records finished chunks after their
  pixels are synced to disk, so a rerun after a kill resumes and gives the same bytes;
- publishes by renaming the finished folder into place, ``meta.json`` included: a folder
  without a valid ``meta.json`` is never taken for a cache;
- rebuilds when the source's fingerprint (names, sizes, mtimes) or the settings differ.
Opening checks the metadata and the file sizes; a damaged cache is a ``CacheError`` that
says how to rebuild it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from tensordict import MemoryMappedTensor
from tqdm import tqdm

from runner.atomic import write_json
from runner.errors import UserError
from runner.pool import parallel_imap
from runner.storage.base import SkippedFile, image_nbytes
from runner.storage.decoded import DecodedStorage
from runner.storage.folder import FolderStorage

log = logging.getLogger(__name__)

CACHE_VERSION = 1
IMAGES, LABELS, META, PLAN, DONE = "images.memmap", "labels.memmap", "meta.json", "plan.json", "done.jsonl"
CHUNK = 64  # images per conversion task: the unit of progress and of resumption


class CacheError(UserError, RuntimeError):
    """A cache that exists but cannot be trusted; the message says how to rebuild it."""


@dataclass(frozen=True)
class CacheSpec:
    """What a cache's pixels depend on; each distinct spec gets its own folder."""

    source: Path
    image_size: tuple[int, int]
    decoder: str
    draft: bool

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


def source_fingerprint(folder: FolderStorage) -> str:
    """Changes when a file is added, removed, renamed, resized or touched, or a class renamed."""
    digest = hashlib.sha256("\n".join(folder.classes).encode())
    for path, label in folder.samples:
        st = os.stat(path)
        digest.update(f"\n{path}\t{label}\t{st.st_size}\t{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def chunk_ranges(count: int) -> list[tuple[int, int]]:
    """[start, end) of each conversion task."""
    return [(s, min(s + CHUNK, count)) for s in range(0, count, CHUNK)]


def image_shape(count: int, image_size: tuple[int, int]) -> tuple[int, int, int, int]:
    return (count, 3, *image_size)


# --- opening ------------------------------------------------------------------------------

def read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None


def check_cache(folder: Path, meta: dict[str, Any], spec: CacheSpec) -> None:
    """Raise CacheError unless the files are exactly as large as ``meta`` says."""
    count = meta.get("count")
    expected = {IMAGES: None, LABELS: None}
    if isinstance(count, int) and meta.get("image_size") == list(spec.image_size):
        expected = {IMAGES: count * image_nbytes(spec.image_size), LABELS: count * 8}
    for name, size in expected.items():
        path = folder / name
        actual = path.stat().st_size if path.exists() else None
        if size is None or actual != size:
            what = "is missing" if actual is None else f"holds {actual} bytes"
            raise CacheError(
                f"the memmap cache {folder} is damaged: {name} {what}, its metadata says "
                f"{size} bytes. Rebuild it with: {spec.rebuild_command()}  (or delete the folder)"
            )


def open_images(folder: Path, meta: dict[str, Any], writable: bool = False) -> MemoryMappedTensor:
    shape = image_shape(meta["count"], tuple(meta["image_size"]))
    # mode "r" maps copy-on-write: a reader can never change the cache on disk
    return MemoryMappedTensor.from_filename(folder / IMAGES, dtype=torch.uint8,
                                            shape=torch.Size(shape), mode="r+" if writable else "r")


def open_labels(folder: Path, meta: dict[str, Any]) -> torch.Tensor:
    labels = MemoryMappedTensor.from_filename(folder / LABELS, dtype=torch.int64,
                                              shape=torch.Size([meta["count"]]), mode="r")
    return labels.clone()  # small: keep it in RAM


def valid_cache(folder: Path, spec: CacheSpec, fingerprint: str) -> dict[str, Any] | None:
    """The metadata of a cache that matches spec and source; None if there is none to use.

    Raises CacheError when a cache for this spec exists but its files are damaged.
    """
    meta = read_meta(folder)
    if meta is None:
        if folder.exists():
            raise CacheError(f"the memmap cache {folder} has no readable {META}. Rebuild it "
                             f"with: {spec.rebuild_command()}  (or delete the folder)")
        return None
    if meta.get("version") != CACHE_VERSION or meta.get("settings") != spec.settings():
        log.info("memmap cache %s was built by another version or settings: rebuilding", folder)
        return None
    if meta.get("fingerprint") != fingerprint:
        log.info("the source folder changed since %s was built: rebuilding", folder)
        return None
    check_cache(folder, meta, spec)
    return meta


def skipped_files(meta: dict[str, Any]) -> list[SkippedFile]:
    """The undecodable files a cache's metadata lists."""
    return [SkippedFile(s["path"], s["error"], s["index"]) for s in meta["skipped"]]


def open_cache(folder: FolderStorage, spec: CacheSpec, cache_root: Path,
               progress: bool = True) -> DecodedStorage:
    """The memmap cache of ``folder`` as a storage (converted first if there is no valid one)."""
    cache, meta = ensure_cache(folder, spec, cache_root, progress)
    return DecodedStorage(open_images(cache, meta), open_labels(cache, meta),
                          skipped_files(meta), folder.classes, folder.names(), folder.root,
                          files=[str(cache / IMAGES)], reopen=lambda: open_images(cache, meta))


# --- conversion ---------------------------------------------------------------------------

def ensure_cache(folder_storage: FolderStorage, spec: CacheSpec, cache_root: Path,
                 progress: bool = True, rebuild: bool = False) -> tuple[Path, dict[str, Any]]:
    """The folder and metadata of a valid cache for ``spec``, converting first if needed.

    Safe against concurrent callers (one converts, the others wait on a lock and reuse).
    """
    final = spec.folder(cache_root)
    final.parent.mkdir(parents=True, exist_ok=True)
    fingerprint = source_fingerprint(folder_storage)
    with FileLock(str(final) + ".lock"):
        if not rebuild:
            meta = valid_cache(final, spec, fingerprint)
            if meta is not None:
                return final, meta
        partial = final.with_name(final.name + ".partial")
        meta = _convert(folder_storage, spec, fingerprint, partial, progress)
        old = final.with_name(final.name + ".old")
        if final.exists():
            os.replace(final, old)
        os.replace(partial, final)  # the publish: meta.json arrives with the pixels
        shutil.rmtree(old, ignore_errors=True)
    log.info("memmap cache ready: %s (%d images, %d skipped)", final, meta["count"],
             len(meta["skipped"]))
    return final, meta


def _convert(folder_storage: FolderStorage, spec: CacheSpec, fingerprint: str, partial: Path,
             progress: bool) -> dict[str, Any]:
    count = len(folder_storage)
    plan = {"version": CACHE_VERSION, "settings": spec.settings(), "fingerprint": fingerprint,
            "count": count}
    done = _resume(partial, plan)
    if done is None:  # nothing to resume: start over
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with open(partial / IMAGES, "wb") as f:
            f.truncate(count * image_nbytes(spec.image_size))  # zeros
        (partial / LABELS).write_bytes(folder_storage.label_tensor().numpy().tobytes())
        write_json(partial / PLAN, plan)
        done = {}
    chunks = chunk_ranges(count)
    todo = [c for c in chunks if c[0] not in done]
    if done:
        log.info("resuming the conversion in %s: %d of %d chunks already done", partial,
                 len(done), len(chunks))
    images = open_images(partial, {"count": count, "image_size": spec.image_size}, writable=True)
    with open(partial / IMAGES, "rb+") as pixels, open(partial / DONE, "a") as record:
        def on_chunk(chunk: tuple[int, int], skipped: list[SkippedFile]) -> None:
            os.fdatasync(pixels.fileno())  # the pixels reach the disk before the record does
            entry = {"start": chunk[0], "skipped": [[s.index, s.path, s.error] for s in skipped]}
            record.write(json.dumps(entry) + "\n")
            record.flush()
            os.fsync(record.fileno())
            done[chunk[0]] = entry["skipped"]

        decode_into(images, folder_storage, todo, progress, on_chunk, total=count,
                    already=count - sum(e - s for s, e in todo))
    del images
    skipped = sorted((s for entries in done.values() for s in entries), key=lambda s: s[0])
    meta = {**plan, "image_size": list(spec.image_size), "dtype": "uint8",
            "classes": folder_storage.classes,
            "skipped": [{"index": i, "path": p, "error": e} for i, p, e in skipped]}
    write_json(partial / META, meta)
    for name in (PLAN, DONE):
        (partial / name).unlink()
    return meta


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
_JOB: tuple[torch.Tensor, FolderStorage] | None = None


def _decode_chunk(chunk: tuple[int, int]) -> tuple[tuple[int, int], list[SkippedFile]]:
    target, folder_storage = _JOB
    skipped = []
    for i in range(*chunk):
        item = folder_storage[i]  # decodes, or raises with the path for on_corrupt=fail
        if isinstance(item, SkippedFile):
            skipped.append(item)
        else:
            target[i] = item.image
    return chunk, skipped


def _init_worker() -> None:
    torch.set_num_threads(1)  # one process per core already


def decode_into(target: torch.Tensor, folder_storage: FolderStorage,
                chunks: list[tuple[int, int]], progress: bool, on_chunk=None,
                total: int | None = None, already: int = 0) -> list[SkippedFile]:
    """Decode ``chunks`` of ``folder_storage`` into rows of ``target`` with every core.

    ``target`` must be shared with forked children: a file mapping, or shared memory.
    """
    global _JOB
    skipped: list[SkippedFile] = []
    bar = tqdm(total=total or len(folder_storage), initial=already, unit="img",
               desc="decoding", disable=not progress)
    _JOB = (target, folder_storage)
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
