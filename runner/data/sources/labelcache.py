"""The labels cache (``dataset.cache_dir``): a detection set's label files parsed once and
its images' sizes read once, each kept with the file's stat, so a run's start-up does not
grow with its label files (ultralytics' ``labels.cache`` idea).

One JSON file per labels source (a YOLO labels folder, a COCO JSON) under
``<dataset.cache_dir>/labels/``, named by a digest of the source's real path:

- ``files``: a label file's path relative to the source -> its stat row (size, mtime_ns,
  ctime_ns, inode: ``listing.stat_row``, what a packed store keys its label files by), its
  well-formed lines' class ids, normalised xyxy boxes and line numbers, and the bad lines
  it held (kind and reason, said again on every run as on the first);
- ``sizes``: an image's path (as listed) -> its stat row and upright (height, width).

An entry is used only when the file's stat now is the one recorded (taken before it was
read: an edit during the read is seen next time); any other file is read and parsed again.
The cache is written whole (runner/common/atomic.py) when something in it changed, and
only the entries of this run's files are kept. A cache that cannot be read or whose
entries are not what this module writes is not trusted: it is said once and rebuilt; one
that cannot be written (a read-only cache folder) only costs the next run its reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.common.atomic import write_atomic
from runner.common.text import printable
from runner.data.sources.listing import stat_row

log = logging.getLogger(__name__)

VERSION = 1
FOLDER = "labels"  # under dataset.cache_dir


@dataclass(frozen=True)
class ParsedFile:
    """A label file's well-formed lines (class ids int64 [n], normalised xyxy float64
    [n, 4], line numbers) and its bad ones ((kind, reason) each)."""

    ids: np.ndarray
    boxes: np.ndarray
    lines: list[int]
    issues: list[tuple[str, str]]


def cache_file(cache_dir: str | Path, source: str | Path) -> Path:
    """Where the cache of ``source`` (a labels folder, a COCO JSON) lives."""
    key = hashlib.sha256(os.path.realpath(source).encode(errors="surrogateescape"))
    return Path(cache_dir).expanduser() / FOLDER / f"{key.hexdigest()[:20]}.json"


class LabelCache:
    """The cache of one labels source; ``cache_dir`` None: nothing kept (every file read).

    Args:
        cache_dir: ``dataset.cache_dir``, or None.
        source: the labels folder (YOLO) or the JSON (COCO); the files' keys are relative
            to it.
        stats: label files' stat rows taken already (before any read), by path: not
            taken again.
    """

    def __init__(self, cache_dir: str | Path | None, source: str | Path,
                 stats: dict[str, tuple[int, int, int, int]] | None = None):
        self.source = Path(source)
        self.stats = stats or {}
        self.base = self.source.parent if self.source.is_file() else self.source
        self.path = cache_file(cache_dir, source) if cache_dir is not None else None
        self.old_files: dict = {}
        self.old_sizes: dict = {}
        self.files: dict[str, list] = {}
        self.sizes: dict[str, list] = {}
        self.dirty = False
        self.hits = self.reads = 0
        if self.path is not None:
            self._load()

    def _load(self) -> None:
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            self.dirty = True
            return
        except OSError as e:
            log.info("labels cache %s cannot be read (%s): the labels are read again",
                     printable(str(self.path)), e)
            self.dirty = True
            return
        try:
            data = json.loads(text)
            ok = (isinstance(data, dict) and data.get("version") == VERSION
                  and data.get("source") == os.path.realpath(self.source)
                  and isinstance(data.get("files"), dict) and isinstance(data.get("sizes"), dict))
        except ValueError:
            ok = False
        if not ok:
            log.warning("labels cache %s is damaged or of another version: not trusted, "
                        "the labels are read again and it is rewritten",
                        printable(str(self.path)))
            self.dirty = True
            return
        self.old_files, self.old_sizes = data["files"], data["sizes"]

    def _key(self, path: str | Path) -> str:
        path, prefix = str(path), os.path.join(str(self.base), "")
        # a prefix cut (the files were found under it): relpath's abspaths cost more
        return path[len(prefix):] if path.startswith(prefix) else os.path.relpath(path,
                                                                                  self.base)

    def parsed(self, file: Path, parse: Callable[[Path, str], ParsedFile]
               ) -> ParsedFile | str:
        """``file``'s parse: the cached one when its stat is the recorded one, else
        ``parse(file, text)`` of its text now (a UTF-8 BOM dropped, as ultralytics reads
        label files); why it cannot be read, as a str."""
        stat = list(self.stats.get(str(file)) or stat_row(str(file)))  # before the read
        key = self._key(file)
        entry = self.old_files.get(key)
        got = _entry_file(entry, stat)
        if got is not None:
            self.hits += 1
            self.files[key] = entry
            return got
        try:
            text = file.read_text(encoding="utf-8-sig", errors="replace")
        except OSError as e:
            return f"cannot be read ({e})"
        self.reads += 1
        got = parse(file, text)
        if any(stat):
            self.files[key] = [stat, got.ids.tolist(), got.boxes.reshape(-1).tolist(),
                               list(got.lines), [list(i) for i in got.issues]]
            self.dirty = True
        return got

    def size(self, image: str) -> tuple[list[int], tuple[int, int] | None]:
        """``image``'s stat row and its cached upright (height, width), or None."""
        stat = list(stat_row(image))
        entry = self.old_sizes.get(image)
        try:
            if any(stat) and entry[0] == stat and len(entry) == 3:
                h, w = int(entry[1]), int(entry[2])
                if h > 0 and w > 0:
                    self.sizes[image] = entry
                    return stat, (h, w)
        except (TypeError, IndexError, ValueError):
            pass
        return stat, None

    def put_size(self, image: str, stat: list[int], size: tuple[int, int]) -> None:
        if any(stat):
            self.sizes[image] = [stat, int(size[0]), int(size[1])]
            self.dirty = True

    def save(self) -> None:
        """The cache written whole, with this run's entries only, when anything changed."""
        if self.path is None:
            return
        if not self.dirty and (len(self.files) != len(self.old_files)
                               or len(self.sizes) != len(self.old_sizes)):
            self.dirty = True  # files gone since: their entries go too
        if not self.dirty:
            return
        payload = {"version": VERSION, "source": os.path.realpath(self.source),
                   "files": self.files, "sizes": self.sizes}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(payload, separators=(",", ":")).encode())
        except OSError as e:
            log.info("labels cache %s cannot be written (%s): the next run reads the labels "
                     "again", printable(str(self.path)), e)
        self.dirty = False


def _entry_file(entry: object, stat: list[int]) -> ParsedFile | None:
    """A cached file's parse, if ``entry`` is one of this module's for the file as it is
    now (``stat``); None for anything else (an entry of an edited file, or a damaged one)."""
    if not any(stat) or not isinstance(entry, list) or len(entry) != 5 or entry[0] != stat:
        return None
    _, ids, boxes, lines, issues = entry
    try:
        ids = np.array(ids, dtype=np.int64).reshape(-1)
        boxes = np.array(boxes, dtype=np.float64).reshape(-1, 4)
        lines = [int(n) for n in lines]
        issues = [(str(kind), str(why)) for kind, why in issues]
    except (TypeError, ValueError):
        return None
    if any(kind != "malformed" for kind, _ in issues):  # the one kind a parse reports
        return None
    if not (len(ids) == len(boxes) == len(lines)) or not np.isfinite(boxes).all():
        return None
    return ParsedFile(ids, boxes, lines, issues)
