"""The cache engine every converted store shares (``loader=memmap``, ``packed``, ``ffcv``).

A store is built once from an image folder and reused until its source changes. What each
store adds is its own ``StoreSpec``: what its bytes depend on (``settings``), the overrides
that select it, the files it holds and its encode loop (``convert``). Everything else is
here, written once:

- **keyed**: each distinct spec gets its own folder, ``<cache root>/<kind>/<label>-<digest>``;
- **fingerprinted**: the source's layout (relative names and classes, so the same folder
  spelled differently is the same source) and every file's size, mtime, ctime, inode and a
  BLAKE2b hash of its bytes (``sources.bin``). Opening compares the stats only (one ``stat``
  per file) and hashes again just the files whose stat moved, so an unchanged folder costs
  no reads, and a rewrite that kept the mtime (``cp -p``, ``rsync -a``, tar) is still seen;
  a detection set's boxes as the listing parsed them, a masks set's mask files' bytes
  (``targets_fingerprint``: format, classes, then the target kind's ``fingerprint``), so
  an edited label file or mask, or labels read another way, rebuilds the store instead of
  serving stale targets (a store of the same folder without them has none, and its kind's
  settings give it a folder of its own);
- **resumable**: the conversion builds in ``<key>.partial``; its ``Journal`` records each
  finished chunk (``done.jsonl``) only after the chunk's bytes are synced, so a rerun after a
  kill redoes only the unfinished chunks and gives the same bytes;
- **reserved**: space is allocated before it is written (``reserve``): a disk too small fails
  at once with the bytes needed and free (``DiskFull``), never as a SIGBUS or a raw
  ``ENOSPC`` halfway;
- **published atomically**: the finished folder is renamed into place with its ``meta.json``
  (which names the build); a folder without a valid ``meta.json`` is never taken for a
  store. A store is never written in place once published: a rebuild moves the old folder
  aside and unlinks its files, so a reader that opened them keeps reading its own bytes
  (runner/data/storage/memmap.py's readers open the files once, through the folder whose
  ``meta.json`` they checked, and map them again from the open file, never by name);
- **checked**: opening takes no lock and writes nothing that must succeed, so a valid store on
  a read-only mount works; a damaged one (a truncated file, unreadable metadata) is a
  ``CacheError`` that ends with the command that rebuilds it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shlex
import shutil
import uuid
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from filelock import FileLock

from runner.common.atomic import dumps, write_json
from runner.common.errors import UserError
from runner.common.text import human_bytes, printable
from runner.config.schema import OnCorrupt
from runner.data.decode.decoders import CorruptFileStop
from runner.data.protocol import SkippedFile
from runner.data.sources.files import read_file
from runner.data.sources.listing import stat_row
from runner.data.storage.folder import FolderStorage
from runner.data.targets import TARGETS

log = logging.getLogger(__name__)

SOURCES, META, PLAN, DONE = "sources.bin", "meta.json", "plan.json", "done.jsonl"
CHUNK = 64  # images per conversion task: the unit of progress and of resumption

# One row per source file, as it was when the conversion read it.
SOURCE_DTYPE = np.dtype([("size", "<i8"), ("mtime", "<i8"), ("ctime", "<i8"), ("ino", "<u8"),
                         ("hash", "<u8")])
STAT_FIELDS = ("size", "mtime", "ctime", "ino")


class CacheError(UserError, RuntimeError):
    """A store that exists but cannot be trusted; the message says how to rebuild it."""


class DiskFull(UserError, OSError):
    """Not enough free space for a store; the message gives the bytes needed and free."""


class StoreSpec:
    """What a store's bytes depend on; each distinct spec gets its own folder.

    A store is a frozen dataclass that sets ``kind`` (its sub-folder and its name in
    messages and in ``python -m runner.prepare <kind>``) and ``version``, and defines:

    - ``settings()``: everything its bytes depend on (the cache key);
    - ``label()``: the readable part of its folder's name;
    - ``overrides()``: the runner overrides that select it (they make the rebuild command);
    - ``file_sizes(folder, meta)``: the bytes each of its files must hold;
    - ``convert(folder, journal, progress)``: its encode loop, into ``journal.folder``.
    """

    kind: ClassVar[str]
    version: ClassVar[int]
    source: Path

    def settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def label(self) -> str:
        raise NotImplementedError

    def overrides(self) -> list[str]:
        raise NotImplementedError

    def file_sizes(self, folder: Path, meta: dict[str, Any]) -> dict[str, int]:
        raise NotImplementedError

    def convert(self, folder_storage: FolderStorage, journal: Journal, progress: bool
                ) -> dict[str, Any]:
        raise NotImplementedError

    def folder(self, cache_root: Path) -> Path:
        digest = hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode())
        name = f"{self.source.name}-{self.label()}-{digest.hexdigest()[:10]}"
        return Path(cache_root).expanduser() / self.kind / name

    def rebuild_command(self) -> str:
        """The command that rebuilds this store, ready to paste into a shell."""
        return shlex.join(["python", "-m", "runner.prepare", self.kind, "--rebuild",
                           *self.overrides()])

    def damaged(self, folder: Path, what: str) -> CacheError:
        return CacheError(f"the {self.kind} store {folder} is damaged: {what}. Rebuild it "
                          f"with: {self.rebuild_command()}  (or delete the folder)")


# --- the source's fingerprint ---------------------------------------------------------------

def layout_fingerprint(folder: FolderStorage) -> str:
    """Changes when a file is added, removed or renamed, or a class renamed (a detection
    set's boxes: ``targets_fingerprint``); the names are relative to the root, so the same
    folder spelled differently has the same layout."""
    digest = hashlib.sha256("\n".join(folder.classes).encode())
    for path, label in folder.samples:
        digest.update(b"\n" + os.fsencode(os.path.relpath(path, folder.root)) + b"\t%d" % label)
    return digest.hexdigest()


def targets_fingerprint(folder: FolderStorage) -> str | None:
    """A digest of the targets a store keeps, as the listing has them (None: none): their
    format and classes, then what their kind's record says a store depends on (its
    ``fingerprint``: boxes as parsed, each mask file's bytes), so an edited label file
    rebuilds the store, whatever its stat says."""
    targets = folder.targets
    if targets is None:
        return None
    digest = hashlib.sha256(f"{targets.format}\n".encode() + "\n".join(folder.classes).encode())
    TARGETS[targets.kind].fingerprint(targets, digest)
    return digest.hexdigest()


def content_hash(data: bytes | bytearray) -> int:
    """A 64-bit BLAKE2b digest of a file's bytes."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


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


# --- opening --------------------------------------------------------------------------------

def read_meta(folder: Path, spec: StoreSpec) -> dict[str, Any] | None:
    """The store's metadata: None when there is no store folder; CacheError when there is
    one whose metadata is unreadable or not of the shape this version writes."""
    if not folder.exists():
        return None
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        if isinstance(e, FileNotFoundError) and not folder.exists():
            return None  # replaced by another process's rebuild while this one looked
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


def check_files(folder: Path, meta: dict[str, Any], spec: StoreSpec) -> None:
    """Raise CacheError unless the files are exactly as large as ``meta`` says."""
    sizes = {**spec.file_sizes(folder, meta), SOURCES: meta["count"] * SOURCE_DTYPE.itemsize}
    for name, size in sizes.items():
        path = folder / name
        actual = path.stat().st_size if path.exists() else None
        if actual != size:
            what = "is missing" if actual is None else f"holds {actual} bytes"
            raise spec.damaged(folder, f"{name} {what}, its metadata says {size} bytes")


def changed_files(folder: Path, meta: dict[str, Any], source: FolderStorage) -> list[str]:
    """Source files whose content differs from what the store was built from.

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
    not hash them again); a read-only store keeps the old ones."""
    try:
        table = np.memmap(path, dtype=SOURCE_DTYPE, mode="r+")
    except OSError:
        return
    for i, row in rows.items():
        table[i] = row
    table.flush()
    del table


def valid_cache(folder: Path, spec: StoreSpec, source: FolderStorage) -> dict[str, Any] | None:
    """The metadata of a store that matches spec and source; None if there is none to use.

    Raises CacheError when a store for this spec exists but its files are damaged. Takes
    no lock and writes nothing that must succeed: it works on a read-only filesystem.
    """
    meta = read_meta(folder, spec)
    if meta is None:
        return None
    if meta.get("version") != spec.version or meta.get("settings") != spec.settings():
        log.info("%s store %s was built by another version or settings: rebuilding",
                 spec.kind, folder)
        return None
    if meta["layout"] != layout_fingerprint(source) or meta["count"] != len(source):
        log.info("files were added, removed or renamed in the source since %s was built: "
                 "rebuilding", folder)
        return None
    if meta.get("targets") != targets_fingerprint(source):
        log.info("the labels (boxes, masks) changed since %s was built: rebuilding", folder)
        return None
    check_files(folder, meta, spec)
    changed = changed_files(folder, meta, source)
    if changed:
        log.info("%d source files changed since %s was built (e.g. %s): rebuilding",
                 len(changed), folder, printable(changed[0]))
        return None
    return meta


def skipped_files(meta: dict[str, Any]) -> list[SkippedFile]:
    """The undecodable files a store's metadata lists."""
    return [SkippedFile(s["path"], s["error"], s["index"]) for s in meta["skipped"]]


def check_skipped(meta: dict[str, Any], source: FolderStorage) -> None:
    """``dataset.on_corrupt=fail`` holds for a store too: refuse one that lists files it
    could not decode."""
    if source.on_corrupt is OnCorrupt.fail and meta["skipped"]:
        first = meta["skipped"][0]
        raise CorruptFileStop(
            f"the store lists {len(meta['skipped'])} undecodable source files, e.g. cannot "
            f"decode {printable(first['path'])}: {first['error']} (dataset.on_corrupt=skip "
            "skips such files)")


# --- building -------------------------------------------------------------------------------

def ensure_cache(folder_storage: FolderStorage, spec: StoreSpec, cache_root: Path,
                 progress: bool = True, rebuild: bool = False) -> tuple[Path, dict[str, Any]]:
    """The folder and metadata of a valid store for ``spec``, converting first if needed.

    A valid store is opened without a lock (it may sit on a read-only filesystem); only a
    conversion locks, so concurrent callers convert once and the others wait and reuse it.
    """
    final = spec.folder(cache_root)
    if not rebuild:
        meta = valid_cache(final, spec, folder_storage)
        if meta is not None:
            check_skipped(meta, folder_storage)
            return final, meta
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(final) + ".lock")
        lock.acquire()
    except OSError as e:
        raise CacheError(f"cannot build the {spec.kind} store in {final.parent}: "
                         f"{e.strerror or e}. Point RUNNER_CACHE (dataset.cache_dir) at a "
                         "writable folder, or build the store where it can be written with: "
                         f"{spec.rebuild_command()}") from e
    try:
        meta = None if rebuild else valid_cache(final, spec, folder_storage)
        if meta is None:  # nobody converted it while this process waited for the lock
            journal = Journal(final.with_name(final.name + ".partial"),
                              conversion_plan(spec, folder_storage))
            try:
                meta = spec.convert(folder_storage, journal, progress)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    full = e if isinstance(e, DiskFull) else \
                        disk_full(journal.folder / (e.filename or "?"), None)
                    journal.release()  # the space it reserved goes back to the disk
                    raise full from e
                raise
            journal.publish(final)
            log.info("%s store ready: %s (%d images, %d skipped)", spec.kind, final,
                     meta["count"], len(meta["skipped"]))
    finally:
        lock.release()
    check_skipped(meta, folder_storage)
    return final, meta


def conversion_plan(spec: StoreSpec, folder_storage: FolderStorage) -> dict[str, Any]:
    """What a conversion of ``folder_storage`` to ``spec`` will build: the metadata a
    finished store starts from, and what a resumed conversion must match."""
    plan = {"version": spec.version, "settings": spec.settings(),
            "layout": layout_fingerprint(folder_storage), "count": len(folder_storage)}
    targets = targets_fingerprint(folder_storage)
    if targets is not None:  # detection: the boxes the store holds (or is keyed by)
        plan["targets"] = targets
    return plan


class Journal:
    """A conversion's ``<key>.partial`` folder: resume or start over, record each finished
    chunk durably, publish.

    Opening resumes an interrupted conversion of the same plan, else starts over in an
    empty folder. ``done`` maps each finished chunk's start to its record (its fields and
    its skipped files, as tuples).
    """

    def __init__(self, folder: Path, plan: dict[str, Any]):
        self.folder, self.plan = Path(folder), plan
        done = _resume(self.folder, plan)
        self.done: dict[int, dict[str, Any]] = {}
        if done is None:  # nothing to resume
            self.start_over()
        else:
            self.done = done

    def release(self) -> None:
        """A conversion refused for want of space: give back what it reserved. Nothing
        finished yet (a refused reservation is the first thing a conversion does): the
        folder goes. Finished chunks are kept for a rerun with more space to resume, and
        the log says where they are."""
        if not self.done:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        log.warning("the store's conversion in %s keeps its %d finished chunks for a rerun "
                    "with more space (delete the folder to free them)", self.folder,
                    len(self.done))

    def start_over(self) -> None:
        """An empty folder (a converter that cannot resume calls this first)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.done = {}

    def start(self) -> None:
        """Write the plan, once the files it describes are in place: from now on a rerun
        resumes instead of starting over."""
        write_json(self.folder / PLAN, self.plan)

    def todo(self, chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The chunks not finished yet (said in the log when some were)."""
        todo = [c for c in chunks if c[0] not in self.done]
        if self.done:
            log.info("resuming the conversion in %s: %d of %d chunks already done",
                     self.folder, len(chunks) - len(todo), len(chunks))
        return todo

    def record(self, start: int, skipped: list[SkippedFile], **fields: Any) -> None:
        """Chunk ``start`` is on disk: record it (synced) with its skipped files."""
        entry = {"start": start, **fields,
                 "skipped": [[s.index, s.path, s.error] for s in skipped]}
        with open(self.folder / DONE, "a") as record:
            record.write(dumps(entry) + "\n")
            record.flush()
            os.fsync(record.fileno())
        entry["skipped"] = [tuple(s) for s in entry["skipped"]]
        self.done[start] = entry

    def finish(self, skipped: list[SkippedFile] = (), **fields: Any) -> dict[str, Any]:
        """The metadata (the plan, ``fields``, every chunk's skipped files and ``skipped``),
        written; the bookkeeping files removed. The folder is then ready to publish."""
        rows = [s for e in self.done.values() for s in e["skipped"]]
        rows += [(s.index, s.path, s.error) for s in skipped]
        meta = {**self.plan, **fields, "build": uuid.uuid4().hex,  # tells rebuilds apart
                "skipped": [{"index": i, "path": p, "error": e}
                            for i, p, e in sorted(rows, key=lambda s: s[0])]}
        write_json(self.folder / META, meta)
        for name in (PLAN, DONE):
            (self.folder / name).unlink(missing_ok=True)
        return meta

    def publish(self, final: Path) -> None:
        """Rename the finished folder into place (``meta.json`` arrives with the data); a
        store it replaces is moved aside first and removed after, and so is one a killed
        rebuild left aside."""
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)  # a kill during an earlier rebuild's removal
        if final.exists():
            os.replace(final, old)
        os.replace(self.folder, final)
        shutil.rmtree(old, ignore_errors=True)


def _resume(partial: Path, plan: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
    """The records of the chunks a previous, interrupted conversion of the same plan
    finished, or None."""
    try:
        if json.loads((partial / PLAN).read_text()) != plan:
            return None
    except (OSError, ValueError):
        return None
    done: dict[int, dict[str, Any]] = {}
    try:
        lines = (partial / DONE).read_text().splitlines()
    except OSError:
        return done
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # the last line of a killed writer may be cut short
            continue
        entry["skipped"] = [tuple(s) for s in entry["skipped"]]
        done[entry["start"]] = entry
    return done


# --- disk space -----------------------------------------------------------------------------

def disk_full(path: Path, size: int | None, held: int = 0, estimated: bool = False,
              also: str = "") -> DiskFull:
    """The error for a store file at ``path`` that needs ``size`` bytes (``held`` of them
    already allocated to it; None: unknown): the bytes needed and free, and what to do."""
    free = shutil.disk_usage(path.parent if path.parent.exists() else Path.cwd()).free + held
    if size is None:
        needs = "more space than is free"
    else:
        about = "about " if estimated else ""
        sample = ", estimated from a sample" if estimated else ""
        needs = f"{about}{human_bytes(size)} ({size:,} bytes{sample})"
    return DiskFull(
        errno.ENOSPC,
        f"not enough disk space for the store in {path.parent}: it needs {needs}, "
        f"{human_bytes(free)} ({free:,} bytes) are free there. Free some space, {also}or put "
        "the store on a larger disk with RUNNER_CACHE=/path (dataset.cache_dir)")


def reserve(path: Path, size: int, offset: int = 0, estimated: bool = False,
            also: str = "") -> None:
    """Allocate bytes ``offset`` to ``offset + size`` of ``path`` on disk now, so a full disk
    fails here, at once, and not as a SIGBUS in a process writing into a sparse mapping or
    an ``ENOSPC`` halfway through the conversion."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if size > 0:
            os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise disk_full(path, offset + size, os.fstat(fd).st_blocks * 512, estimated,
                            also) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        if os.fstat(fd).st_size < offset + size:  # no fallocate here: sparse, as before
            os.ftruncate(fd, offset + size)
    finally:
        os.close(fd)
